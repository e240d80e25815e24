"""LAMB: DeepSpeed's ``"optimizer": {"type": "Lamb"}`` (its ``FusedLamb``, a CUDA kernel).

Per parameter, with the kernel's arithmetic (You et al. 2019, as NVIDIA's apex wrote it):

    m = beta1 * m + (1 - beta1) * g ;  v = beta2 * v + (1 - beta2) * g^2   (uncorrected)
    u = m / (sqrt(v) + eps) + weight_decay * w          (sqrt(v + eps) with eps_inside_sqrt)
    c = clamp(||w|| / ||u||, min_coeff, max_coeff)      (1 where either norm is 0)
    w = w - lr * sqrt(1 - beta2^t) / (1 - beta1^t) * c * u   (lr alone without bias_correction)

The trust ratio ``c`` is each parameter's: where the optimizer steps pieces of several
parameters (ZeRO's masters), ``whole`` (given by the engine:
:class:`zerostack.zero.whole_params.WholeParams`) sums each parameter's squares over its pieces.
DeepSpeed's ZeRO hands FusedLamb its flat partitions (only with
``zero_allow_untested_optimizer``), so there one ratio spans a partition's parameters; the
paper's, DeepSpeed's without ZeRO and this one are per parameter. ``step`` in the state is a
float32 scalar tensor (torch's convention); ``get_lamb_coeffs()`` gives the last step's ratios.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def adam_moments(state: dict, p: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    """``p``'s Adam-style state in torch's layout (``step``, a float32 scalar tensor;
    ``exp_avg``, ``exp_avg_sq`` shaped as ``p``), made on first use, the step counted: ``(the
    step number, exp_avg, exp_avg_sq)``. LAMB's and Muon's auxiliary Adam's."""
    if "step" not in state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p)
        state["exp_avg_sq"] = torch.zeros_like(p)
    state["step"] += 1
    return float(state["step"]), state["exp_avg"], state["exp_avg_sq"]


class Lamb(torch.optim.Optimizer):
    """LAMB (see the module); DeepSpeed's FusedLamb arguments."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.whole = None  # set by the engine where the tensors stepped are pieces
        self.lamb_coeffs: list[torch.Tensor] = []

    def get_lamb_coeffs(self) -> list[float]:
        """The last step's trust ratio of each tensor stepped (FusedLamb's method; a tensor
        holding pieces of several parameters gives its first's)."""
        return [float(c) for c in self.lamb_coeffs]

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        for group in self.param_groups:
            (b1, b2), eps, wd = group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                t, m, v = adam_moments(self.state[p], p)
                g = p.grad
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (v + eps).sqrt() if group["eps_inside_sqrt"] else v.sqrt().add_(eps)
                update = (m / denom).add_(p, alpha=wd)
                if self.whole is not None and self.whole.holds(p):
                    w_norm, u_norm = self.whole.norms(p, [p, update])
                else:
                    w_norm, u_norm = p.norm(), update.norm()
                ratio = torch.where(
                    (w_norm != 0) & (u_norm != 0),
                    (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"]),
                    torch.ones_like(w_norm),
                )
                step_size = group["lr"]
                if group["bias_correction"]:
                    step_size *= (1 - b2**t) ** 0.5 / (1 - b1**t)
                p.sub_(ratio * update, alpha=step_size)
                self.lamb_coeffs.append(ratio.reshape(-1)[0].detach().clone())
        return loss
