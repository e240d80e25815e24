"""DeepSpeed's engine accessors and the engine's state in and out (mixed into
:class:`~.engine.Engine`, which sequences the training step).

Read-only figures (ranks, batch sizes, precision, learning rates, the last gradient norm),
DeepSpeed's accumulation controls (``set_gradient_accumulation_boundary``, ``no_sync``),
checkpoints (``save_checkpoint`` / ``load_checkpoint``: :mod:`.checkpoint` does the work, the
engine's counters, loss scaler and loader position in ``engine.state``), the full fp32
weights and DeepSpeed's 16-bit model file, memory figures and ``destroy``.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from .checkpoint.model_files import consolidated_16bit, full_weights, save_16bit_model
from .pinned import pinned_bytes
from .zero.strategy import Pieces, tally

log = logging.getLogger("zerostack")


class LossScale(float):
    """``engine.loss_scale``: the current loss scale, a number (zerostack's spelling, also
    DeepSpeed's ``engine.optimizer.loss_scale``). Called, ``engine.loss_scale()``, it is
    DeepSpeed's engine method: the configured static scale, ``fp16.loss_scale`` (0 means dynamic
    scaling; the current scale is then ``engine._get_optimizer_loss_scale()``)."""

    def __new__(cls, value: float, static: float = 0.0) -> LossScale:
        out = super().__new__(cls, value)
        out.static = float(static)
        return out

    def __call__(self) -> float:
        return self.static


class EngineAPI:
    @property
    def device(self) -> torch.device:
        return self.topology.device

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def global_rank(self) -> int:
        return self.topology.global_rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def dp_world_size(self) -> int:
        """Data-parallel replicas (different batches): the dp axis over sequence_parallel_size,
        as DeepSpeed counts it."""
        return self.topology.data_parallel_size

    @property
    def loss_scale(self) -> LossScale:
        """The current loss scale; ``engine.loss_scale()`` is DeepSpeed's ``fp16.loss_scale``."""
        return LossScale(self.loss_scaler.loss_scale, self.config.fp16.loss_scale)

    def _get_optimizer_loss_scale(self) -> float:
        """The current loss scale (DeepSpeed's name)."""
        return self.loss_scaler.loss_scale

    def dynamic_loss_scale(self) -> bool:
        return self.config.fp16.loss_scale == 0

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def zero_optimization_stage(self) -> int:
        """The configured ZeRO stage (a pipeline runs stage 2 as 1; this still says 2)."""
        return self.config.zero_optimization.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() >= 3

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def train_batch_size(self) -> int:
        return self._train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self._gas

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        return self._train_batch_size, self._micro_batch, self._gas

    def is_first_stage(self) -> bool:
        """Whether this rank runs the first pipeline stage (without a pipeline: True)."""
        return self.runner.is_first_stage

    def is_last_stage(self) -> bool:
        """Whether this rank runs the last pipeline stage (without a pipeline: True)."""
        return self.runner.is_last_stage

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the weights (False between accumulation
        boundaries and when a non-finite gradient skipped the step)."""
        return self.update.applied

    # ------------------------------------------------------------------ accumulation control
    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """From now on, the next backward and ``step()`` close a window (True) or not (False),
        whatever ``gradient_accumulation_steps`` says: set it before each micro-step, as in
        DeepSpeed. The loss is still divided by ``gradient_accumulation_steps``."""
        self._boundary_override = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients on each rank without reducing them; the
        first backward outside, on a boundary, reduces the sum. ``step()`` is refused inside. As
        in DeepSpeed, ZeRO stages 2 and 3 (which reduce gradients as they go, keeping only this
        rank's part) refuse it, and it does not nest."""
        stage = self.zero_optimization_stage()
        if stage >= 2:
            raise RuntimeError(
                f"no_sync context manager is incompatible with gradient partitioning logic of "
                f"ZeRO stage {stage}"
            )
        if self._inside_no_sync:
            raise RuntimeError("no_sync context manager reentry is unsupported")
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    def get_lr(self) -> list[float]:
        """Each group's learning rate (none for a forward-only engine)."""
        return [g["lr"] for g in self._optimizer_groups()]

    def _optimizer_groups(self) -> list[dict]:
        return self.optimizer.param_groups if self.optimizer is not None else []

    def _optimizer_state(self) -> list[dict]:
        return list(self.optimizer.state.values()) if self.optimizer is not None else []

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last optimizer step, before clipping (None before any)."""
        return self.update.grad_norm

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held by this rank: params, grads, master (fp32 copy) and optimizer state."""
        state = sum(
            t.nbytes
            for s in self._optimizer_state()
            for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0  # step counters are scalars
        )
        return {**self.zero.memory_breakdown(), "optimizer": state}

    def memory_by_device(self) -> dict[str, dict[str, int]]:
        """:meth:`memory_breakdown`'s bytes apart per device type (``{"cuda": {...}, "cpu":
        {...}}``): with offload, what stays on the GPU and what went to host memory. Only the
        places something is held appear (on a CPU run, ``cpu`` alone)."""
        out = tally(self.zero.held(), by_device=True)
        for s in self._optimizer_state():
            for t in s.values():
                if torch.is_tensor(t) and t.dim() > 0:
                    place = out.setdefault(t.device.type, tally(()))
                    place["optimizer"] = place.get("optimizer", 0) + t.nbytes
        for place in out.values():
            place.setdefault("optimizer", 0)
        return out

    def device_memory(self) -> dict[str, int]:
        """The CUDA caching allocator's figures for this rank's device, beside
        :meth:`memory_breakdown`'s census of what zerostack holds: ``allocated`` (now),
        ``max_allocated`` (the peak since the last ``reset_peak_memory_stats``) and ``reserved``
        (held by the allocator, free blocks included); and ``pinned``, the page-locked host bytes
        torch's host allocator holds (each block rounded up to a power of two: up to twice what
        the census counts in pinned tensors). Empty on the CPU."""
        if self.device.type != "cuda":
            return {}
        out = {
            "allocated": torch.cuda.memory_allocated(self.device),
            "max_allocated": torch.cuda.max_memory_allocated(self.device),
            "reserved": torch.cuda.memory_reserved(self.device),
        }
        pinned = pinned_bytes()
        if pinned is not None:
            out["pinned"] = pinned
        return out

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
        :class:`~.checkpoint.CheckpointError` (on every rank) if it failed on any rank."""
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
        damaged checkpoint, raises :class:`~.checkpoint.CheckpointError`.

        ``load_module_strict=False``: parameters and buffers the checkpoint lacks keep their
        values, and those the model lacks are ignored (shapes must still agree).
        ``custom_load_fn(src=state_dict, dst=module)`` replaces the loading of the weights:
        ``state_dict`` is the checkpoint's, shaped as this rank's module holds them (its
        tensor-parallel slices; at stage 3 the module's parameters are gathered while it runs),
        and what it leaves in the module becomes the fp32 masters."""
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

    def destroy(self) -> None:
        """Finish a pending background save (raising its error), release what the engine holds
        outside the process (NVMe offload files) and stop its watchdog."""
        watchdog = getattr(self, "watchdog", None)
        if watchdog is not None:
            watchdog.stop()
            self.watchdog = None
        for callback in self.callbacks:  # the monitors flush and close their files
            if callable(getattr(callback, "close", None)):
                callback.close()
        self.zero.close()
        self.checkpoints.wait()  # a pending background save is written (or its error raised)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model weights in fp32 on the CPU, tensor-parallel slices joined (a collective:
        call it on every rank)."""
        return full_weights(self.run)

    # ------------------------------------------------------------------ DeepSpeed's model files
    def module_state_dict(
        self, destination=None, prefix="", keep_vars=False, exclude_frozen_parameters=False
    ):
        """``module.state_dict()`` (this rank's tensor-parallel slices; at stage 3 the
        parameters are empty between uses, as DeepSpeed's are), frozen parameters left out
        with ``exclude_frozen_parameters``. For whole weights, :meth:`full_state_dict`."""
        sd = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters():
                if not p.requires_grad:
                    sd.pop(prefix + name, None)
        return sd

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
