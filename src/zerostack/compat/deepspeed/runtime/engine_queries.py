"""DeepSpeed's read-only engine accessors (ranks, groups and sizes, batch sizes, precision and
ZeRO-stage queries, the loss scale, config values), mixed into
:class:`~zerostack.compat.deepspeed.runtime.engine.DeepSpeedEngine`. Each answers from one of
:class:`zerostack.engine.Engine`'s parts: ``topology``, ``batch``, ``config``, ``runner``,
``optimizer``, ``loss_scaler``."""

from __future__ import annotations

import os

import torch


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


class EngineQueries:
    """DeepSpeed's accessors over an engine's parts (see the module)."""

    # ------------------------------------------------------------------ where, how big
    @property
    def device(self) -> torch.device:
        return self.topology.device

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
    def data_parallel_group(self):
        """The process group of this rank's data-parallel replicas (the 'dp' axis)."""
        return self.topology.group("dp")

    def get_data_parallel_rank(self) -> int:
        """This rank's place in :attr:`data_parallel_group`."""
        return self.topology.dp_rank

    def get_sequence_parallel_group(self):
        """The ranks sharing this rank's sequences (``sequence_parallel_size`` above 1), else
        None, as DeepSpeed's engine holds it."""
        return self.topology.group("sp") if self.topology.sp > 1 else None

    def get_tensor_parallel_rank(self) -> int:
        return self.topology.rank("tp")

    get_model_parallel_rank = get_tensor_parallel_rank

    @property
    def mp_world_size(self) -> int:
        """The tensor-parallel size (DeepSpeed's model-parallel world size)."""
        return self.topology.tp

    def get_mom(self) -> list:
        """Each group's momentum as DeepSpeed gives it: ``betas`` (Adam family), else
        ``momentum`` (SGD)."""
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        return [g["betas"] if "betas" in g else g.get("momentum") for g in groups]

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def zero_offload_optimizer(self):
        """The config's ``zero_optimization.offload_optimizer`` block (None when not set)."""
        return self.config.zero_optimization.offload_optimizer

    def zero_offload_param(self):
        """The config's ``zero_optimization.offload_param`` block (None when not set)."""
        return self.config.zero_optimization.offload_param

    def steps_per_print(self):
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def optimizer_name(self) -> str | None:
        """As DeepSpeed's: the config's ``optimizer.type`` in lower case, else the class name of
        the optimizer given (None for a forward-only engine)."""
        if self.config.optimizer is not None:
            return self.config.optimizer.type.lower()
        return type(self.optimizer).__name__ if self.optimizer is not None else None

    def train_batch_size(self) -> int:
        return self.batch[0]

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.batch[1]

    def gradient_accumulation_steps(self) -> int:
        return self.batch[2]

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        return self.batch

    def is_first_stage(self) -> bool:
        """Whether this rank runs the first pipeline stage (without a pipeline: True)."""
        return self.runner.is_first_stage

    def is_last_stage(self) -> bool:
        """Whether this rank runs the last pipeline stage (without a pipeline: True)."""
        return self.runner.is_last_stage

    def reset_activation_shape(self) -> None:
        """DeepSpeed's pipeline engine's: the next ``train_batch`` / ``eval_batch`` learns
        again the shapes crossing the stage boundaries (call it before a batch whose micro-batch
        shape differs from the last: variable batch sizes or sequence lengths)."""
        if not getattr(self.runner, "pipelined", False):
            raise RuntimeError("reset_activation_shape: this engine runs no pipeline")
        self.runner.executor.forget_shapes()

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
        """The configured ZeRO stage."""
        return self.config.zero_optimization.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() >= 3

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def load_universal_checkpoint(self) -> bool:
        """``checkpoint.load_universal``: ``load_checkpoint`` takes the tag DeepSpeed's
        ``latest_universal`` names."""
        return self.config.checkpoint.load_universal


__all__ = ["EngineQueries", "LossScale"]
