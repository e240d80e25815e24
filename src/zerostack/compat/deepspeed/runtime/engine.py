"""``deepspeed.runtime.engine.DeepSpeedEngine``: zerostack's engine with DeepSpeed's own surface:
ranks and batch sizes as accessors, the last step's learning rates, norm and whether it applied,
``set_gradient_accumulation_boundary``, ``save_checkpoint`` / ``load_checkpoint`` with DeepSpeed's
arguments, precision and ZeRO-stage queries, the loss scale as DeepSpeed reads it, ``local_rank``,
the module's state dict and DeepSpeed's 16-bit model file, the stage-3 partition cache.
``zerostack.initialize`` (DeepSpeed's ``initialize``) returns one. Each is a line or two into one
of :class:`zerostack.engine.Engine`'s parts, which never imports this: natively, the same things
are ``engine.topology``, ``engine.batch``, ``engine.update``, ``engine.window`` and
``engine.checkpoints``.
"""

from __future__ import annotations

import logging
import weakref

import torch

from zerostack.checkpoint.model_files import consolidated_16bit, save_16bit_model
from zerostack.data import token_drop
from zerostack.engine import Engine
from zerostack.profiling.throughput import ThroughputTimer
from zerostack.zero.offload.states import StateOffload
from zerostack.zero.stage3.frozen_pieces import quantize_nontrainable
from zerostack.zero.strategy import Pieces

from .data_efficiency import DataEfficiency
from .engine_queries import EngineQueries, LossScale
from .hybrid_engine import gather_around_generate
from .zero.offload_config import OffloadDeviceEnum
from .zero.parameter_offload import DeepSpeedZeRoOffload

log = logging.getLogger("zerostack")


class _Overflow:
    """``engine.optimizer.overflow``: whether the last optimizer step was skipped for a
    non-finite gradient, as DeepSpeed's ZeRO and fp16 optimizers say (Accelerate's
    ``step_was_skipped`` reads it); and ``engine.optimizer.cur_scale``, the loss scale now (what
    DeepSpeed's Megatron tutorial logs; 1.0 without fp16)."""

    def __init__(self, optimizer, state, engine) -> None:
        self.optimizer, self.state = optimizer, state  # the engine's TrainState: its scaler
        optimizer.overflow = False
        optimizer.cur_scale = float(state.loss_scaler.loss_scale)

        me = weakref.ref(engine)  # the optimizer holds no way back to the engine

        def backward(loss, retain_graph=False):
            """DeepSpeed's ZeRO optimizer's ``backward(loss)``: the loss scaled (fp16) and
            backpropagated into the engine's gradients, not divided by the accumulation steps
            (``engine.backward`` divides)."""
            me().backward(loss, retain_graph=retain_graph, scale_wrt_gas=False)

        optimizer.backward = backward

        def check_overflow(partition_gradients=True) -> None:
            """DeepSpeed's ZeRO optimizer's: ``optimizer.overflow`` set to whether the gradients
            any rank holds in memory so far in this window have an inf or a NaN (a collective
            over every rank; gradients in NVMe files are not read)."""
            e = me()
            held = [t for kind, t in e.zero.state_tensors() if kind == "grads"]
            bad = torch.zeros((), device=e.device)  # one flag, read once after the all-reduce
            for t in held:
                bad = torch.maximum(bad, (~torch.isfinite(t)).any().to(bad))
            e.comm.all_reduce(bad, axis="world", op=torch.distributed.ReduceOp.MAX)
            optimizer.overflow = bool(bad.item())

        optimizer.check_overflow = check_overflow

    def after_step(self, report) -> None:
        self.optimizer.overflow = not report.applied
        self.optimizer.cur_scale = float(self.state.loss_scaler.loss_scale)


class DeepSpeedEngine(EngineQueries, DataEfficiency, Engine):
    """The engine ``initialize`` returns: :class:`~zerostack.engine.Engine` plus DeepSpeed's
    own accessors (see the module)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if isinstance(self.zero, Pieces) and self.optimizer is not None:
            # DeepSpeed's stage-3 optimizer holds the parameter hooks; RL code reaches them as
            # engine.optimizer.parameter_offload (TRL's remove_hooks / add_hooks)
            offload = DeepSpeedZeRoOffload(self.module, self.zero.coordinator())
            self.optimizer.parameter_offload = offload
            me = weakref.ref(self)  # the optimizer holds no way back to the engine's parts

            def quantize_nontrainable_params() -> int:
                """DeepSpeed's stage-3 optimizer's (:func:`quantize_nontrainable`)."""
                return quantize_nontrainable(me().zero, me().module)

            self.optimizer.quantize_nontrainable_params = quantize_nontrainable_params
        if self.optimizer is not None:
            self.add_callback(_Overflow(self.optimizer, self.state, self))
        self.states = StateOffload(self.module, self.zero, self.optimizer)
        gather_around_generate(self.module, self.config)
        # DeepSpeed's: started at each forward when initialize had no training data, stopped
        # at each step. Host time: DeepSpeed synchronizes the GPU at both ends by default, which
        # would stall every micro-step for a figure the progress line already gives
        self.tput_timer = ThroughputTimer(
            self.train_batch_size(), steps_per_output=self.steps_per_print()
        )
        self._set_up_random_ltd()

    def __getattr__(self, name: str):
        """What the engine lacks, its module's, as DeepSpeed's engine answers it
        (``engine.gradient_checkpointing_enable()``, a Hugging Face model's ``engine.model``):
        scripts written for DeepSpeed reach the model through the engine that way."""
        try:
            return super().__getattr__(name)  # nn.Module's: parameters, buffers, submodules
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute '{name}', nor has its module"
            ) from None

    # ------------------------------------------------------------------ RL colocation
    def offload_states(
        self, include=None, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=False
    ) -> None:
        """DeepSpeed's: move the training states off the device into host memory while
        something else uses it (an inference engine generating), until :meth:`reload_states`.
        ``include``: the :class:`OffloadStateTypeEnum` kinds to move (None: all of them);
        ``device``: only ``cpu`` (``none`` warns and does nothing, ``nvme`` is refused, as in
        DeepSpeed). Meanwhile forward is refused while the parameters are away, and backward,
        step and checkpoints while anything is (:mod:`zerostack.zero.offload.states`)."""
        if self.optimizer is None:
            raise RuntimeError("offload_states: this engine has no optimizer (forward only)")
        device = OffloadDeviceEnum(getattr(device, "value", device))
        if device == OffloadDeviceEnum.none:
            log.warning("offload_states: device 'none': nothing moved")
            return
        if device == OffloadDeviceEnum.nvme:
            raise ValueError("offload_states: device 'nvme' is not supported (DeepSpeed: cpu)")
        self.states.offload(include, pin_memory=pin_memory, non_blocking=non_blocking)

    def reload_states(self, non_blocking=False) -> None:
        """DeepSpeed's: bring back what :meth:`offload_states` moved; training continues bit
        for bit as if it never left."""
        if self.optimizer is None:
            raise RuntimeError("reload_states: this engine has no optimizer (forward only)")
        self.states.reload(non_blocking=non_blocking)

    def forward(self, *args, **kwargs):
        if self.training_dataloader is None:
            self.tput_timer.start()
        if self.module.training and self.random_ltd_enabled():  # the tokens kept this step
            self.random_ltd_scheduler.update_seq(self.global_steps)
        return super().forward(*args, **kwargs)

    forward.__doc__ = Engine.forward.__doc__

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        self.states.require_resident("backward")
        return super().backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)

    backward.__doc__ = Engine.backward.__doc__

    def step(self) -> None:
        self.states.require_resident("step")
        boundary = self.is_gradient_accumulation_boundary()
        super().step()
        self.tput_timer.stop(global_step=boundary, report_speed=self.global_rank == 0)

    step.__doc__ = Engine.step.__doc__

    # ------------------------------------------------------------------ the last step
    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the weights (False between accumulation
        boundaries and when a non-finite gradient skipped the step)."""
        return self.outcome.applied

    def get_lr(self) -> list[float]:
        """Each group's learning rate (none for a forward-only engine)."""
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer else []

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last optimizer step, before clipping (None before any)."""
        return self.outcome.grad_norm

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """From now on, the next backward and ``step()`` close a window (True) or not (False),
        whatever ``gradient_accumulation_steps`` says: set it before each micro-step, as in
        DeepSpeed. The loss is still divided by ``gradient_accumulation_steps``."""
        self.window.set_boundary(is_boundary)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self,
        save_dir: str,
        tag=None,
        client_state=None,
        save_latest=True,
        exclude_frozen_parameters=False,
        async_save=None,
    ):
        """DeepSpeed's save: every rank writes its own slices (a collective); default tag
        ``global_step<N>``; ``latest`` names the newest complete tag. Returns the tag's path.
        ``exclude_frozen_parameters``: leave out parameters with ``requires_grad=False`` (a
        LoRA run's frozen base); loading keeps the model's own values for them.
        ``async_save`` (None: the config's ``checkpoint.async_save``): copy the state to host
        memory and write it in the background (:mod:`zerostack.checkpoint.async_save`);
        :meth:`wait_for_checkpoint` waits for it. Any save first waits for a pending one."""
        self.states.require_resident("save_checkpoint")
        return self.checkpoints.save(
            save_dir,
            tag,
            client_state,
            save_latest,
            exclude_frozen=exclude_frozen_parameters,
            async_save=async_save,
        )

    def wait_for_checkpoint(self) -> None:
        """Wait until the pending background save is written and ``latest`` moved; raise
        :class:`~zerostack.checkpoint.errors.CheckpointError` (on every rank) if it failed on
        any rank."""
        self.checkpoints.wait()

    def load_checkpoint(
        self,
        load_dir: str,
        tag=None,
        load_module_strict=True,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_only=False,
        custom_load_fn=None,
    ):
        """DeepSpeed's load (``tag=None``: the ``latest`` one), on any ZeRO stage and dp size;
        returns ``(path, client_state)``, or ``(None, None)`` with a warning when ``tag`` is None
        and there is no ``latest`` file (nothing saved yet). A named tag that is missing, or a
        damaged checkpoint, raises :class:`~zerostack.checkpoint.errors.CheckpointError`.

        ``load_module_strict=False``: parameters and buffers the checkpoint lacks keep their
        values, and those the model lacks are ignored (shapes must still agree).
        ``custom_load_fn(src=state_dict, dst=module)`` replaces the loading of the weights:
        ``state_dict`` is the checkpoint's, shaped as this rank's module holds them (its
        tensor-parallel slices; at stage 3 the module's parameters are gathered while it runs),
        and what it leaves in the module becomes the fp32 masters."""
        self.states.require_resident("load_checkpoint")
        return self.checkpoints.load(  # once a pending background save has completed
            load_dir,
            tag,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            custom_load_fn=custom_load_fn,
        )

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: at stage 3, release every gathered parameter the engine keeps between
        uses (kept for a reuse under ``stage3_max_reuse_distance``, or prefetched); a no-op at
        stages 0-2. Call it outside forward and backward, e.g. before evaluation."""
        if isinstance(self.zero, Pieces):
            self.zero.release_gathered()

    def module_state_dict(
        self, destination=None, prefix="", keep_vars=False, exclude_frozen_parameters=False
    ):
        """``module.state_dict()`` (this rank's tensor-parallel slices; at stage 3 the
        parameters are empty between uses, as DeepSpeed's are), frozen parameters left out
        with ``exclude_frozen_parameters``, random-LTD's wrappers out of the names. For whole
        weights, :meth:`full_state_dict`."""
        sd = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters():
                if not p.requires_grad:
                    sd.pop(prefix + name, None)
        return token_drop.remove_random_ltd_state_dict(sd) if self.random_ltd_enabled() else sd

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters=False):
        """DeepSpeed's (Accelerate calls it under tensor parallelism): the whole model state dict
        in the 16-bit dtype on global rank 0 (None on the others), tensor-parallel slices joined,
        at any stage. A collective: every rank calls it."""
        out = consolidated_16bit(self.run, exclude_frozen_parameters)
        return out if self.global_rank == 0 else None

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters=False):
        """DeepSpeed's: at ZeRO stage 3, the whole model state dict in the 16-bit dtype, on the
        CPU, on global rank 0 (None on the others). A collective: every rank calls it."""
        if self.zero_optimization_stage() != 3:
            raise ValueError("this function requires ZeRO-3 mode")
        out = consolidated_16bit(self.run, exclude_frozen_parameters)
        return out if self.global_rank == 0 else None

    def save_16bit_model(
        self, save_dir, save_filename="pytorch_model.bin", exclude_frozen_parameters=False
    ) -> bool:
        """Write the whole model in the 16-bit dtype (the compute dtype; fp32 without fp16/bf16)
        to ``save_dir/save_filename`` from global rank 0; returns True once written. A
        collective: every rank calls it. At ZeRO stage 3 it needs
        ``zero_optimization.stage3_gather_16bit_weights_on_model_save`` (as in DeepSpeed: without
        it nothing is written and it returns False).

        As DeepSpeed writes it: a ``.safetensors`` name gets the safetensors format (what
        Hugging Face's ``from_pretrained`` prefers), any other name (``pytorch_model.bin``) a
        plain state dict of tensors in ``torch.save``'s format, which ``torch.load(path,
        weights_only=True)`` and ``from_pretrained`` read without unpickling code. Unlike
        DeepSpeed at stages 0-2, the weights are whole (tensor-parallel slices joined), and tied
        names are separate copies. The file is written to a temporary name and renamed."""
        return save_16bit_model(self.run, save_dir, save_filename, exclude_frozen_parameters)


__all__ = ["DeepSpeedEngine", "LossScale"]
