"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` (zerostack's CPU Adam, DeepSpeed's arguments)
and ``FusedAdam`` (torch's Adam with DeepSpeed's arguments)."""

from __future__ import annotations

import torch

from zerostack.optim import CPUAdam as DeepSpeedCPUAdam


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode,
    weight_decay, amsgrad, set_grad_none)`` as torch's Adam: decoupled weight decay (AdamW)
    when ``adam_w_mode``, L2 otherwise. Torch picks its fastest kernel for the device."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if not bias_correction:
            raise ValueError("FusedAdam(bias_correction=False): torch's Adam always corrects")
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            decoupled_weight_decay=adam_w_mode,
        )


__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
