"""What follows each optimizer step: it is counted (``global_steps``, ``global_samples``), and
its :class:`~..core.steps.StepReport` is handed to each step callback in the order they were
added (``initialize`` adds the built-in ones: :mod:`zerostack.engine.callbacks`)."""

from __future__ import annotations

import torch

from ..core.run import Run
from ..core.steps import StepCallback, StepReport
from ..monitor.training import LossWindow
from .footprint import Footprint
from .update import StepOutcome


class AfterStep:
    """The step callbacks of one engine, and the count and report that feed them."""

    def __init__(
        self,
        run: Run,
        footprint: Footprint,
        timers: dict[str, float],
        batch_size: int,
    ) -> None:
        self.run, self.footprint = run, footprint
        self.timers, self.batch_size = timers, batch_size
        self.callbacks: list[StepCallback] = []
        self.losses = LossWindow(run.topology, run.comm)  # each window's, when one is wanted

    def add(self, callback: StepCallback) -> StepCallback:
        """Hand ``callback`` each step's report, after the callbacks added before it; one with
        ``wants_loss`` set gets the step's mean loss in the report."""
        self.callbacks.append(callback)
        self.losses.collect |= bool(getattr(callback, "wants_loss", False))
        return callback

    def count(self, outcome: StepOutcome, loss: torch.Tensor | None = None) -> None:
        """Count a step and hand its report, with the update's ``outcome``, to the callbacks
        (``loss``: the step's mean loss when the caller has it; else the window's, when a
        callback wants it)."""
        run, state = self.run, self.run.state
        state.global_steps += 1
        state.global_samples += self.batch_size
        if loss is None and self.losses.collect:
            loss = self.losses.mean()  # a collective over dp: every rank, every step
        optimizer = run.optimizer
        report = StepReport(
            step=state.global_steps,
            samples=state.global_samples,
            batch_size=self.batch_size,
            world_size=run.topology.world_size,
            skipped_steps=state.skipped_steps,
            applied=outcome.applied,
            loss=loss,
            grad_norm=outcome.grad_norm,
            lrs=[g["lr"] for g in optimizer.param_groups] if optimizer is not None else [],
            loss_scale=state.loss_scaler.loss_scale,
            precision=run.precision.name,
            timers=self.timers,
            memory=self.footprint.breakdown,
            memory_by_device=self.footprint.by_device,
            device_memory=self.footprint.device_memory,
        )
        run.comm.log.next_step()
        for callback in self.callbacks:
            callback.after_step(report)
