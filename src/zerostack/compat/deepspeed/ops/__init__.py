"""``deepspeed.ops``: the optimizers Accelerate and DeepSpeed configs name. zerostack has no
compiled ops: these are torch's optimizers and zerostack's CPU Adam."""

from . import adam

__all__ = ["adam"]
