"""``deepspeed.ops``: the optimizers Accelerate and DeepSpeed configs name. zerostack has no
compiled ops: these are torch's optimizers, zerostack's CPU Adam and its Lion."""

from . import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]
