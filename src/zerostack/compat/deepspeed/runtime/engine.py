"""``deepspeed.runtime.engine.DeepSpeedEngine``: zerostack's engine."""

from zerostack.engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
