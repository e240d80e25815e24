"""The Engine: sequences one training step over its parts; the ZeRO strategy does the work.

A step is ``engine(batch)`` -> ``engine.backward(loss)`` -> ``engine.step()``, called once per
micro-batch exactly as with DeepSpeed. :meth:`Engine.backward` is the one place the loss is
normalised for gradient accumulation (divided by ``gradient_accumulation_steps``, times the fp16
loss scale), so the accumulated gradient is the mean over the global batch, as DeepSpeed's.

On the micro-step that closes an accumulation window, ``step()`` reads top to bottom:

1. :meth:`Engine.apply_step` -> :meth:`.update.BoundaryUpdate.apply`: the strategy's
   ``reduce_grads`` (gradients summed into the masters), the global norm, one coefficient for
   averaging, unscaling and clipping, the strategy's ``step`` (the optimizer on the masters,
   then ``write_back`` into the model's parameters) and the LR schedule; it returns a
   :class:`.update.StepOutcome` (the norm, whether the weights changed), kept as
   ``engine.outcome``;
2. :meth:`.after_step.AfterStep.count`: the step counted, its report (the outcome among it)
   handed to each step callback (:mod:`.callbacks` registers the built-in ones).

The parts, one job each: ``state`` (counters, loss scaler, loader position: :mod:`.train_state`),
``window`` (which micro-step closes a window, ``no_sync``: :mod:`.accumulation`), ``zero`` (the
ZeRO strategy: :mod:`zerostack.zero`), ``run`` (what a part is given of the engine:
:class:`zerostack.core.run.Run`), ``checkpoints`` (:mod:`zerostack.checkpoint.checkpointer`),
``update`` (:mod:`.update`), ``replicas`` (tp and ep replicas in sync: :mod:`.replicas`),
``full_params`` (one parameter's full values: :mod:`.full_params`), ``footprint`` (memory
figures: :mod:`.footprint`), ``after_step`` (:mod:`.after_step`) and ``runner`` (a batch micro-batch
by micro-batch, :mod:`.micro_batches`, or a pipeline's schedule). DeepSpeed's accessors
(``train_batch_size()``, ``get_lr()``, ``save_checkpoint``, ...) are on
:class:`zerostack.compat.deepspeed.runtime.engine.DeepSpeedEngine`, what ``initialize`` returns.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.model_files import full_weights
from ..comm import Comm
from ..comm.grid import comm_for
from ..config import ZeroStackConfig
from ..config.view import ConfigView
from ..core.clock import device_clock
from ..core.precision import Precision, forward_autocast, make_loss_scaler
from ..core.run import Run
from ..core.steps import StepCallback
from ..optim import Lamb, Muon
from ..tensor_parallel import join_tensors, partition_spec, split_tensor
from ..topology import Topology
from ..watchdog import Watchdog, start_watchdog
from ..zero.build import build_strategy
from ..zero.strategy import ZeroStrategy
from ..zero.whole_params import WholeParams
from .accumulation import Accumulation
from .after_step import AfterStep
from .callbacks import register_step_callbacks
from .compiling import CompileReport, compile_engine
from .footprint import Footprint
from .full_params import FullParams, attach
from .micro_batches import MicroBatches, cast_inputs
from .replicas import Replicas
from .train_state import PartField, TrainState
from .update import BoundaryUpdate, StepOutcome

if TYPE_CHECKING:
    from ..checkpoint.loss_spike import LossSpikeGuard
    from ..monitor.training import StepMonitor
    from ..profiling.flops_profiler.step import StepProfile

log = logging.getLogger("zerostack")


class Engine(nn.Module):
    """A model under training on a process grid (see the module for the step and the parts)."""

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
        # (train_batch_size, micro-batch per rank, accumulation steps), as validate resolved it
        self.batch = tbs, _, gas = batch
        self.config = ConfigView(config, batch=batch)
        self.topology = topology
        self.comm = comm or comm_for(topology)
        self.precision = Precision.from_config(config)

        device = topology.device
        module.to(device)
        # the timers' seconds are the GPU's work, not its launch, when they are shown
        self.clock = device_clock(device, config.wall_clock_breakdown)
        self.comm.clock = device_clock(
            device, config.wall_clock_breakdown or config.comms_logger.enabled
        )
        self.comm.log.step = -1  # set-up collectives (initial broadcast) are not part of step 0
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
            shared=self.replicas.ep_shared,
        )
        self.comm.log.step = 0
        self.full_params = FullParams(self)  # one parameter's full values (zerostack.utils)
        attach(self, module)
        self.state = TrainState(make_loss_scaler(config))  # counters, scaler, loader
        optimizer = optimizer_factory(self.zero.optimizer_groups())
        if isinstance(optimizer, (Muon, Lamb)):  # they step pieces of whole parameters
            optimizer.whole = WholeParams(
                self.comm, split=partition_spec, join=join_tensors, cut=split_tensor
            )
            self.zero.describe_pieces(optimizer.whole)
        self.run = Run(  # what a checkpoint reads and writes: these parts, no engine
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
        self.window = Accumulation(gas, config.zero_optimization.stage)  # which step closes it
        self.footprint = Footprint(self.run)  # the memory figures
        self.timers: dict[str, float] = defaultdict(float)
        # counts each step and hands its report to the step callbacks (zerostack.engine.callbacks)
        self.after_step = AfterStep(self.run, self.footprint, self.timers, tbs)
        self.callbacks = self.after_step.callbacks
        self.outcome = StepOutcome()  # what the last step() did (applied, the gradient norm)
        # set by start(): the built-in step callbacks a user reads, and the watchdog
        self.flops_profile: StepProfile | None = None
        self.monitor: StepMonitor | None = None
        self.loss_spike: LossSpikeGuard | None = None
        self.watchdog: Watchdog | None = None
        # how train_batch() runs a batch: micro-batch by micro-batch, or a pipeline's schedule
        self.runner = runner if runner is not None else MicroBatches()

    def replicated_elsewhere(self) -> set[nn.Parameter]:
        """Parameters another rank also holds and counts (in the gradient norm, in checkpoints):
        tp replicas off tp rank 0, all but the experts off ep rank 0 where the strategy does
        not cut their state over ep (and, under a pipeline, tied copies off their first
        stage)."""
        return self.replicas.elsewhere(self.zero.cut_over_ep) | self.runner.replicated()

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

    compile = compile_engine  # torch.compile block by block (zerostack.engine.compiling)
    compile_report: CompileReport | None = None  # what engine.compile() did

    @property
    def is_compiled(self) -> bool:
        return self.compile_report is not None

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether this micro-step closes an accumulation window (:mod:`.accumulation`)."""
        return self.window.is_boundary(self.micro_steps)

    # ------------------------------------------------------------------ the step
    def forward(self, *args, **kwargs):
        """Run the model on the inputs, cast as DeepSpeed casts them: with ``fp16.auto_cast``
        the floating-point tensors among the positional arguments (also inside lists, tuples
        and dicts) become fp16; integer tensors and keyword arguments are never cast, and
        without ``auto_cast`` nothing is (in bf16 or fp16, a model that takes floating-point
        inputs gets them as given and casts them itself)."""
        self._refuse_under_a_pipeline()
        t0 = self.clock.now()
        with forward_autocast(self.config, self.topology.device):  # torch_autocast, when enabled
            out = self.module(*cast_inputs(args, self.config.fp16.auto_cast), **kwargs)
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
        self.after_step.losses.add(loss)
        # inside no_sync() gradients accumulate locally, reduced by the next backward outside it
        boundary = self.is_gradient_accumulation_boundary() and not self.window.inside_no_sync
        self.zero.begin_backward(boundary)
        gas = self.window.gas if scale_wrt_gas else 1
        scaled = loss.float() * (self.loss_scaler.loss_scale / gas)
        scaled.backward(retain_graph=retain_graph)
        self.zero.end_backward()
        self.timers["backward"] += self.clock.now() - t0
        return loss

    def step(self) -> None:
        """Count the micro-step; on an accumulation boundary, update the weights."""
        self._require_optimizer("step")
        if self.window.inside_no_sync:
            raise RuntimeError("engine.step() inside engine.no_sync(): step after leaving it")
        t0 = self.clock.now()
        boundary = self.is_gradient_accumulation_boundary()
        self.outcome = self.apply_step() if boundary else self.outcome.between_updates()
        self.micro_steps += 1  # before the count: an automatic save keeps whole windows
        if boundary:
            self.after_step.count(self.outcome)
        self.timers["step"] += self.clock.now() - t0

    # ------------------------------------------------------------------ whole batches
    def set_dataloader(self, loader) -> None:
        """The loader ``train_batch()`` and ``eval_batch()`` read when given no iterator."""
        self.state.set_loader(loader)

    def _batch_iter(self, data_iter):
        it = data_iter if data_iter is not None else self.state.batches()  # the loader's
        if it is None:
            raise ValueError("train_batch: no data iterator (pass one or training_data)")
        return it

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One global batch (``gradient_accumulation_steps`` micro-batches, then the optimizer
        step) from ``data_iter`` or the engine's loader; the mean loss over the batch, every dp
        rank alike (see :mod:`zerostack.engine.micro_batches`)."""
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
        self.after_step.count(self.outcome, loss)

    def add_callback(self, callback: StepCallback) -> StepCallback:
        """Hand ``callback`` a :class:`~..core.steps.StepReport` after each optimizer step
        (:mod:`.after_step`)."""
        return self.after_step.add(callback)

    def apply_step(self) -> StepOutcome:
        """The accumulation boundary's update (what ``step()`` does on it, and what a runner
        calls once a batch's gradients are in): reduce, norm, clip, step, write back
        (:mod:`zerostack.engine.update`); its outcome is also kept as ``self.outcome``."""
        self.outcome = self.update.apply()
        return self.outcome

    def zero_grad(self) -> None:
        """Gradients are zeroed after every optimizer step; this exists for API compatibility."""
        self.zero.zero_grad()

    def no_sync(self):
        """Backward passes inside accumulate gradients on each rank without reducing them; the
        first backward outside, on a boundary, reduces the sum; ``step()`` is refused inside.
        Refused at ZeRO stages 2 and 3, and not nested (:mod:`.accumulation`)."""
        return self.window.no_sync()

    # ------------------------------------------------------------------ the run
    def start(self, config: ZeroStackConfig) -> None:
        """Begin the run, once the engine is built (``initialize``'s last act): the built-in
        step callbacks (:mod:`zerostack.engine.callbacks`), the watchdog (:mod:`zerostack.watchdog`)
        and ``checkpoint.auto_resume`` (the latest checkpoint, if there is one)."""
        self.flops_profile, self.monitor, self.loss_spike = register_step_callbacks(self, config)
        self.watchdog = start_watchdog(self.comm.log, config.watchdog, self.topology)
        self.checkpoints.resume()

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held by this rank, per kind (:meth:`.footprint.Footprint.breakdown`)."""
        return self.footprint.breakdown()

    def memory_by_device(self) -> dict[str, dict[str, int]]:
        """:meth:`memory_breakdown` per device type (:meth:`.footprint.Footprint.by_device`)."""
        return self.footprint.by_device()

    def device_memory(self) -> dict[str, int]:
        """The CUDA allocators' figures (:meth:`.footprint.Footprint.device_memory`)."""
        return self.footprint.device_memory()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model weights in fp32 on the CPU, tensor-parallel slices joined (a collective:
        call it on every rank)."""
        return full_weights(self.run)

    def destroy(self) -> None:
        """Finish a pending background save (raising its error), release what the engine holds
        outside the process (NVMe offload files) and stop its watchdog."""
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        for callback in self.callbacks:  # the monitors flush and close their files
            if callable(getattr(callback, "close", None)):
                callback.close()
        self.zero.close()
        self.checkpoints.wait()  # a pending background save is written (or its error raised)
