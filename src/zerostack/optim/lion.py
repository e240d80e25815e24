"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), with DeepSpeed's
``DeepSpeedCPULion`` / ``FusedLion`` arguments. torch has no Lion; this is the paper's update,
per parameter ``p`` with gradient ``g`` and momentum ``m`` (zeros at the first step)::

    p <- p * (1 - lr * weight_decay)                 # decoupled weight decay
    p <- p - lr * sign(beta1 * m + (1 - beta1) * g)
    m <- beta2 * m + (1 - beta2) * g
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class Lion(torch.optim.Optimizer):
    """Lion over any parameters (``lr``, ``betas``, ``weight_decay`` also per param group);
    the state per parameter is ``exp_avg`` (the momentum). Parameters whose ``grad`` is None are
    skipped."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0:
            raise ValueError(f"Lion: lr must be >= 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion: betas must be in [0, 1), got {tuple(betas)}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.to(p.dtype)
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(torch.sign(m * beta1 + g * (1 - beta1)), alpha=-lr)
                m.mul_(beta2).add_(g, alpha=1 - beta2)
        return loss
