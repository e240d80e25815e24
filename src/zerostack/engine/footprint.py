"""What one rank holds, in bytes: zerostack's census of its ZeRO state and optimizer state
(``engine.memory_breakdown()``, ``engine.memory_by_device()``), and the CUDA allocators' own
figures beside it (``engine.device_memory()``). The census counts each live tensor's bytes; the
allocators count what they reserved, rounding included, so the two tell different things."""

from __future__ import annotations

import torch

from ..core.pinned import pinned_bytes
from ..core.run import Run
from ..zero.strategy import tally


class Footprint:
    """The memory figures of one engine's parts (its :class:`~zerostack.core.run.Run`)."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def _optimizer_tensors(self):
        """The optimizer's state tensors (its step counters, scalars, left out)."""
        optimizer = self.run.optimizer
        for state in optimizer.state.values() if optimizer is not None else ():
            for t in state.values():
                if torch.is_tensor(t) and t.dim() > 0:
                    yield t

    def breakdown(self) -> dict[str, int]:
        """Bytes held by this rank: params, grads, master (fp32 copy), scratch (a gradient bucket
        kept between steps, stages 1-2 on the CPU) and optimizer state."""
        state = sum(t.nbytes for t in self._optimizer_tensors())
        return {**self.run.zero.memory_breakdown(), "optimizer": state}

    def by_device(self) -> dict[str, dict[str, int]]:
        """:meth:`breakdown`'s bytes apart per device type (``{"cuda": {...}, "cpu": {...}}``):
        with offload, what stays on the GPU and what went to host memory. Only the places
        something is held appear (on a CPU run, ``cpu`` alone)."""
        out = tally(self.run.zero.held(), by_device=True)
        for t in self._optimizer_tensors():
            place = out.setdefault(t.device.type, tally(()))
            place["optimizer"] = place.get("optimizer", 0) + t.nbytes
        for place in out.values():
            place.setdefault("optimizer", 0)
        return out

    def device_memory(self) -> dict[str, int]:
        """The CUDA caching allocator's figures for this rank's device: ``allocated`` (now),
        ``max_allocated`` (the peak since the last ``reset_peak_memory_stats``) and ``reserved``
        (held by the allocator, free blocks included); and ``pinned``, the page-locked host bytes
        torch's host allocator holds (each block rounded up to a power of two: up to twice what
        the census counts in pinned tensors). Empty on the CPU."""
        device = self.run.topology.device
        if device.type != "cuda":
            return {}
        out = {
            "allocated": torch.cuda.memory_allocated(device),
            "max_allocated": torch.cuda.max_memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device),
        }
        pinned = pinned_bytes()
        if pinned is not None:
            out["pinned"] = pinned
        return out
