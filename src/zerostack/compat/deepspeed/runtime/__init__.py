"""``deepspeed.runtime``: the engine class, the schedules, the optimizer base class and ZeRO-3's
model-construction module, at DeepSpeed's paths."""

from . import base_optimizer, engine, lr_schedules, zero

__all__ = ["base_optimizer", "engine", "lr_schedules", "zero"]
