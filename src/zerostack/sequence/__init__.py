"""Ulysses sequence parallelism (DeepSpeed-Ulysses): each of ``sp`` ranks holds a shard of the
sequence; around attention an all-to-all trades it for a shard of the heads, so attention sees
the whole sequence (:class:`DistributedAttention`). Everything outside attention works on the
shard as it is: the embeddings, layer norms, MLPs and the loss are per token.

The sp ranks are neighbours on the dp axis of the grid (``Topology.build(sp=2)``, or the
config's ``sequence_parallel_size``); they read one batch, each its own shard of the sequence
(:func:`shard_sequence`), and ZeRO reduces gradients over the whole dp axis, sp ranks included.

Ring attention (:func:`ring_attention`, in ``ring.py``) is the other way to attend over a split
sequence: the keys and values travel around the ranks instead of the heads being exchanged, so
it needs no head count divisible by the ranks; causal attention takes zigzag shards
(:func:`zigzag_shard`) to balance the work. The two compose: the config's
``ring_parallel_size`` makes the sp ranks of a batch ring groups of Ulysses neighbours, each
rank holding :func:`sequence_piece` of the sequence (the reference GPT and Hugging Face models
under ``register_with_transformers`` run both).
"""

from .layer import DistributedAttention, seq_all_to_all, shard_sequence
from .ring import ring_attention, sequence_piece, sequence_unpiece, zigzag_shard, zigzag_unshard
from .tiled import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute

__all__ = [
    "DistributedAttention",
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "ring_attention",
    "seq_all_to_all",
    "sequence_piece",
    "sequence_tiled_compute",
    "sequence_unpiece",
    "shard_sequence",
    "zigzag_shard",
    "zigzag_unshard",
]
