"""``deepspeed.runtime``: the engine class, the schedules, the optimizer base class, ZeRO-3's
model-construction module and parameter hooks, the helpers scripts import (``utils``,
``dataloader``), at DeepSpeed's paths."""

from . import base_optimizer, dataloader, engine, lr_schedules, utils, zero

__all__ = ["base_optimizer", "dataloader", "engine", "lr_schedules", "utils", "zero"]
