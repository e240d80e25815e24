"""Megatron-style tensor parallelism and sequence parallelism on the tp axis of the grid.

* :mod:`.mappings`: the region boundaries (``copy_to_tp``, ``reduce_from_tp``, ...), named
  autograd Functions whose collectives the ``CommLog`` counts.
* :mod:`.layers`: ``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``,
  ``SequenceParallelLayerNorm``; split/join of tensors between a plain layer and its tp shards.
* :mod:`.cross_entropy`: the loss over vocabulary-split logits.
* :mod:`.random`: one random stream shared by the tp ranks, one per rank
  (``zerostack.activation_checkpointing.checkpoint`` replays both).
"""

from .cross_entropy import vocab_parallel_cross_entropy
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    VocabParallelEmbedding,
    join_tensors,
    mark_split,
    partition_spec,
    split_tensor,
)
from .mappings import (
    SEQ_DIM,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    gather_linear_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    scatter_to_tp,
)
from .random import (
    RNGStatesTracker,
    ensure_seeded,
    get_rng_tracker,
    model_parallel_seed,
)

__all__ = [
    "SEQ_DIM",
    "ColumnParallelLinear",
    "RNGStatesTracker",
    "RowParallelLinear",
    "SequenceParallelLayerNorm",
    "VocabParallelEmbedding",
    "copy_to_tp",
    "ensure_seeded",
    "gather_from_sp",
    "gather_linear_from_sp",
    "gather_from_tp",
    "get_rng_tracker",
    "join_tensors",
    "mark_split",
    "model_parallel_seed",
    "partition_spec",
    "reduce_from_tp",
    "reduce_scatter_to_sp",
    "scatter_to_sp",
    "scatter_to_tp",
    "split_tensor",
    "vocab_parallel_cross_entropy",
]
