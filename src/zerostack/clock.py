"""Seconds that mean what they say on a GPU.

``time.perf_counter()`` around a CUDA kernel or an NCCL call measures its launch: the work runs
later, on the device's stream. Where zerostack reports seconds of GPU work (the engine's
``wall_clock_breakdown`` timers, the CommLog's seconds under the ``comms_logger`` block, the
pipeline executor's stats), the clock waits for the device first, as DeepSpeed's synchronized
timers do. It costs a synchronisation per reading, so it only does so when asked for figures;
on the CPU it is ``perf_counter`` itself.
"""

from __future__ import annotations

import time

import torch


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
