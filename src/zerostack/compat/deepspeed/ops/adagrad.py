"""``deepspeed.ops.adagrad``: ``DeepSpeedCPUAdagrad`` (Accelerate builds it from a torch Adagrad
when the optimizer is offloaded) as torch's Adagrad, which steps wherever the masters are."""

from __future__ import annotations

import torch


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's ``DeepSpeedCPUAdagrad(model_params, lr, eps, weight_decay, amsgrad,
    fp32_optimizer_states)``: Adagrad with L2 weight decay (the decay added to the gradient),
    no learning-rate decay and a zero initial accumulator, which is torch's Adagrad at those
    settings. ``amsgrad`` has no meaning for Adagrad (DeepSpeed's kernel ignores it): True is
    refused. ``fp32_optimizer_states`` is accepted; fp32 masters give fp32 states."""

    def __init__(
        self,
        model_params,
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad(amsgrad=True): Adagrad has no amsgrad variant")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)


__all__ = ["DeepSpeedCPUAdagrad"]
