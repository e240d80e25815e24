"""The engine's runner for a :class:`PipelineModule`: ``train_batch`` runs a whole global batch.

As in DeepSpeed, one ``engine.train_batch(data_iter)`` call pulls ``gradient_accumulation_steps``
micro-batches, runs them through the pipeline by the configured schedule (1F1B by default, GPipe,
or interleaved 1F1B with virtual stages), and steps the optimizer; it returns the loss averaged over
the micro-batches, on every stage. At stages 0-1 gradients are reduced over dp once per batch, after
the last micro-batch. Stages 2 and 3 reduce each backward's gradients into this rank's pieces as
that backward ends, as they do without a pipeline, so no stage holds full gradients for long
(stage 3's layers are gathered for each micro-batch's forward and backward).
Tied weights (a ``TiedLayerSpec`` on several stages) get their gradients all-reduced between the
owning stages first. The gradient norm counts every stage's parameters once.

An engine with this runner refuses ``forward``, ``backward`` and ``step`` (a pipeline runs whole
batches), and ``isinstance(engine, PipelineEngine)`` holds for it alone: ``PipelineEngine`` is
DeepSpeed's name for such an engine, never a class of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm
from ..config import ZeroStackConfig
from ..core.clock import device_clock
from ..engine import Engine
from ..zero.strategy import Pieces
from .executor import PipelineExecutor, forward_only
from .module import PipelineModule
from .schedule import build_schedule


class PipelineRunner:
    """Runs a batch through ``module``'s stages by the configured schedule (see the module)."""

    pipelined = True

    def __init__(self, module: PipelineModule, config: ZeroStackConfig, comm: Comm) -> None:
        self.module = module
        self.schedule = config.pipeline.schedule
        self.executor = PipelineExecutor(module, comm, config.fp16.auto_cast)
        # the engine's timing: the GPU's work, not its launch, when the seconds are shown
        self.executor.clock = device_clock(comm.topo.device, config.wall_clock_breakdown)
        self.comm = comm
        self._tied_copies = module.tied_copies()

    @property
    def is_first_stage(self) -> bool:
        return self.module.is_first_stage

    @property
    def is_last_stage(self) -> bool:
        return self.module.is_last_stage

    def replicated(self) -> set[nn.Parameter]:
        """Tied copies off their first stage: another stage holds and counts them."""
        return self._tied_copies

    def run(self, engine, data_iter, *, train: bool) -> torch.Tensor:
        """One global batch through the pipeline: with ``train``, ``gradient_accumulation_steps``
        micro-batches forward and backward, then the engine's update (``engine.apply_step``)
        and the step counted (``engine.end_window``). The mean loss over the micro-batches and
        dp ranks, on every stage."""
        gas, m = engine.batch[2], self.module
        if not train:
            stream = forward_only(m.num_stages, gas, m.stage_id, m.virtual_stages)
            with torch.no_grad():
                losses = self.executor.run(
                    stream, data_iter, loss_scale=1.0, micro_batches=gas, train=False
                )
            return self._mean_loss(losses, gas, engine.topology.device)
        stream = build_schedule(
            self.schedule, m.num_stages, gas, m.stage_id, chunks=m.virtual_stages
        )
        zero, around = engine.zero, None
        if zero.reduces_each_backward:  # stages 2-3: each backward's gradients reduced at its end
            around = (zero.begin_backward, zero.end_backward)
        else:  # no dp reduction inside the batch: reduce_grads does it
            zero.begin_backward(False)
        losses = self.executor.run(
            stream,
            data_iter,
            loss_scale=engine.loss_scaler.loss_scale,
            micro_batches=gas,
            train=True,
            on_tied=lambda: self._reduce_tied_grads(zero),
            on_step=engine.apply_step,
            around_backward=around,
        )
        loss = self._mean_loss(losses, gas, engine.topology.device)
        engine.end_window(gas, loss)
        return loss

    def _mean_loss(self, losses: list[torch.Tensor], gas: int, device) -> torch.Tensor:
        topo = self.comm.topo
        loss = torch.zeros((), dtype=torch.float32, device=device)
        if self.module.is_last_stage:
            loss += torch.stack(losses).sum() / gas
            for axis in ("dp", "ep"):  # the global batch's mean, as DeepSpeed reports it
                if topo.size(axis) > 1:
                    self.comm.all_reduce(loss, axis=axis)
                    loss /= topo.size(axis)
        if topo.pp > 1:
            self.comm.broadcast(loss, src=topo.pp - 1, axis="pp")
        return loss

    def _reduce_tied_grads(self, zero) -> None:
        for tie in self.module.ties:
            if tie.group is None:
                continue
            for p in self.module.tied_parameters(tie):
                if isinstance(zero, Pieces):  # the stages cut p alike: piece r meets piece r
                    piece = zero.local_grad(p)
                    self.comm.all_reduce(piece, axis="tied", group=tie.group)
                    zero.hold_local_grad(p, piece)
                    continue
                if zero.reduces_each_backward:  # stage 2: the stages' flat layouts differ, so
                    grad = zero.window_grad(p)  # the whole reduced gradient (a gather over dp)
                    self.comm.all_reduce(grad, axis="tied", group=tie.group)
                    zero.hold_grad(p, grad)
                    continue
                # the window's sum, wherever the strategy keeps it (with grad_accum_dtype other
                # than the parameter's, not in p.grad)
                grad = zero.accumulated_grad(p)
                if grad is None:
                    grad = p.grad = torch.zeros_like(p)
                self.comm.all_reduce(grad, axis="tied", group=tie.group)


class _PipelinedEngines(type(Engine)):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, Engine) and getattr(obj.runner, "pipelined", False)


class PipelineEngine(Engine, metaclass=_PipelinedEngines):
    """DeepSpeed's ``PipelineEngine``: what ``initialize`` returns for a ``PipelineModule`` is
    an :class:`~zerostack.engine.Engine` whose runner is a :class:`PipelineRunner`.
    ``isinstance(engine, PipelineEngine)`` says whether an engine is one; this class has no
    instances and adds nothing (its methods are the engine's)."""

    def __new__(cls, *args, **kwargs):
        raise TypeError("PipelineEngine: zerostack.initialize builds it for a PipelineModule")
