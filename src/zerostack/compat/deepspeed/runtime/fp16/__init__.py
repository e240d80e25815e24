"""``deepspeed.runtime.fp16``: the loss scalers' classes as checkpoint files hold them."""

from . import loss_scaler

__all__ = ["loss_scaler"]
