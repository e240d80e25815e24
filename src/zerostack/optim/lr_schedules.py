"""DeepSpeed's learning-rate schedulers: WarmupLR, WarmupDecayLR, WarmupCosineLR, and the
range test and 1Cycle policy of arXiv 1803.09820 (LRRangeTest, OneCycle: the latter cycles
Adam's first beta too).

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


class LRRangeTest(_Scheduler):
    """The learning-rate range test: from ``lr_range_test_min_lr``, the lr grows by
    ``lr_range_test_step_rate`` times itself every ``lr_range_test_step_size`` steps,
    continuously or as a staircase (DeepSpeed's arithmetic)."""

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | list[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, 2, "linear", last_batch_iteration)
        if not isinstance(lr_range_test_step_size, int) or lr_range_test_step_size <= 0:
            raise ValueError(
                f"lr_range_test_step_size must be a positive integer, got {lr_range_test_step_size}"
            )
        self.min_lr = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size, self.step_rate = lr_range_test_step_size, lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self._init_lrs()

    def get_lr(self) -> list[float]:
        interval = float(self.last_batch_iteration + 1) / self.step_size
        increase = 1 + self.step_rate * (math.floor(interval) if self.staircase else interval)
        return [lr * increase for lr in self.min_lr]


class OneCycle(_Scheduler):
    """1Cycle: the lr climbs from ``cycle_min_lr`` to ``cycle_max_lr`` over
    ``cycle_first_step_size`` steps and back over ``cycle_second_step_size`` (optionally in
    stairs), then decays by ``decay_lr_rate`` per ``decay_step_size`` steps; with
    ``cycle_momentum`` and an optimizer with betas, the first beta moves the other way between
    ``cycle_max_mom`` and ``cycle_min_mom`` (the second set to 0.99, as DeepSpeed sets it)."""

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float | list[float],
        cycle_max_lr: float | list[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | list[float] = 0.8,
        cycle_max_mom: float | list[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, 2, "linear", last_batch_iteration)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {first}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {second}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count
            if cycle_second_stair_count is None
            else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate, self.decay_mom_rate = decay_lr_rate, decay_mom_rate
        no_decay = math.isclose(decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = no_decay or math.isclose(decay_mom_rate, 0)
        self.cycle_momentum = cycle_momentum and "betas" in getattr(optimizer, "defaults", {})
        if cycle_momentum and not self.cycle_momentum:
            warnings.warn(
                f"OneCycle: cycle_momentum is off: {type(optimizer).__name__} has no betas",
                stacklevel=2,
            )
        if self.cycle_momentum:
            low = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
            high = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
            self.min_moms = [(m, 0.99) for m in low]
            self.max_moms = [(m, 0.99) for m in high]
            if last_batch_iteration == -1:
                for betas, group in zip(self.min_moms, optimizer.param_groups, strict=True):
                    group["betas"] = betas
        if last_batch_iteration == -1:  # DeepSpeed writes the cycle's lower lrs first
            for lr, group in zip(self.min_lrs, optimizer.param_groups, strict=True):
                group["lr"] = lr
            self._last_lr = list(self.min_lrs)

    def _scale(self) -> float:
        it = self.last_batch_iteration + 1
        x = 1.0 + it / self.total_size - math.floor(1 + it / self.total_size)
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # held flat across each stair, from the integer position in the cycle
            at = it % self.total_size
            if at <= self.first_step_size:
                position = at * stairs / self.first_step_size
            else:
                position = (self.total_size - at) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [
                lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)
            ]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        after = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_lr_rate * (after / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """Each group's betas for the current step (None without momentum cycling)."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            pairs = zip(self.min_moms, self.max_moms, strict=True)
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in pairs]
        if self.skip_mom_decay:
            return list(self.max_moms)
        after = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_mom_rate * (after / self.decay_step_size)
        return [(b0 * factor, b1) for b0, b1 in self.max_moms]

    def _write_lrs(self) -> None:
        super()._write_lrs()
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.get_mom(), strict=True):
                group["betas"] = betas


SCHEDULERS: dict[str, type[_Scheduler]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}


def build_lr_scheduler(optimizer: Any, type: str, params: dict[str, Any]) -> _Scheduler:
    """The scheduler named by the config's ``scheduler.type``, built with its ``params``."""
    if type not in SCHEDULERS:
        raise ValueError(f"unknown scheduler type {type!r}; supported: {sorted(SCHEDULERS)}")
    return SCHEDULERS[type](optimizer, **params)
