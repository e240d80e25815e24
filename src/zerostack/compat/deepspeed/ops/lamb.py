"""``deepspeed.ops.lamb``: ``FusedLamb``, zerostack's :class:`~zerostack.optim.Lamb` with
DeepSpeed's arguments (torch code: DeepSpeed's is a CUDA kernel)."""

from __future__ import annotations

from zerostack.optim import Lamb


class FusedLamb(Lamb):
    """DeepSpeed's ``FusedLamb(params, lr, bias_correction, betas, eps, eps_inside_sqrt,
    weight_decay, max_grad_norm, max_coeff, min_coeff, amsgrad)``. ``max_grad_norm`` above 0
    (FusedLamb's own clipping, which DeepSpeed's engine refuses for the config's optimizer: use
    ``gradient_clipping``) and ``amsgrad`` are refused."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedLamb does not support the AMSGrad variant.")
        if max_grad_norm > 0:
            raise ValueError(
                "FusedLamb: max_grad_norm is not supported; clip with the config's "
                "gradient_clipping"
            )
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )


__all__ = ["FusedLamb"]
