"""What the engine tells the parts that act once per optimizer step: a :class:`StepReport`.

After each optimizer step the engine counts it, then hands one report to each of its step
callbacks in the order ``initialize`` registered them (:mod:`zerostack.engine.callbacks`): the flops
profile, the monitors, the progress print, the loss-spike guard, the automatic checkpoint. None of
them is given the engine: what they read of the step is in the report, and what they act on
(the checkpoints, the module being profiled) they are given when they are made.

A report is written by the engine and annotated on its way down the list: the flops profile sets
``flops`` for the monitors and the print after it, the loss-spike guard sets ``hold_save`` for the
automatic checkpoint after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch


def _nothing() -> dict:
    return {}


@dataclass
class StepReport:
    """One optimizer step, after the engine has counted it (every rank makes one)."""

    step: int  # global_steps after this step
    samples: int  # global_samples after this step
    batch_size: int  # the global batch (train_batch_size)
    world_size: int
    skipped_steps: int  # so far, this step included when it was skipped
    applied: bool  # whether this step updated the weights (False: a non-finite norm skipped it)
    loss: torch.Tensor | None  # the mean over its micro-batches and dp ranks, when computed
    grad_norm: float | None  # before clipping
    lrs: list[float]  # each parameter group's, after the step (none when forward only)
    loss_scale: float
    precision: str  # "fp16", "bf16" or "fp32"
    timers: dict[str, float] = field(default_factory=dict)  # seconds spent so far, by phase
    # this rank's memory census, its split by device, and the CUDA allocator's figures: asked
    # for only by a part that writes them
    memory: Callable[[], dict[str, int]] = _nothing
    memory_by_device: Callable[[], dict[str, dict[str, int]]] = _nothing
    device_memory: Callable[[], dict[str, int]] = _nothing
    flops: int | None = None  # set by the flops profile: the step's model flops on this rank
    hold_save: bool = False  # set by the loss-spike guard: the automatic save waits


class StepCallback(Protocol):
    def after_step(self, report: StepReport) -> None: ...
