"""Where a checkpoint keeps its inputs: host memory, a tp rank's partition, the contiguous buffer.

:func:`host_empty` and :func:`to_device` are the only host/device moves of ``cpu_checkpointing``.
The checkpoint calls them through the package (:func:`_public`), so a replacement set on
``zerostack.checkpointing`` (a test double that records host memory) is the one used.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch

from ..core import pinned

HOST = "host"  # where cpu_checkpointing keeps inputs: memory from host_empty
Where = torch.device | str  # a device, or HOST


def host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Host memory for kept inputs under ``cpu_checkpointing`` (pinned when CUDA is there, so the
    copies back can overlap). Every host tensor a checkpoint keeps comes from here."""
    return pinned.host_empty(numel, dtype)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-kept input back on its compute device, for the recomputation."""
    return t.to(device, non_blocking=True)


def _empty(numel: int, dtype: torch.dtype, where: Where) -> torch.Tensor:
    if where == HOST:
        return _public().host_empty(numel, dtype)
    return torch.empty(numel, dtype=dtype, device=where)


def partition_size(numel: int, tp: int) -> int:
    """Elements each tp rank keeps of a ``numel``-element input (the last part zero-padded)."""
    return -(-numel // tp)


def _public():
    """The package, which ``zerostack.checkpointing`` is: :func:`host_empty` and :func:`to_device`
    are looked up there at each call, as when all of this was one module."""
    return sys.modules[__package__]


class _Contiguous:
    """The kept inputs of ``checkpoints`` consecutive checkpoints as slices of one allocation per
    (dtype, device). A slice is never handed out twice, so results cannot change; a checkpoint
    that does not fit (other shapes) gets a fresh buffer."""

    def __init__(self, checkpoints: int) -> None:
        self.checkpoints = checkpoints
        self.reset()

    def reset(self) -> None:
        self.buffers: dict[tuple[torch.dtype, Where], tuple[torch.Tensor, int]] = {}
        self.calls = 0

    def take(self, sizes: list[tuple[int, torch.dtype, Where]]) -> list[torch.Tensor]:
        """One flat slice per ``(numel, dtype, device)`` of one checkpoint."""
        if self.calls == self.checkpoints:  # a forward's worth handed out: start the next one
            self.reset()
        self.calls += 1
        need: dict[tuple[torch.dtype, Where], int] = defaultdict(int)
        for n, dtype, device in sizes:
            need[dtype, device] += n
        for key, n in need.items():
            buf, used = self.buffers.get(key, (None, 0))
            if buf is None or used + n > buf.numel():
                total = n * (self.checkpoints - self.calls + 1)
                self.buffers[key] = (_empty(total, *key), 0)
        out = []
        for n, dtype, device in sizes:
            buf, used = self.buffers[dtype, device]
            out.append(buf[used : used + n])
            self.buffers[dtype, device] = (buf, used + n)
        return out
