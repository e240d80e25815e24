"""The step log: every ``steps_per_print`` optimizer steps, global rank 0 prints one line (step,
skipped steps, learning rates, loss scale, gradient norm, samples per second since the last line
and, once the flops profiler has measured a step, model TFLOP/s per rank), then with
``wall_clock_breakdown`` the seconds per phase and with ``memory_breakdown`` the bytes held.
"""

from __future__ import annotations

import time

from ..core.progress import print_progress
from ..core.steps import StepReport


class ProgressPrint:
    """A step callback: the step log (see the module)."""

    def __init__(self, config, rank: int) -> None:
        self.every = config.steps_per_print
        self.timers = config.wall_clock_breakdown
        self.memory = config.memory_breakdown
        self.rank = rank
        self._last: tuple[float, int, int] | None = None  # (time, samples, step) at the last line

    def after_step(self, report: StepReport) -> None:
        if self.rank != 0 or self.every is None or report.step % self.every:
            return
        lrs = [f"{lr:.3g}" for lr in report.lrs]
        print_progress(
            f"step={report.step} skipped={report.skipped_steps} lr={lrs} "
            f"loss_scale={report.loss_scale:g} grad_norm={report.grad_norm} "
            f"{self.throughput(report)}".rstrip()
        )
        if self.timers:
            print_progress(f"time (s): { {k: round(v, 4) for k, v in report.timers.items()} }")
        if self.memory:
            device = report.device_memory()  # the CUDA allocator's figures, on a GPU
            cuda = f" cuda allocator: {device}" if device else ""
            places = report.memory_by_device()
            apart = f" by device: {places}" if len(places) > 1 else ""
            print_progress(f"memory (bytes): {report.memory()}{apart}{cuda}")

    def throughput(self, report: StepReport) -> str:
        """Samples per second since the last line (and model TFLOP/s per rank once the flops
        profiler has measured a step); empty on the first line."""
        now, last = time.perf_counter(), self._last
        self._last = (now, report.samples, report.step)
        if last is None or now <= last[0]:
            return ""
        seconds = now - last[0]
        out = f"samples/s={(report.samples - last[1]) / seconds:.3g}"
        if report.flops:
            per_rank = report.flops * (report.step - last[2]) / seconds / report.world_size
            out += f" TFLOP/s per rank={per_rank / 1e12:.3g}"
        return out
