"""What the engine writes to its monitors, once per optimizer step, on global rank 0.

DeepSpeed's events, at x = ``global_samples`` after the step (DeepSpeed's x-axis):

- ``Train/Samples/train_loss``: the step's mean loss over its micro-batches and the dp ranks
  (the global batch's, as DeepSpeed's pipeline engine writes it),
- ``Train/Samples/lr``: the first parameter group's learning rate after the step,
- ``Train/Samples/loss_scale``: fp16 only, after the step's update.

zerostack's own, at the same x:

- ``Train/Samples/grad_norm``: the global gradient norm before clipping (NaN on a skipped step),
- ``Train/Samples/samples_per_sec``: the global batch over the time since the previous step
  (from the second step on),
- ``Train/Samples/tflops_per_rank``: model TFLOP/s per rank, once the flops profiler has
  measured a step,
- ``Train/Samples/memory_bytes_rank0``: rank 0's ``engine.memory_breakdown()`` total,
- ``Train/Samples/cuda_{allocated,max_allocated,reserved,pinned}_bytes_rank0``: on a GPU, the
  CUDA allocator's figures and the pinned host bytes (``engine.device_memory()``),
- ``Train/Samples/comm_bytes_<axis>_rank0``: bytes rank 0's collectives moved in the step on each
  axis (``dp``, ``tp``, ``pp``; ``world``), as its CommLog counts them.

The monitors are flushed at the end of each ``steps_per_print`` interval and by
``engine.destroy()``.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from ..config import ZeroStackConfig
from ..core.steps import StepReport
from .master import open_monitors
from .writers import Event

PREFIX = "Train/Samples/"


class LossWindow:
    """The losses of the accumulation window now open (the engine's ``backward`` adds each
    micro-batch's), kept only when a part wants the step's loss (``collect``: the monitors, the
    loss-spike guard). Every rank keeps its own; :meth:`mean` averages over dp."""

    def __init__(self, topology, comm) -> None:
        self.collect = False
        self.topology, self.comm = topology, comm
        self._sum: torch.Tensor | None = None
        self._count = 0

    def add(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss, as the user's loop computed it (before any scaling)."""
        if self.collect:
            value = loss.detach().float()
            self._sum = value if self._sum is None else self._sum + value
            self._count += 1

    def mean(self) -> torch.Tensor | None:
        """The mean of the window's micro-batch losses over the micro-batches and dp ranks (a
        collective over dp); the window starts again."""
        if not self._count:
            return None
        mean = self._sum / self._count
        self._sum, self._count = None, 0
        if self.topology.dp > 1:
            self.comm.all_reduce(mean, axis="dp")
            mean = mean / self.topology.dp
        return mean


class StepMonitor:
    """A step callback: writes each step's events to the configured monitors (rank 0 writes;
    opening them on rank 0 fails at ``initialize`` for a bad path or a missing package)."""

    def __init__(self, config: ZeroStackConfig, topology, comm) -> None:
        self.master = open_monitors(config, rank=topology.global_rank, comm=comm)
        self.enabled = self.master.enabled
        self.wants_loss = self.enabled  # the engine keeps the window's loss for the report
        self.rank = topology.global_rank
        self.topology = topology
        self.comm = comm
        self.steps_per_print = config.steps_per_print
        self._clock: float | None = None
        self._comm_seen = 0

    def after_step(self, report: StepReport) -> None:
        """Write the step's events (at x = the samples seen after it)."""
        if not self.enabled or self.rank != 0:
            return
        x = report.samples
        events: list[Event] = []
        if report.loss is not None:
            events.append((PREFIX + "train_loss", float(report.loss), x))
        events.append((PREFIX + "lr", float(report.lrs[0]), x))
        if report.precision == "fp16":
            events.append((PREFIX + "loss_scale", float(report.loss_scale), x))
        if report.grad_norm is not None:
            events.append((PREFIX + "grad_norm", float(report.grad_norm), x))
        events += self._speed(report, x)
        memory = sum(report.memory().values())
        events.append((PREFIX + "memory_bytes_rank0", float(memory), x))
        for kind, nbytes in report.device_memory().items():  # the CUDA allocator's, on a GPU
            events.append((PREFIX + f"cuda_{kind}_bytes_rank0", float(nbytes), x))
        for axis, nbytes in self._comm_bytes(report.step - 1).items():
            events.append((PREFIX + f"comm_bytes_{axis}_rank0", float(nbytes), x))
        self.master.write_events(events)
        if self.steps_per_print is not None and report.step % self.steps_per_print == 0:
            self.master.flush()

    def _speed(self, report: StepReport, x: int) -> list[Event]:
        now, last = time.perf_counter(), self._clock
        self._clock = now
        if last is None or now <= last:
            return []
        seconds = now - last
        out = [(PREFIX + "samples_per_sec", report.batch_size / seconds, x)]
        if report.flops:
            tflops = report.flops / seconds / report.world_size / 1e12
            out.append((PREFIX + "tflops_per_rank", tflops, x))
        return out

    def _comm_bytes(self, step: int) -> dict[str, int]:
        """Rank 0's bytes per axis in CommLog step ``step``, the one just ended (records since
        the last write; each grid axis of size > 1 appears, with 0 when it moved nothing)."""
        log = self.comm.log
        out: dict[str, int] = defaultdict(int)
        for axis in ("dp", "tp", "pp"):
            if self.topology.size(axis) > 1:
                out[axis] = 0
        for r in log.since(self._comm_seen):
            if r.step == step:
                out[r.axis] += r.bytes
        self._comm_seen = log.count
        return dict(out)

    def close(self) -> None:
        """Flush and close the monitors' files (``engine.destroy()``)."""
        self.master.close()
