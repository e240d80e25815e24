"""The Engine: sequences one training step; the strategies do the work.

A step is ``engine(batch)`` -> ``engine.backward(loss)`` -> ``engine.step()``, called once per
micro-batch exactly as with DeepSpeed. On the micro-step that closes an accumulation window the
engine waits for the gradient reduction, unscales (fp16), checks for overflow, clips by global norm,
steps the optimizer on the fp32 masters, writes them back to the model and steps the LR schedule.

Loss normalisation for gradient accumulation happens in one place, :meth:`Engine.backward`: the
loss is divided by ``gradient_accumulation_steps`` (and multiplied by the fp16 loss scale), so the
accumulated gradient is the mean over the global batch, as DeepSpeed computes it.

The engine is composed of parts, each with one job: ``state`` (counters, loss scaler, loader
position: :mod:`.core.train_state`), ``zero`` (the ZeRO strategy), ``run`` (what checkpoints are
given: :mod:`.checkpoint.view`), ``checkpoints`` (:mod:`.checkpoint.checkpointer`), ``update``
(the boundary's update: :mod:`.update`), ``replicas`` (:mod:`.replicas`), ``runner`` (a batch
micro-batch by micro-batch, or a pipeline's schedule: :mod:`.runner`) and ``callbacks`` (what
runs after each optimizer step, given a :class:`~.core.steps.StepReport`: :mod:`.callbacks`).
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch import nn

from .checkpoint.checkpointer import Checkpointer
from .checkpoint.view import TrainingView
from .clock import device_clock
from .comm import Comm
from .comm.grid import comm_for
from .config import ZeroStackConfig
from .config_view import ConfigView
from .core.steps import StepCallback, StepReport
from .core.train_state import PartField, TrainState
from .engine_api import EngineAPI
from .full_params import FullParams, attach
from .monitor.training import LossWindow
from .precision import Precision, make_loss_scaler
from .replicas import Replicas
from .runner import MicroBatches, cast_inputs
from .topology import Topology
from .update import BoundaryUpdate
from .zero.build import build_strategy
from .zero.strategy import ZeroStrategy

log = logging.getLogger("zerostack")


class Engine(EngineAPI, nn.Module):
    """Wraps a model for data-parallel training; its parts are listed in the module's text."""

    # what the run has done so far lives in self.state (a TrainState), under DeepSpeed's names
    micro_steps = PartField("state")
    global_steps = PartField("state")
    global_samples = PartField("state")
    skipped_steps = PartField("state")
    loss_scaler = PartField("state")
    training_dataloader = PartField("state", "loader")  # initialize(training_data=...)'s
    # the optimizer and LR schedule live in self.run, what checkpoints are given of the engine
    optimizer = PartField("run")
    lr_scheduler = PartField("run")

    def __init__(
        self,
        *,
        module: nn.Module,
        config: ZeroStackConfig,
        topology: Topology,
        batch: tuple[int, int, int],
        stage: int,
        param_groups: list[dict],
        optimizer_factory,
        lr_scheduler=None,
        comm: Comm | None = None,
        runner=None,
    ) -> None:
        super().__init__()
        self.module = module
        tbs, micro, gas = batch  # as zerostack.validate resolved them
        self.config = ConfigView(config, batch=(tbs, micro, gas))
        self.topology = topology
        self.comm = comm or comm_for(topology)
        self.precision = Precision.from_config(config)
        self._train_batch_size, self._micro_batch, self._gas = tbs, micro, gas

        device = topology.device
        module.to(device)
        # the timers' seconds are the GPU's work, not its launch, when they are shown
        self.clock = device_clock(device, config.wall_clock_breakdown)
        self.comm.clock = device_clock(
            device, config.wall_clock_breakdown or config.comms_logger.enabled
        )
        self.comm.log.step = -1  # set-up collectives (initial broadcast) are not part of step 0
        self.losses = LossWindow(topology, self.comm)  # each window's, for the step callbacks
        self.callbacks: list[StepCallback] = []  # initialize registers them (zerostack.callbacks)
        self.replicas = Replicas(module, topology, self.comm)  # tp and ep replicas, in sync
        prescale = 1.0 / topology.dp if config.prescale_gradients else 1.0
        prescale = prescale / config.gradient_predivide_factor
        # The ZeRO strategy owns parameters, gradients and masters (stage 0 is plain DP).
        self.zero: ZeroStrategy = build_strategy(
            module,
            param_groups,
            config=config,
            stage=stage,
            comm=self.comm,
            precision=self.precision,
            prescale=prescale,
        )
        if self.replicas.ep_shared:  # stages 0-2 (ep refuses 3): summed over ep at each step
            self.zero.ep_shared = self.replicas.ep_shared
        self.comm.log.step = 0
        self.full_params = FullParams(self)  # one parameter's full values (zerostack.utils)
        attach(self, module)
        self.state = TrainState(make_loss_scaler(config))  # counters, scaler, loader
        optimizer = optimizer_factory(self.zero.optimizer_groups())
        self.run = TrainingView(  # what a checkpoint reads and writes: these parts, no engine
            module=module,
            zero=self.zero,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler(optimizer) if callable(lr_scheduler) else lr_scheduler,
            state=self.state,
            topology=topology,
            comm=self.comm,
            config=self.config,
            precision=self.precision,
            full_params=self.full_params,
            replicated_elsewhere=self.replicated_elsewhere,
        )
        self.checkpoints = Checkpointer(self.run, config.checkpoint)
        self.update = BoundaryUpdate(self.run)  # reduce, norm, clip, step at a window's end
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary
        self._inside_no_sync = False
        self.timers: dict[str, float] = defaultdict(float)
        # how train_batch() runs a batch: micro-batch by micro-batch, or a pipeline's schedule
        self.runner = runner if runner is not None else MicroBatches()

    def replicated_elsewhere(self) -> set[nn.Parameter]:
        """Parameters another rank also holds and counts (in the gradient norm, in checkpoints):
        tp replicas off tp rank 0, all but the experts off ep rank 0 (and, under a pipeline,
        tied copies off their first stage)."""
        return self.replicas.elsewhere() | self.runner.replicated()

    def _require_optimizer(self, what: str) -> None:
        self._refuse_under_a_pipeline()
        if self.optimizer is None:
            raise RuntimeError(
                f"engine.{what}(): this engine runs forward only (initialize was given no "
                f"optimizer and the config has no optimizer block)"
            )

    def _refuse_under_a_pipeline(self) -> None:
        if self.runner.pipelined:  # its schedule runs forward, backward and step itself
            raise RuntimeError("pipeline engine: use engine.train_batch() / engine.eval_batch()")

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether this micro-step closes an accumulation window: every
        ``gradient_accumulation_steps``-th, or what ``set_gradient_accumulation_boundary`` said
        last."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self._gas == 0

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        self.training = mode
        return self

    # ------------------------------------------------------------------ the step
    def forward(self, *args, **kwargs):
        """Run the model on the inputs, cast as DeepSpeed casts them: with ``fp16.auto_cast``
        the floating-point tensors among the positional arguments (also inside lists, tuples
        and dicts) become fp16; integer tensors and keyword arguments are never cast, and
        without ``auto_cast`` nothing is (in bf16 or fp16, a model that takes floating-point
        inputs gets them as given and casts them itself)."""
        self._refuse_under_a_pipeline()
        t0 = self.clock.now()
        args = cast_inputs(args, self.config.fp16.auto_cast)
        out = self.module(*args, **kwargs)
        self.timers["forward"] += self.clock.now() - t0
        return out

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Backpropagate ``loss / gradient_accumulation_steps`` (times the fp16 loss scale);
        ``scale_wrt_gas=False`` leaves out the division, for a caller that has divided already
        (Hugging Face's Trainer always passes it so)."""
        self._require_optimizer("backward")
        if loss.dim() != 0:
            raise ValueError(f"backward: loss must be a scalar, got shape {tuple(loss.shape)}")
        t0 = self.clock.now()
        self.losses.add(loss)
        # inside no_sync() gradients accumulate locally, reduced by the next backward outside it
        boundary = self.is_gradient_accumulation_boundary() and not self._inside_no_sync
        self.zero.begin_backward(boundary)
        gas = self._gas if scale_wrt_gas else 1
        scaled = loss.float() * (self.loss_scaler.loss_scale / gas)
        scaled.backward(retain_graph=retain_graph)
        self.zero.end_backward()
        self.timers["backward"] += self.clock.now() - t0
        return loss

    def step(self) -> None:
        """Count the micro-step; on an accumulation boundary, update the weights."""
        self._require_optimizer("step")
        if self._inside_no_sync:
            raise RuntimeError("engine.step() inside engine.no_sync(): step after leaving it")
        t0 = self.clock.now()
        self.update.applied = False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self.apply_step()
        self.micro_steps += 1  # before the count: an automatic save keeps whole windows
        if boundary:
            self._count_global_step()
        self.timers["step"] += self.clock.now() - t0

    # ------------------------------------------------------------------ whole batches
    def set_dataloader(self, loader) -> None:
        """The loader ``train_batch()`` and ``eval_batch()`` read when given no iterator."""
        self.state.set_loader(loader)

    def _default_iter(self):
        """The engine loader, repeated (None without one)."""
        return self.state.batches()

    def _batch_iter(self, data_iter):
        it = data_iter if data_iter is not None else self._default_iter()
        if it is None:
            raise ValueError("train_batch: no data iterator (pass one or training_data)")
        return it

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One global batch (``gradient_accumulation_steps`` micro-batches, then the optimizer
        step) from ``data_iter`` or the engine's loader; the mean loss over the batch, every dp
        rank alike (see :mod:`zerostack.runner`)."""
        self.module.train()
        return self.runner.run(self, self._batch_iter(data_iter), train=True)

    def eval_batch(self, data_iter=None) -> torch.Tensor:
        """The mean loss over ``gradient_accumulation_steps`` micro-batches, no update."""
        self.module.eval()
        loss = self.runner.run(self, self._batch_iter(data_iter), train=False)
        self.module.train()
        return loss

    def end_window(self, micro_batches: int, loss: torch.Tensor) -> None:
        """A runner that ran a window's micro-batches and update itself (a pipeline's
        schedule) counts them here, with the window's mean loss."""
        self.micro_steps += micro_batches
        self._count_global_step(loss)

    def add_callback(self, callback: StepCallback) -> StepCallback:
        """Hand ``callback`` a :class:`~.core.steps.StepReport` after each optimizer step, after
        the callbacks added before it; one with ``wants_loss`` set gets the step's mean loss in
        the report (the engine keeps each window's losses for it)."""
        self.callbacks.append(callback)
        self.losses.collect |= bool(getattr(callback, "wants_loss", False))
        return callback

    def _count_global_step(self, loss: torch.Tensor | None = None) -> None:
        """After a step: count it and hand its report to the step callbacks (``loss``: the
        step's mean loss when the caller has it)."""
        self.global_steps += 1
        self.global_samples += self._train_batch_size
        if loss is None and self.losses.collect:
            loss = self.losses.mean()  # a collective over dp: every rank, every step
        report = StepReport(
            step=self.global_steps,
            samples=self.global_samples,
            batch_size=self._train_batch_size,
            world_size=self.world_size,
            skipped_steps=self.skipped_steps,
            applied=self.update.applied,
            loss=loss,
            grad_norm=self.update.grad_norm,
            lrs=self.get_lr(),
            loss_scale=self.loss_scaler.loss_scale,
            precision=self.precision.name,
            timers=self.timers,
            memory=self.memory_breakdown,
            memory_by_device=self.memory_by_device,
            device_memory=self.device_memory,
        )
        self.comm.log.next_step()
        for callback in self.callbacks:
            callback.after_step(report)

    def apply_step(self) -> None:
        """The accumulation boundary's update (what ``step()`` does on it, and what a runner
        calls once a batch's gradients are in): reduce, norm, clip, step, write back
        (:mod:`zerostack.update`)."""
        self.update()

    def zero_grad(self) -> None:
        """Gradients are zeroed after every optimizer step; this exists for API compatibility."""
        self.zero.zero_grad()
