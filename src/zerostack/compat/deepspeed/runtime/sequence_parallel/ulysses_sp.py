"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: ``UlyssesSPAttentionHF`` (with
``register_with_transformers``) and ``UlyssesSPDataLoaderAdapter``, zerostack's
(:mod:`zerostack.sequence.hf_ulysses`); ``ulysses_sp_loss`` is zerostack's token-weighted loss
over the sp ranks. The tiled compute (``TiledMLP``, ``SequenceTiledCompute``,
``sequence_tiled_compute``, ``TiledFusedLogitsLoss``) is :mod:`zerostack.sequence.tiled`."""

from zerostack.sequence.hf_ulysses import (
    UlyssesSPAttentionHF,
    UlyssesSPDataLoaderAdapter,
    ulysses_sp_loss,
)
from zerostack.sequence.tiled import (
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)

__all__ = [
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "sequence_tiled_compute",
    "ulysses_sp_loss",
]
