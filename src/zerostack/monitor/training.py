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
from .master import open_monitors
from .writers import Event

PREFIX = "Train/Samples/"


class StepMonitor:
    """The engine's side of the monitors: the loss of each accumulation window and the step's
    figures. Every rank calls it (the window's loss is averaged over dp); rank 0 writes."""

    def __init__(self, config: ZeroStackConfig, topology, comm) -> None:
        self.master = open_monitors(config, rank=topology.global_rank, comm=comm)
        self.enabled = self.master.enabled
        self.collect_loss = self.enabled  # the engine also wants it for the loss_spike guard
        self.topology = topology
        self.comm = comm
        self.steps_per_print = config.steps_per_print
        self._loss_sum: torch.Tensor | None = None
        self._losses = 0
        self._clock: float | None = None
        self._comm_seen = 0

    def add_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss, as the user's loop computed it (before any scaling)."""
        if self.collect_loss:
            value = loss.detach().float()
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
            self._losses += 1

    def window_loss(self) -> torch.Tensor | None:
        """The mean of the window's micro-batch losses over the micro-batches and dp ranks."""
        if not self._losses:
            return None
        mean = self._loss_sum / self._losses
        self._loss_sum, self._losses = None, 0
        if self.topology.dp > 1:
            self.comm.all_reduce(mean, axis="dp")
            mean = mean / self.topology.dp
        return mean

    def write_step(self, engine, loss: torch.Tensor | None = None) -> None:
        """After the step's counters moved on: write its events (``loss``: the step's mean loss
        when the caller has it, else the window's from :meth:`add_loss`)."""
        if not self.enabled:
            return
        if loss is None:
            loss = self.window_loss()
        if engine.global_rank != 0:
            return
        x = engine.global_samples
        events: list[Event] = []
        if loss is not None:
            events.append((PREFIX + "train_loss", float(loss), x))
        events.append((PREFIX + "lr", float(engine.get_lr()[0]), x))
        if engine.precision.name == "fp16":
            events.append((PREFIX + "loss_scale", float(engine.loss_scale), x))
        norm = engine.get_global_grad_norm()
        if norm is not None:
            events.append((PREFIX + "grad_norm", float(norm), x))
        events += self._speed(engine, x)
        memory = sum(engine.memory_breakdown().values())
        events.append((PREFIX + "memory_bytes_rank0", float(memory), x))
        for kind, nbytes in engine.device_memory().items():  # the CUDA allocator's, on a GPU
            events.append((PREFIX + f"cuda_{kind}_bytes_rank0", float(nbytes), x))
        for axis, nbytes in self._comm_bytes().items():
            events.append((PREFIX + f"comm_bytes_{axis}_rank0", float(nbytes), x))
        self.master.write_events(events)
        if self.steps_per_print is not None and engine.global_steps % self.steps_per_print == 0:
            self.master.flush()

    def _speed(self, engine, x: int) -> list[Event]:
        now, last = time.perf_counter(), self._clock
        self._clock = now
        if last is None or now <= last:
            return []
        seconds = now - last
        out = [(PREFIX + "samples_per_sec", engine.train_batch_size() / seconds, x)]
        flops = getattr(engine.flops_profile, "last_step_flops", None)
        if flops:
            tflops = flops / seconds / engine.world_size / 1e12
            out.append((PREFIX + "tflops_per_rank", tflops, x))
        return out

    def _comm_bytes(self) -> dict[str, int]:
        """Rank 0's bytes per axis in the step now ending (records since the last write; each
        grid axis of size > 1 appears, with 0 when it moved nothing)."""
        log = self.comm.log
        out: dict[str, int] = defaultdict(int)
        for axis in ("dp", "tp", "pp"):
            if self.topology.size(axis) > 1:
                out[axis] = 0
        for r in log.since(self._comm_seen):
            if r.step == log.step:
                out[r.axis] += r.bytes
        self._comm_seen = log.count
        return dict(out)

    def flush(self) -> None:
        self.master.flush()

    def close(self) -> None:
        self.master.close()
