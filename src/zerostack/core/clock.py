"""Timing on the device (seconds of GPU work, not of its launch) and host reads of one device
scalar that wait for that scalar alone.

``time.perf_counter()`` around a CUDA kernel or an NCCL call measures its launch: the work runs
later, on the device's stream. Where zerostack reports seconds of GPU work (the engine's
``wall_clock_breakdown`` timers, the CommLog's seconds under the ``comms_logger`` block, the
pipeline executor's stats), the clock waits for the device first, as DeepSpeed's synchronized
timers do. It costs a synchronisation per reading, so it only does so when asked for figures;
on the CPU it is ``perf_counter`` itself.

:class:`HostScalar` reads one device scalar (the step's gradient norm) on the host without
waiting for the work queued after it: the copy goes behind the work that makes the value, an event
marks it, and the read waits for that event alone.
"""

from __future__ import annotations

import time

import torch

from .pinned import host_zeros


class Clock:
    """``now()``: ``time.perf_counter()`` after the device's work so far (``sync``)."""

    def __init__(self, sync: bool = False) -> None:
        self.sync = sync

    def now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()


def device_clock(device: torch.device, wanted: bool) -> Clock:
    """The clock for figures of work on ``device``: synchronizing when it is a GPU and the
    figures are ``wanted``."""
    return Clock(sync=device.type == "cuda" and wanted)


class HostScalar:
    """A 0-dim device tensor's value on the host, read without draining the device's stream.

    ``start(t)`` queues ``t``'s copy into a page-locked host scalar and records an event behind
    it; ``value()`` waits for that event only, so the work queued between the two calls (the
    optimizer step, the write-back) keeps the GPU busy while the host waits. On the CPU the copy
    is done at once and ``value()`` reads it."""

    def __init__(self, device: torch.device) -> None:
        gpu = device.type == "cuda"
        self.host = host_zeros((), torch.float32, pin=gpu)
        self.event = torch.cuda.Event() if gpu else None

    def start(self, t: torch.Tensor) -> None:
        if t.is_meta:  # a dry run's value has no data: it reads as 0 (finite, nothing clipped)
            self.host.zero_()
            return
        self.host.copy_(t.detach(), non_blocking=self.event is not None)
        if self.event is not None:
            self.event.record()

    def value(self) -> float:
        if self.event is not None:
            self.event.synchronize()
        return float(self.host)
