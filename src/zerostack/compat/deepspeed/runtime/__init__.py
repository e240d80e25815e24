"""``deepspeed.runtime``: the engine class, the schedules, the optimizer base class, ZeRO-3's
model-construction module and parameter hooks, the helpers scripts import (``utils``,
``dataloader``), activation checkpointing, at DeepSpeed's paths."""

from . import (
    activation_checkpointing,
    base_optimizer,
    dataloader,
    engine,
    lr_schedules,
    utils,
    zero,
)

__all__ = [
    "activation_checkpointing",
    "base_optimizer",
    "dataloader",
    "engine",
    "lr_schedules",
    "utils",
    "zero",
]
