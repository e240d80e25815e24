"""``deepspeed.inference``: :class:`~.engine.InferenceEngine`, what ``deepspeed.init_inference``
returns."""

from .engine import InferenceEngine, init_inference

__all__ = ["InferenceEngine", "init_inference"]
