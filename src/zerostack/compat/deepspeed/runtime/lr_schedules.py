"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedules (the warmups, the range test and
1Cycle), and ``VALID_LR_SCHEDULES`` (the names a config's ``scheduler.type`` takes, in
DeepSpeed's order; Accelerate checks a name against it)."""

from zerostack.optim.lr_schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)

VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]

__all__ = [
    "LRRangeTest",
    "OneCycle",
    "VALID_LR_SCHEDULES",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
]
