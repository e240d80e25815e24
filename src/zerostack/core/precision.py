"""Mixed-precision policy (one object) and DeepSpeed's dynamic loss scaler for fp16.

The policy says which dtype the model computes in, which dtype the master weights and the
gradients they are handed are kept in (fp32 unless ``bf16.bf16_master_weights_and_grads`` or
``fp16.fp16_master_weights_and_grads``), which dtype gradients are reduced in over dp
(``communication_data_type``) and which they are summed in across micro-batches
(``data_types.grad_accum_dtype``)::

    policy = Precision.from_config(cfg)     # fp32, fp16 or bf16
    policy.reduce_dtype                     # torch.float32 with communication_data_type "fp32"
    policy.accum_dtype(stage=1)             # the model's dtype unless grad_accum_dtype says
    scaler = DynamicLossScaler(initial_scale_power=16, loss_scale_window=1000, hysteresis=2)
    scaler.update(overflow=True)   # skip the step; halve the scale once hysteresis is spent
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    compute_dtype: torch.dtype = torch.float32
    comm_dtype: torch.dtype | None = None
    """``communication_data_type`` (None: the compute dtype, DeepSpeed's default)."""
    grad_accum_dtype: torch.dtype | None = None
    """``data_types.grad_accum_dtype`` (None: the stage's default, see :meth:`accum_dtype`)."""
    master_dtype: torch.dtype = torch.float32
    """The masters' and their gradients' dtype: the compute dtype with DeepSpeed's
    ``*_master_weights_and_grads`` keys (ZeRO 1-3), else fp32."""

    @classmethod
    def from_config(cls, cfg) -> Precision:
        compute = DTYPES[cfg.model_dtype]
        comm = cfg.communication_data_type
        accum = cfg.data_types.grad_accum_dtype
        sixteen = cfg.bf16.bf16_master_weights_and_grads or cfg.fp16.fp16_master_weights_and_grads
        master = compute if sixteen else torch.float32
        return cls(compute, comm and DTYPES[comm], accum and DTYPES[accum], master)

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype gradient buckets are reduced in over dp."""
        return self.comm_dtype or self.compute_dtype

    def accum_dtype(self, stage: int) -> torch.dtype:
        """The dtype a ZeRO ``stage`` sums gradients in across micro-batches: the configured one,
        else the compute dtype at stages 0-1 (the local full gradients, as DeepSpeed) and fp32 at
        stages 2-3 (the reduced pieces; DeepSpeed keeps them in the compute dtype), or the
        masters' 16-bit dtype where they are kept in it."""
        if self.grad_accum_dtype is not None:
            return self.grad_accum_dtype
        if self.master_dtype != torch.float32:  # 16-bit masters and gradients: DeepSpeed's
            return self.master_dtype
        return self.compute_dtype if stage < 2 else torch.float32

    @property
    def mixed(self) -> bool:
        """True when the model computes in 16 bits and an fp32 master copy is kept."""
        return self.compute_dtype != torch.float32

    @property
    def name(self) -> str:
        return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[
            self.compute_dtype
        ]


class LossScaler:
    """A fixed scale (fp16 with ``loss_scale > 0``, or 1.0 when no scaling is needed)."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, sd: dict) -> None:
        self.cur_scale = float(sd["cur_scale"])


class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic loss scaling, same knobs, same arithmetic.

    On overflow the step is skipped; the scale halves once ``hysteresis`` overflows have been
    absorbed (never below ``min_loss_scale``; an overflow at that floor ends the run, as
    DeepSpeed's does). After each ``loss_scale_window`` clean steps since the last overflow, not
    counting the first, the scale doubles and, unless ``consecutive_hysteresis``, the hysteresis
    budget is refilled (DeepSpeed 0.19's count: ``stable_interval``).
    """

    dynamic = True

    def __init__(
        self,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        min_loss_scale: float = 1.0,
        consecutive_hysteresis: bool = False,
        scale_factor: float = 2.0,
    ) -> None:
        super().__init__(2.0**initial_scale_power)
        self.scale_window = loss_scale_window
        self.min_scale = float(min_loss_scale)
        self.delayed_shift = hysteresis
        self.cur_hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.scale_factor = scale_factor
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise FloatingPointError(
                        f"fp16: the gradients overflowed at the minimum loss scale "
                        f"(fp16.min_loss_scale={self.min_scale:g}); the scale cannot go lower. "
                        "Lower the learning rate, or train in bf16"
                    )
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, sd: dict) -> None:
        self.cur_scale = float(sd["cur_scale"])
        self.cur_iter = int(sd["cur_iter"])
        self.last_overflow_iter = int(sd["last_overflow_iter"])
        # DeepSpeed's stage 0 fp16 files keep no hysteresis: it restarts from the config
        self.cur_hysteresis = int(sd.get("cur_hysteresis", self.delayed_shift))


def make_loss_scaler(cfg) -> LossScaler:
    """The scaler the config asks for: dynamic fp16, static fp16, or none (scale 1)."""
    fp16 = cfg.fp16
    if not fp16.enabled:
        return LossScaler(1.0)
    if fp16.loss_scale > 0:
        return LossScaler(fp16.loss_scale)
    return DynamicLossScaler(
        initial_scale_power=fp16.initial_scale_power,
        loss_scale_window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        min_loss_scale=fp16.min_loss_scale,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
    )


def autocast_dtype(cfg, device: torch.device) -> torch.dtype:
    """``torch_autocast.dtype``, or torch's autocast default for ``device`` when not given."""
    block = cfg.torch_autocast
    return DTYPES[block.dtype] if block.dtype else torch.get_autocast_dtype(device.type)


def forward_autocast(cfg, device: torch.device):
    """The context the engine's forward runs in: ``torch.autocast`` in :func:`autocast_dtype`
    when the block is enabled, as DeepSpeed's engine runs it (an enclosing autocast is
    overridden); else nothing."""
    if not cfg.torch_autocast.enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=autocast_dtype(cfg, device))


def autocast_state(t: torch.Tensor) -> tuple[str, bool, torch.dtype]:
    """The autocast state a custom Function's forward runs under on ``t``'s device type, for its
    backward to run under too (what ``torch.amp.custom_fwd``/``custom_bwd`` record, for whichever
    device the tensors are on). Under a user's ``torch.autocast``, forward's ``F.linear`` computes
    in bf16 and backward, outside the context, would multiply a bf16 gradient by an fp32
    weight."""
    kind = "cpu" if t.is_meta else t.device.type  # a dry run's meta tensors: as the CPU's
    return kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


def autocast_as(state: tuple[str, bool, torch.dtype]):
    """A context that restores :func:`autocast_state`'s ``state``."""
    kind, enabled, dtype = state
    return torch.autocast(kind, dtype=dtype, enabled=enabled)
