"""DeepSpeed's ``engine.tput_timer``: samples per second over the steps after the first few.

DeepSpeed's engine starts it at each forward (when it was given no training data) and stops it
at each ``step()``; DeepSpeed-Chat's scripts call ``update_epoch_count()`` at each epoch's end and
read ``avg_samples_per_sec()``. The same fields and rules as DeepSpeed 0.19.8's
``ThroughputTimer``: the first ``start_step`` optimizer steps are not timed (warm-up), the time
runs from ``start()`` to ``stop()`` only, and every ``steps_per_output`` optimizer steps one line
is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..core.clock import Clock

log = logging.getLogger("zerostack")


class ThroughputTimer:
    """Samples per second of the timed steps (see the module)."""

    def __init__(
        self,
        batch_size: int | None,
        start_step: int = 2,
        steps_per_output: int | None = None,
        clock: Clock | None = None,
        logging_fn: Callable[[str], None] | None = None,
    ) -> None:
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.clock = clock or Clock()
        self.logging = logging_fn or log.info
        self.started = False
        self.start_time = self.end_time = 0.0
        self.epoch_count = self.micro_step_count = self.global_step_count = 0
        self.total_elapsed_time = self.step_elapsed_time = 0.0

    def update_epoch_count(self) -> None:
        """An epoch ended: count it and restart the micro-step count."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """A micro-step begins (timed once ``start_step`` optimizer steps have passed)."""
        self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = self.clock.now()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """A micro-step ends (``global_step``: it closed an accumulation window)."""
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        self.global_step_count += bool(global_step)
        if self.start_time <= 0:
            return
        self.end_time = self.clock.now()
        duration = self.end_time - self.start_time
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        if not global_step:
            return
        every = self.steps_per_output
        if report_speed and every and self.global_step_count % every == 0:
            self.logging(
                f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
                f"global_step={self.global_step_count}, "
                f"RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
                f"CurrSamplesPerSec={self.batch_size / (self.step_elapsed_time + 1e-5)}"
            )
        self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed steps: ``-inf`` before any was timed (DeepSpeed's
        divides by zero at ``start_step`` steps, and goes negative before)."""
        timed = self.global_step_count - self.start_step
        if timed <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed)
