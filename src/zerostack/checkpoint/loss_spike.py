"""Loss-spike rollback: the config's ``loss_spike`` block, run by the engine after each step.

    "loss_spike": {"factor": 3.0, "window": 20, "patience": 2, "max_rollbacks": 3},
    "checkpoint": {"save_dir": "ckpt", "save_interval": 50}

What large-model teams do by hand when a loss spike does not recover: go back to the last good
checkpoint and skip the data that caused it. After each optimizer step the engine hands the
step's loss (its mean over the micro-batches and the dp ranks, the same on every rank) to
:class:`LossSpikeGuard`:

- Until ``window`` losses are in, nothing counts. Then a loss above ``factor`` times the median
  of the last ``window`` accepted losses (or NaN / inf) is a suspect; the others join the window.
- While a suspect run lasts, the automatic save (``checkpoint.save_interval``) is held back, so
  ``latest`` always predates the run.
- At the ``patience``-th suspect in a row, every rank loads ``latest`` from ``save_dir``
  (weights, optimizer, LR schedule, loss scale, step counters) but not its data position: the
  engine's loader goes on after the batches of the spike, which are thereby skipped. A loop over
  its own loader skips them the same way, since nothing rewinds its iterator. The rollback is
  logged on rank 0 and kept in ``engine.loss_spike.rollbacks``.
- ``max_rollbacks`` rollbacks in one run, or no checkpoint to roll back to, end the run with a
  :class:`LossSpikeError` instead: a run that keeps spiking has a cause rollbacks do not cure.

The counters come back with the weights: ``engine.global_steps`` returns to the checkpoint's step,
so a ``while engine.global_steps < total`` loop trains the skipped steps' count again, on new data.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
from collections import deque
from dataclasses import dataclass

from ..core.steps import StepReport
from .checkpointer import Checkpointer
from .state import LATEST, _gather_errors

log = logging.getLogger("zerostack")


class LossSpikeError(RuntimeError):
    """The loss spiked and a rollback is not possible or not allowed any more."""


@dataclass(frozen=True)
class Rollback:
    """One rollback: the step that triggered it, its loss, the median it was held against, and
    the checkpoint loaded (its tag and step)."""

    step: int
    loss: float
    median: float
    tag: str
    resumed_at: int


class LossSpikeGuard:
    """Watches each step's loss; rolls the engine back when it spikes (see the module)."""

    wants_loss = True  # the engine keeps each window's loss for the report

    def __init__(self, cfg, checkpoints: Checkpointer) -> None:
        self.cfg = cfg
        self.checkpoints = checkpoints  # rolls back through it
        self.save_dir = checkpoints.cfg.save_dir
        self.history: deque[float] = deque(maxlen=cfg.window)
        self.suspects = 0  # steps in a row above the bound
        self.rollbacks: list[Rollback] = []

    def after_step(self, report: StepReport) -> None:
        """Judge the step's loss (None when nobody computed it: nothing to judge); hold the
        automatic save back while a suspect run lasts and after a rollback
        (``report.hold_save``)."""
        report.hold_save = report.hold_save or not self._judge(report)

    def _judge(self, report: StepReport) -> bool:
        """Whether the step's loss is fine (False while a suspect run lasts and when it rolls
        back)."""
        if report.loss is None:
            return True
        value = float(report.loss)
        if len(self.history) < self.cfg.window and math.isfinite(value):
            self.history.append(value)
            return True
        median = statistics.median(self.history) if self.history else math.nan
        if math.isfinite(value) and value <= self.cfg.factor * median:
            self.suspects = 0
            self.history.append(value)
            return True
        self.suspects += 1
        if self.checkpoints.run.global_rank == 0:
            log.warning(
                "loss_spike: step %d's loss %.4g is above %g x the median %.4g (%d of %d)",
                report.step,
                value,
                self.cfg.factor,
                median,
                self.suspects,
                self.cfg.patience,
            )
        if self.suspects >= self.cfg.patience:
            self._roll_back(report.step, value, median)
        return False

    def _roll_back(self, step: int, value: float, median: float) -> None:
        run = self.checkpoints.run
        what = (
            f"loss_spike: step {step}'s loss {value:.4g} is above {self.cfg.factor:g} x the "
            f"median {median:.4g}"
        )
        if len(self.rollbacks) >= self.cfg.max_rollbacks:
            raise LossSpikeError(
                f"{what} after {len(self.rollbacks)} rollbacks (loss_spike.max_rollbacks)"
            )
        self.checkpoints.wait()  # a background save still being written
        have = os.path.isfile(os.path.join(self.save_dir, LATEST))
        if not _gather_errors(run.comm, "latest" if have else None):
            raise LossSpikeError(f"{what}, and {self.save_dir} has no checkpoint to roll back to")
        # the data goes on where it is: keep the loader's position and iterator through the load
        sampler = run.state.sampler()
        position = dict(vars(sampler)) if sampler is not None else None
        data_iter = run.state.data_iter
        path, _ = self.checkpoints.load(self.save_dir)
        if sampler is not None:
            vars(sampler).update(position)
        run.state.data_iter = data_iter
        self.suspects = 0
        done = Rollback(step, value, median, os.path.basename(path), run.global_steps)
        self.rollbacks.append(done)
        if run.global_rank == 0:
            log.warning(
                "%s for %d steps: rolled back to %s (step %d); the data of steps %d-%d is "
                "skipped (rollback %d of at most %d)",
                what,
                self.cfg.patience,
                done.tag,
                done.resumed_at,
                done.resumed_at + 1,
                step,
                len(self.rollbacks),
                self.cfg.max_rollbacks,
            )
