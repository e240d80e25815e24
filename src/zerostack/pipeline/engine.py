"""The engine for a :class:`PipelineModule`: ``train_batch`` runs a whole global batch.

As in DeepSpeed, one ``engine.train_batch(data_iter)`` call pulls ``gradient_accumulation_steps``
micro-batches, runs them through the pipeline by the configured schedule (1F1B by default, GPipe,
or interleaved 1F1B with virtual stages), and steps the optimizer; it returns the loss averaged over
the micro-batches, on every stage. Gradients are reduced over dp once per batch, after the last
micro-batch (so ZeRO stage 2 holds full gradients during the batch, then reduce-scatters into its
fp32 slices, like stage 1: a pipeline would otherwise reduce each micro-batch's gradients).
Tied weights (a ``TiedLayerSpec`` on several stages) get their gradients all-reduced between the
owning stages first. The gradient norm counts every stage's parameters once.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ZeroStackConfig
from ..engine import Engine
from ..topology import Topology
from .executor import PipelineExecutor, forward_only
from .module import PipelineModule
from .schedule import build_schedule


class PipelineEngine(Engine):
    """DeepSpeed's ``PipelineEngine``: ``train_batch`` / ``eval_batch`` over a pipeline grid."""

    def __init__(
        self, *, module: PipelineModule, config: ZeroStackConfig, topology: Topology, **kwargs
    ) -> None:
        super().__init__(module=module, config=config, topology=topology, **kwargs)
        self.schedule = config.pipeline.schedule
        self.executor = PipelineExecutor(module, self.comm, config.fp16.auto_cast)
        self.executor.clock = self.clock
        self._tied_copies = module.tied_copies()

    def replicated_elsewhere(self) -> set[nn.Parameter]:
        return super().replicated_elsewhere() | self._tied_copies

    # ------------------------------------------------------------------ DeepSpeed's API
    def is_first_stage(self) -> bool:
        return self.module.is_first_stage

    def is_last_stage(self) -> bool:
        return self.module.is_last_stage

    def forward(self, *args, **kwargs):
        raise RuntimeError("pipeline engine: use engine.train_batch() / engine.eval_batch()")

    def backward(self, *args, **kwargs):
        raise RuntimeError("pipeline engine: use engine.train_batch() / engine.eval_batch()")

    def step(self, *args, **kwargs):
        raise RuntimeError("pipeline engine: use engine.train_batch() / engine.eval_batch()")

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One global batch: ``gradient_accumulation_steps`` micro-batches, then the optimizer
        step. Returns the mean loss over the micro-batches on every stage."""
        self.module.train()
        gas = self._gas
        stream = build_schedule(
            self.schedule,
            self.module.num_stages,
            gas,
            self.module.stage_id,
            chunks=self.module.virtual_stages,
        )
        self.zero.begin_backward(False)  # no dp reduction inside the batch: reduce_grads does it
        losses = self.executor.run(
            stream,
            data_iter if data_iter is not None else self._default_iter(),
            loss_scale=self.loss_scaler.loss_scale,
            micro_batches=gas,
            train=True,
            on_tied=self._reduce_tied_grads,
            on_step=self.apply_step,
        )
        self.micro_steps += gas
        loss = self._mean_loss(losses, gas)
        self._count_global_step(loss)
        return loss

    @torch.no_grad()
    def eval_batch(self, data_iter=None) -> torch.Tensor:
        """The mean loss over ``gradient_accumulation_steps`` micro-batches, no update."""
        self.module.eval()
        gas = self._gas
        stream = forward_only(
            self.module.num_stages, gas, self.module.stage_id, self.module.virtual_stages
        )
        losses = self.executor.run(
            stream,
            data_iter if data_iter is not None else self._default_iter(),
            loss_scale=1.0,
            micro_batches=gas,
            train=False,
        )
        self.module.train()
        return self._mean_loss(losses, gas)

    def _mean_loss(self, losses: list[torch.Tensor], gas: int) -> torch.Tensor:
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.module.is_last_stage:
            loss += torch.stack(losses).sum() / gas
            if self.topology.dp > 1:  # the global batch's mean, as DeepSpeed reports it
                self.comm.all_reduce(loss, axis="dp")
                loss /= self.topology.dp
        if self.topology.pp > 1:
            self.comm.broadcast(loss, src=self.topology.pp - 1, axis="pp")
        return loss

    def _reduce_tied_grads(self) -> None:
        for tie in self.module.ties:
            if tie.group is None:
                continue
            for p in self.module.tied_parameters(tie):
                # the window's sum, wherever the strategy keeps it (with grad_accum_dtype other
                # than the parameter's, not in p.grad)
                grad = self.zero.accumulated_grad(p)
                if grad is None:
                    grad = p.grad = torch.zeros_like(p)
                self.comm.all_reduce(grad, axis="tied", group=tie.group)
