"""Page-locked ("pinned") host memory: every host buffer zerostack copies to or from the GPU
without blocking comes from here.

A ``non_blocking`` copy between the GPU and host memory runs asynchronously only when the host
side is page-locked. From pageable memory CUDA first waits for the stream, so the host stops
until every kernel queued so far has run, and the copy overlaps nothing. Pinning needs CUDA: on
a machine without it the flag is ignored and the memory is plain.

torch's caching host allocator rounds each pinned block up to a power of two, so the
page-locked bytes can reach twice the tensors' (DeepSpeed, which pins the same way, shares
this). :func:`pinned_bytes` is the allocator's own count, rounding included; the engine reports
it beside its census (``engine.device_memory()["pinned"]``).
"""

from __future__ import annotations

import torch


def can_pin() -> bool:
    """Whether page-locked memory can be had here (a CUDA device is visible)."""
    return torch.cuda.is_available()


def host_empty(shape, dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
    """An uninitialised host tensor, page-locked when ``pin`` and a GPU is there."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin and can_pin())


def host_zeros(shape, dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
    """A zeroed host tensor, page-locked when ``pin`` and a GPU is there."""
    return torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=pin and can_pin())


def pinned_bytes() -> int | None:
    """Bytes of page-locked memory torch's host allocator holds (each block as rounded, free
    cached blocks included); None without CUDA or where torch does not count them."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not can_pin():
        return None
    try:
        return int(stats().get("allocated_bytes.current", 0))
    except RuntimeError:  # no CUDA after all
        return None
