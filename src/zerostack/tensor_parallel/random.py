"""Random numbers under tensor parallelism: one stream shared by the tp ranks, one per rank.

Outside a tp-split region every tp rank holds the same activations, so dropout there must draw the
same mask on every rank: it uses the default generator, seeded alike. Inside a split region (the
attention heads of one rank, a sequence shard) each rank must draw its own mask: it runs under
``get_rng_tracker().fork()``, which swaps in a generator state seeded per tp rank and swaps the
default one back afterwards::

    model_parallel_seed(1234, topo)        # default: 1234 everywhere; tp stream: per tp rank
    with get_rng_tracker().fork():
        y = F.dropout(y, 0.1)              # differs across tp ranks

:func:`zerostack.activation_checkpointing.checkpoint` recomputes a function in backward with the
tracker's states (and torch's) as they were in forward, so recomputed dropout masks are the forward
masks.
"""

from __future__ import annotations

import contextlib

import torch

from ..topology import Topology

MODEL_PARALLEL_RNG = "model-parallel-rng"
TP_SEED_OFFSET = 2718  # Megatron's offset, so the tp streams never equal the shared one


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _get_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states that can be swapped in for the default generator of a device."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        """Start stream ``name`` from ``seed`` (an error if it exists: seeds are set once)."""
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists")
        device_type = _device_type()
        saved = _get_state(device_type)
        torch.manual_seed(seed) if device_type == "cpu" else torch.cuda.manual_seed(seed)
        self.states[name] = _get_state(device_type)
        _set_state(saved, device_type)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}

    def reset(self) -> None:
        self.states.clear()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Draw from stream ``name`` inside the block; the default stream is left untouched."""
        if name not in self.states:
            raise RuntimeError(
                f"RNG stream {name!r} is not seeded; call "
                "zerostack.tensor_parallel.model_parallel_seed(seed, topology) first"
            )
        device_type = _device_type()
        saved = _get_state(device_type)
        _set_state(self.states[name], device_type)
        try:
            yield
        finally:
            self.states[name] = _get_state(device_type)
            _set_state(saved, device_type)


_TRACKER = RNGStatesTracker()  # process-wide, like torch's own default generator


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_seed(seed: int, topology: Topology) -> None:
    """Seed the default generator with ``seed`` (alike on every tp rank) and the tp stream with
    ``seed + 2718 + tp_rank`` (different on every tp rank)."""
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + TP_SEED_OFFSET + topology.rank("tp"))


def ensure_seeded(topology: Topology) -> None:
    """Seed the tp stream from torch's initial seed unless the user already did."""
    if MODEL_PARALLEL_RNG not in _TRACKER.states:
        seed = torch.initial_seed() + TP_SEED_OFFSET + topology.rank("tp")
        _TRACKER.add(MODEL_PARALLEL_RNG, seed)
