"""``deepspeed.ops.lion``: ``DeepSpeedCPULion`` (Accelerate builds it from a 32-bit
bitsandbytes Lion when the optimizer is offloaded) and ``FusedLion``, both zerostack's
:class:`~zerostack.optim.Lion` with DeepSpeed's arguments."""

from __future__ import annotations

from zerostack.optim import Lion


class DeepSpeedCPULion(Lion):
    """DeepSpeed's ``DeepSpeedCPULion(model_params, lr, betas, weight_decay,
    fp32_optimizer_states)`` (its defaults); ``fp32_optimizer_states`` is accepted: fp32
    masters give fp32 states."""

    def __init__(
        self,
        model_params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)


class FusedLion(Lion):
    """DeepSpeed's ``FusedLion(params, lr, betas, weight_decay, set_grad_none)``."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)


__all__ = ["DeepSpeedCPULion", "FusedLion"]
