"""DeepSpeed's warmup learning-rate schedulers: WarmupLR, WarmupDecayLR and WarmupCosineLR.

Same constructor arguments, same numbers and the same stepping convention as DeepSpeed: the
scheduler writes its lr into the optimizer's param groups on construction and on every step(),
and the engine calls ``optimizer.step()`` before ``scheduler.step()``::

    sched = build_lr_scheduler(optimizer, "WarmupDecayLR", {"total_num_steps": 1000})
    for batch in loader:
        loss.backward(); optimizer.step(); sched.step()
"""

from __future__ import annotations

import math
import warnings
from typing import Any

WARMUP_TYPES = ("log", "linear")


def _check_warmup_type(warmup_type: str) -> None:
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}")


def warmup_fraction(it: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of the warmup done at iteration ``0 <= it < warmup_num_steps`` (0.0 at it=0)."""
    _check_warmup_type(warmup_type)
    if warmup_type == "log":
        # Multiply by the reciprocal, as DeepSpeed does, so results match it bit for bit.
        return (1.0 / math.log(warmup_num_steps)) * math.log(it + 1)
    return it / warmup_num_steps


def _per_group(optimizer: Any, value: Any, name: str) -> list[float]:
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} values for {n} optimizer param groups")
        return [float(v) for v in value]
    return [float(value)] * n


class _Scheduler:
    """Stepping, lr writing and checkpointing shared by the three schedulers."""

    def __init__(
        self, optimizer: Any, warmup_num_steps: int, warmup_type: str, last_batch_iteration: int
    ) -> None:
        if not hasattr(optimizer, "param_groups"):
            raise TypeError(f"{type(optimizer).__name__} has no param_groups; pass an optimizer")
        _check_warmup_type(warmup_type)
        self.optimizer = optimizer
        # log(1) == 0 would divide by zero in the log warmup.
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None

    def _warn_if_short(self, total_num_steps: int) -> None:
        if total_num_steps < self.warmup_num_steps:
            msg = f"total_num_steps {total_num_steps} < warmup_num_steps {self.warmup_num_steps}"
            warnings.warn(msg, stacklevel=3)

    def _init_lrs(self) -> None:
        # DeepSpeed writes lrs only for a fresh run; a resumed one gets them from step/load.
        if self.last_batch_iteration == -1:
            self._write_lrs()

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _write_lrs(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._last_lr = lrs

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._write_lrs()

    def get_last_lr(self) -> list[float]:
        # Before any write (resumed with last_batch_iteration >= 0) fall back to what the
        # optimizer holds, instead of DeepSpeed's assertion.
        if self._last_lr is None:
            return [float(g["lr"]) for g in self.optimizer.param_groups]
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.last_batch_iteration = int(sd["last_batch_iteration"])
        # Re-write so the next optimizer step uses the checkpointed lr even when the optimizer's
        # own state (which carries the lr too) is not restored.
        self._write_lrs()


class WarmupLR(_Scheduler):
    """Warm up from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold."""

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if warmup_max_lr is None:  # each group's own lr, as DeepSpeed's WarmupLR
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs, strict=True)]
        self._init_lrs()

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return warmup_fraction(
                self.last_batch_iteration, self.warmup_num_steps, self.warmup_type
            )
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at total_num_steps."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        # Set before super().__init__, which already calls get_lr().
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )
        self._warn_if_short(total_num_steps)

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._get_gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Scheduler):
    """Warm up each group's own lr by a ratio, then cosine-decay it to cos_min_ratio."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self._warn_if_short(total_num_steps)
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self._init_lrs()

    def get_lr_ratio(self) -> float:
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            r = warmup_fraction(it, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + r * (1.0 - self.warmup_min_ratio)
        real_last = it - self.warmup_num_steps + 1
        # DeepSpeed divides by zero when total == warmup; treat that as "decay already done".
        real_total = self.total_num_steps - self.warmup_num_steps
        if real_total == 0:
            return self.cos_min_ratio
        c = (1 + math.cos(math.pi * real_last / real_total)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * c)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0] * len(self.org_lrs)
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]

    def state_dict(self) -> dict[str, Any]:
        # org_lrs must travel: a resumed optimizer's lr is the decayed one, not the original.
        return {"last_batch_iteration": self.last_batch_iteration, "org_lrs": list(self.org_lrs)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if "org_lrs" in sd:  # DeepSpeed's own checkpoints carry only last_batch_iteration
            self.org_lrs = [float(v) for v in sd["org_lrs"]]
        super().load_state_dict(sd)


SCHEDULERS: dict[str, type[_Scheduler]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}


def build_lr_scheduler(optimizer: Any, type: str, params: dict[str, Any]) -> _Scheduler:
    """The scheduler named by the config's ``scheduler.type``, built with its ``params``."""
    if type not in SCHEDULERS:
        raise ValueError(f"unknown scheduler type {type!r}; supported: {sorted(SCHEDULERS)}")
    return SCHEDULERS[type](optimizer, **params)
