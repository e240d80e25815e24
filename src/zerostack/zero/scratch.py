"""Large short-lived CPU buffers in mappings of their own, outside glibc's heap.

Stage 3 makes and frees several buffers of a module's full size per module and pass: the
all-gather's send and receive buffers, the gathered parameters, the full weight gradient and
the reduce-scatter's staging and result. From glibc's heap (what ``torch.empty`` uses on the
CPU) they fragment it: once the first multi-MiB block is freed, glibc's adaptive mmap threshold
rises to that size, later buffers of a few MiB land in the heap between longer-lived
allocations, and the heap keeps what they free. At 101M parameters that left stage 3's peak
RSS near 1.2x FSDP2's while its live bytes were below (``benchmarks/memory_timeline.py``).

:func:`empty` and :func:`zeros` give such a buffer an anonymous private mapping of its own when
it is at least :data:`MIN_BYTES` on the CPU: its pages are zero when mapped, and the mapping
goes back to the system when the last tensor viewing it is freed, as glibc does for its own
mmapped chunks. Anything else (smaller, or on a GPU, whose caching allocator has no such
problem) is plain ``torch.empty`` / ``torch.zeros``.
"""

from __future__ import annotations

import mmap

import torch

MIN_BYTES = 8 << 20
"""Smallest buffer given a mapping of its own. A fresh mapping costs the kernel's zeroing of its
pages at every allocation; below this size that cost (measured: +10-25% step time at 19M
parameters with 1 MiB) outweighs what the heap's reuse loses."""


def _mapped(numel: int, dtype: torch.dtype, device: torch.device) -> bool:
    return torch.device(device).type == "cpu" and numel * dtype.itemsize >= MIN_BYTES


def empty(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A flat tensor of ``numel`` elements: in a mapping of its own when it is large and on the
    CPU (zero-filled then, though callers must not rely on it), else ``torch.empty``."""
    if not _mapped(numel, dtype, device):
        return torch.empty(numel, dtype=dtype, device=device)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE  # pages in one call
    buf = mmap.mmap(-1, numel * dtype.itemsize, flags=flags)
    return torch.frombuffer(buf, dtype=dtype, count=numel)  # holds buf; unmapped with it


def zeros(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`empty`, zero-filled (a fresh mapping already is)."""
    if not _mapped(numel, dtype, device):
        return torch.zeros(numel, dtype=dtype, device=device)
    return empty(numel, dtype, device)
