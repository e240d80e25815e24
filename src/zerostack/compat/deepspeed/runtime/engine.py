"""``deepspeed.runtime.engine.DeepSpeedEngine``: zerostack's engine with the accessors that
exist for DeepSpeed's callers alone (precision and ZeRO-stage queries, the loss scale as DeepSpeed
reads it, the batch triple, ``local_rank``, the module's state dict and DeepSpeed's 16-bit model
file, the stage-3 partition cache). ``zerostack.initialize`` (DeepSpeed's ``initialize``)
returns one; everything else is :class:`zerostack.engine.Engine`'s, which never imports this.
"""

from __future__ import annotations

import os

from zerostack.checkpoint.model_files import consolidated_16bit, save_16bit_model
from zerostack.engine import Engine
from zerostack.zero.strategy import Pieces


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


class DeepSpeedEngine(Engine):
    """The engine ``initialize`` returns: :class:`~zerostack.engine.Engine` plus DeepSpeed's
    own accessors (see the module)."""

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

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

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        return self._train_batch_size, self._micro_batch, self._gas

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


__all__ = ["DeepSpeedEngine", "LossScale"]
