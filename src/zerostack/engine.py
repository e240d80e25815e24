"""The Engine: sequences one training step; the strategies do the work.

A step is ``engine(batch)`` -> ``engine.backward(loss)`` -> ``engine.step()``, called once per
micro-batch exactly as with DeepSpeed. On the micro-step that closes an accumulation window the
engine waits for the gradient reduction, unscales (fp16), checks for overflow, clips by global norm,
steps the optimizer on the fp32 masters, writes them back to the model and steps the LR schedule.

Loss normalisation for gradient accumulation happens in one place, :meth:`Engine.backward`: the
loss is divided by ``gradient_accumulation_steps`` (and multiplied by the fp16 loss scale), so the
accumulated gradient is the mean over the global batch, as DeepSpeed computes it.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict

import torch
from torch import nn

from .checkpoint.auto_resume import AutoCheckpoint
from .checkpoint.loss_spike import LossSpikeGuard
from .clock import HostScalar, device_clock
from .comm import Comm
from .comm.grid import comm_for
from .config import ZeroStackConfig
from .config_view import ConfigView
from .core.progress import print_progress
from .engine_api import EngineAPI
from .full_params import FullParams, attach
from .moe.utils import is_moe_param
from .monitor import StepMonitor
from .pinned import host_empty
from .precision import Precision, make_loss_scaler
from .profiling.flops_profiler.step import StepProfile
from .runner import cast_inputs, repeat_loader, run_micro_batches
from .tensor_parallel import partition_spec
from .topology import Topology
from .zero.build import build_strategy
from .zero.params import is_sharded
from .zero.strategy import GradStats, ZeroStrategy

log = logging.getLogger("zerostack")


class Engine(EngineAPI, nn.Module):
    """Wraps a model for data-parallel training with DeepSpeed's engine API."""

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
        # the monitor blocks: files opened on rank 0 (a bad path or missing package fails here)
        self.monitor = StepMonitor(config, topology, self.comm)
        # Parameters not split by tensor parallelism are replicas on the tp ranks: start them
        # alike, and count them once in the gradient norm (tp rank 0 counts them).
        replicas = [p for p in module.parameters() if partition_spec(p) is None]
        self._tp_replicas = set(replicas)
        self._ep_replicas = (  # what every ep rank holds: counted on ep rank 0 only
            {p for p in module.parameters() if not is_moe_param(p)} if topology.ep > 1 else set()
        )
        if topology.tp > 1:
            self._sync_tp_replicas(replicas)
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
        if self._ep_replicas:  # stages 0-2 (ep refuses 3): summed over ep at each step
            self.zero.ep_shared = self._ep_replicas
        self.comm.log.step = 0
        self.full_params = FullParams(self)  # one parameter's full values (zerostack.utils)
        attach(self, module)
        self.optimizer = optimizer_factory(self.zero.optimizer_groups())
        self.lr_scheduler = lr_scheduler(self.optimizer) if callable(lr_scheduler) else lr_scheduler
        self.loss_scaler = make_loss_scaler(config)
        # the norm's host read, and whether the optimizer can skip a step without it
        self._norm_reader = HostScalar(device)
        self._sq_host: torch.Tensor | None = None  # an offloaded norm's way up to the device
        self._masters_on_device = all(m.device == device for m in self.zero.masters())
        fused = getattr(self.optimizer, "_step_supports_amp_scaling", False)
        self._skips_on_device = fused and self._masters_on_device

        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._global_grad_norm: float | None = None
        self._step_applied = False  # whether the last step() updated the weights
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary
        self._inside_no_sync = False
        self.timers: dict[str, float] = defaultdict(float)
        # initialize(training_data=...)'s loader: train_batch() repeats it; checkpoints keep its
        # sampler's position
        self.training_dataloader = None
        self._data_iter = None
        self.flops_profile = None  # the flops_profiler block: one step's forwards profiled
        # the checkpoint block: resume at initialize, saves every save_interval steps, async
        self.auto_checkpoint = AutoCheckpoint(config.checkpoint)
        # the loss_spike block: roll back to the last checkpoint when the loss spikes
        self.loss_spike = None
        if config.loss_spike.factor:
            self.loss_spike = LossSpikeGuard(config.loss_spike, config.checkpoint.save_dir)
            self.monitor.collect_loss = True
        if config.flops_profiler.enabled:
            self.flops_profile = StepProfile(self, config.flops_profiler)

    def replicated_elsewhere(self) -> set[nn.Parameter]:
        """Parameters another rank also holds and counts (in the gradient norm, in checkpoints):
        tp replicas off tp rank 0, all but the experts off ep rank 0 (and, under a pipeline,
        tied copies off their first stage)."""
        topo = self.topology
        held = self._tp_replicas if topo.tp > 1 and topo.rank("tp") != 0 else set()
        if topo.ep > 1 and topo.rank("ep") != 0:
            held = held | self._ep_replicas
        return held

    def _sync_tp_replicas(self, replicas: list[nn.Parameter]) -> None:
        for t in [*replicas, *self.module.buffers()]:  # in model order: same on every rank
            if not is_sharded(t):  # zero.Init shards are broadcast when they are made
                self.comm.broadcast(t.data, src=0, axis="tp")

    def _require_optimizer(self, what: str) -> None:
        if self.optimizer is None:
            raise RuntimeError(
                f"engine.{what}(): this engine runs forward only (initialize was given no "
                f"optimizer and the config has no optimizer block)"
            )

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
        t0 = self.clock.now()
        if self.flops_profile is not None:
            self.flops_profile.forward_begins()
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
        self.monitor.add_loss(loss)
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
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self.apply_step()
            if self.flops_profile is not None:
                self.flops_profile.step_ends()
        self.micro_steps += 1  # before the count: an automatic save keeps whole windows
        if boundary:
            self._count_global_step()
        self.timers["step"] += self.clock.now() - t0

    # ------------------------------------------------------------------ whole batches
    def set_dataloader(self, loader) -> None:
        """The loader ``train_batch()`` and ``eval_batch()`` read when given no iterator."""
        self.training_dataloader = loader
        self._data_iter = None

    def _default_iter(self):
        """The engine loader, repeated (None without one)."""
        if self._data_iter is None and self.training_dataloader is not None:
            self._data_iter = repeat_loader(self.training_dataloader)
        return self._data_iter

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
        it = self._batch_iter(data_iter)
        return self._batch_mean(run_micro_batches(self, it, train=True))

    def eval_batch(self, data_iter=None) -> torch.Tensor:
        """The mean loss over ``gradient_accumulation_steps`` micro-batches, no update."""
        self.module.eval()
        it = self._batch_iter(data_iter)
        loss = self._batch_mean(run_micro_batches(self, it, train=False))
        self.module.train()
        return loss

    def _batch_mean(self, total: torch.Tensor) -> torch.Tensor:
        total = total / self._gas
        if self.topology.dp > 1:
            self.comm.all_reduce(total, axis="dp")
            total /= self.topology.dp
        return total

    def _count_global_step(self, loss: torch.Tensor | None = None) -> None:
        """After a step: count it, write its metrics (``loss``: the step's mean loss when the
        caller has it), print every ``steps_per_print``."""
        self.global_steps += 1
        self.global_samples += self._train_batch_size
        if loss is None and self.monitor.collect_loss:
            loss = self.monitor.window_loss()  # a collective over dp: every rank, every step
        self.monitor.write_step(self, loss)
        self.comm.log.next_step()
        self._maybe_print()
        # a spiking loss holds the automatic save back (latest must predate it) or rolls back
        save = self.loss_spike is None or self.loss_spike.after_step(self, loss)
        self.auto_checkpoint.after_step(self, save)  # checkpoint.save_interval; async errors

    def apply_step(self) -> None:
        """The accumulation boundary's update (what ``step()`` does on it, and what a runner
        calls once a batch's gradients are in): reduce, norm, clip, step, write back."""
        # The masters get their gradients summed over dp and loss-scaled; the norm is taken on
        # those, and averaging, unscaling and clipping are then one coefficient.
        stats = self.zero.reduce_grads(self.loss_scaler.loss_scale, self.replicated_elsewhere())
        norm = self._global_norm(stats)  # a 0-dim tensor on the device: nothing has waited yet
        self._norm_reader.start(norm)
        if self._skips_on_device:
            # torch's fused optimizers skip their update where ``found_inf`` is 1 (GradScaler's
            # protocol): the step and the write-back are queued before the host reads the norm,
            # so the GPU has them to run while the host waits for the norm alone.
            self.optimizer.found_inf = torch.isfinite(norm).logical_not().to(torch.float32)
            try:
                self.zero.step(self.optimizer, self._coef(norm, stats.post))
            finally:
                del self.optimizer.found_inf
        value = self._norm_reader.value()
        self._global_grad_norm = value
        # Every rank sees the same norm (its square is summed over every axis), so a NaN or inf
        # gradient on any rank skips the step on all of them, in every precision.
        overflow = not math.isfinite(value)
        if overflow:
            self._skip_step(value)
        else:
            if not self._skips_on_device:  # the step waits for the norm
                if self._masters_on_device:
                    coef = self._coef(norm, stats.post)
                else:  # a float, from the norm's host copy (the device's fp32 arithmetic)
                    coef = float(self._coef(self._norm_reader.host, stats.post))
                self.zero.step(self.optimizer, coef)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self._step_applied = not overflow
        self.loss_scaler.update(overflow)
        self.zero.zero_grad()

    def _coef(self, norm: torch.Tensor, post: float) -> torch.Tensor | float:
        """What the masters' gradients are multiplied by: ``post`` (the mean over the global
        batch, unscaled) times the clipping factor ``min(clip / (norm + 1e-6), 1)``, computed
        on the device (a tensor) when clipping is on."""
        clip = self.config.gradient_clipping
        if clip <= 0:
            return post
        return (clip / (norm + 1e-6)).clamp(max=1.0) * post

    def _global_norm(self, stats: GradStats) -> torch.Tensor:
        """The gradient norm over the whole model, averaged and unscaled, as a 0-dim fp32 tensor
        on the device. Each tp-split parameter is counted by every tp rank (its own slice), each
        replica once, each pipeline stage its own layers."""
        sq = stats.sq
        if sq.device != self.device:  # offloaded: summed on the host, up through pinned memory
            # (from pageable memory the copy would wait for the stream); written again only
            # after this step's norm read, which waits for the copy
            if self._sq_host is None or self._sq_host.dtype != sq.dtype:
                self._sq_host = host_empty((), sq.dtype)
            sq = self._sq_host.copy_(sq).to(self.device, non_blocking=True)
        if stats.sharded:
            self.comm.all_reduce(sq, axis="dp")
        for axis in ("tp", "pp", "ep"):
            if self.topology.size(axis) > 1:
                self.comm.all_reduce(sq, axis=axis)
        return sq.sqrt() * stats.post

    def _skip_step(self, norm: float) -> None:
        """A non-finite gradient norm: leave weights, optimizer state and LR schedule as they
        are. In fp16 that is the dynamic loss scaler's overflow; in bf16 and fp32 it is a bad batch
        or a diverging run, skipped (or raised, with ``on_nonfinite_grads: "error"``)."""
        self.skipped_steps += 1
        step = self.global_steps + 1
        if self.precision.name == "fp16":
            if self.global_rank == 0:
                log.info(
                    "step %d: fp16 gradient overflow, step skipped (loss scale %g)",
                    step,
                    self.loss_scale,
                )
            return
        if self.config.on_nonfinite_grads == "error":
            raise FloatingPointError(
                f"step {step}: the global gradient norm is {norm} (on_nonfinite_grads: error)"
            )
        if self.global_rank == 0:
            log.warning(
                "step %d: non-finite gradient norm (%s), step skipped (%d skipped so far)",
                step,
                norm,
                self.skipped_steps,
            )

    def zero_grad(self) -> None:
        """Gradients are zeroed after every optimizer step; this exists for API compatibility."""
        self.zero.zero_grad()

    def _maybe_print(self) -> None:
        every = self.config.steps_per_print
        if self.global_rank != 0 or every is None or self.global_steps % every:
            return
        lrs = [f"{lr:.3g}" for lr in self.get_lr()]
        print_progress(
            f"step={self.global_steps} skipped={self.skipped_steps} lr={lrs} "
            f"loss_scale={self.loss_scale:g} grad_norm={self._global_grad_norm} "
            f"{self.throughput_since_print()}".rstrip()
        )
        if self.config.wall_clock_breakdown:
            print_progress(f"time (s): { {k: round(v, 4) for k, v in self.timers.items()} }")
        if self.config.memory_breakdown:
            device = self.device_memory()  # the CUDA allocator's figures, on a GPU
            cuda = f" cuda allocator: {device}" if device else ""
            places = self.memory_by_device()
            apart = f" by device: {places}" if len(places) > 1 else ""
            print_progress(f"memory (bytes): {self.memory_breakdown()}{apart}{cuda}")
