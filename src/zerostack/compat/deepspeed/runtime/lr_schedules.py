"""``deepspeed.runtime.lr_schedules``: DeepSpeed's warmup schedules, and ``VALID_LR_SCHEDULES``
(the names a config's ``scheduler.type`` takes; Accelerate checks a name against it)."""

from zerostack.optim.lr_schedules import SCHEDULERS, WarmupCosineLR, WarmupDecayLR, WarmupLR

VALID_LR_SCHEDULES = list(SCHEDULERS)

__all__ = ["VALID_LR_SCHEDULES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
