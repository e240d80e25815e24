"""``deepspeed.checkpoint``: the helper Accelerate calls when saving a state dict."""

from . import utils

__all__ = ["utils"]
