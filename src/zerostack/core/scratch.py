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

from .storage import same_storage

MIN_BYTES = 8 << 20
"""Smallest buffer given a mapping of its own. A fresh mapping costs the kernel's zeroing of its
pages at every allocation; below this size that cost (measured: +10-25% step time at 19M
parameters with 1 MiB) outweighs what the heap's reuse loses."""


_HUGE = getattr(mmap, "MADV_HUGEPAGE", None)
"""Where the kernel has transparent huge pages (``enabled`` set to ``madvise`` or ``always``), a
mapping is asked for them: its pages are then faulted in and zeroed 2 MiB at a time, not 4 KiB
(measured: a 16 MiB buffer made and filled in 0.7-3.4 ms, against 5.6 ms in 4 KiB pages, each
its own fault). Where they are not, the advice is ignored."""


def _mapped(numel: int, dtype: torch.dtype, device: torch.device) -> bool:
    return torch.device(device).type == "cpu" and numel * dtype.itemsize >= MIN_BYTES


def empty(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A flat tensor of ``numel`` elements: in a mapping of its own when it is large and on the
    CPU (zero-filled then, though callers must not rely on it), else ``torch.empty``."""
    if not _mapped(numel, dtype, device):
        return torch.empty(numel, dtype=dtype, device=device)
    buf = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _HUGE is not None:
        buf.madvise(_HUGE)
    return torch.frombuffer(buf, dtype=dtype, count=numel)  # holds buf; unmapped with it


def zeros(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`empty`, zero-filled (a fresh mapping already is)."""
    if not _mapped(numel, dtype, device):
        return torch.zeros(numel, dtype=dtype, device=device)
    return empty(numel, dtype, device)


class Pool:
    """Whole CPU buffers of recurring sizes, handed back for reuse.

    Stages 1-2 make and free the same few bucket-sized buffers every backward (a bucket's
    staged gradients, its reduce-scatter's received rows, in mixed precision the step's
    all-gather input). Fresh, each costs the kernel a zeroed page per 4 KiB touched: at 19M
    parameters, 3/4 of stage 2's page faults and some 40 ms of a 550 ms step. Kept here, a
    buffer is faulted in once. What
    the pool holds is bounded by how many were ever live at once: :meth:`take` reuses before it
    makes one, and a buffer comes back only from whoever took it, once nothing reads or writes
    it (its collective waited for). Tensors on a GPU pass through (its caching allocator already
    reuses blocks)."""

    def __init__(self, keep: int = 6) -> None:
        # Buffers of one size and dtype kept at most. Stage 2 at its peak: three buckets staged
        # (one filling, two reducing) and the received rows of three reduce-scatters (a third
        # is launched before the oldest is waited for).
        self.keep = keep
        self._free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A flat buffer of ``numel`` elements, contents undefined: a kept one, else new."""
        free = self._free.get((numel, dtype, torch.device(device)))
        return free.pop() if free else empty(numel, dtype, device)

    def give(self, *tensors: torch.Tensor | None) -> None:
        """Hand back buffers :meth:`take` gave (None and GPU tensors are passed over)."""
        for t in tensors:
            if t is None or t.device.type != "cpu" or t.untyped_storage().nbytes() != t.nbytes:
                continue  # (a view of part of a buffer is not a buffer)
            if not t.is_contiguous():
                continue
            t = t.view(-1)  # taken back flat, whatever shape it was given in (a matrix)
            free = self._free.setdefault((t.numel(), t.dtype, t.device), [])
            if len(free) < self.keep and not any(same_storage(f, t) for f in free):
                free.append(t)

    def kept(self) -> list[torch.Tensor]:
        """The buffers kept for reuse now."""
        return [t for free in self._free.values() for t in free]

    def trim(self, max_bytes: int) -> None:
        """Keep at most ``max_bytes`` of buffers, the largest first (a buffer's mapping goes
        back to the system when it is dropped): what the pool holds between steps."""
        kept = 0
        for t in sorted(self.kept(), key=lambda t: -t.nbytes):
            if kept + t.nbytes <= max_bytes:
                kept += t.nbytes
            else:
                free = self._free[(t.numel(), t.dtype, t.device)]
                free[:] = [f for f in free if f is not t]
