"""``deepspeed.runtime.fp16.loss_scaler``: ``LossScaler`` and ``DynamicLossScaler`` as DeepSpeed's
checkpoint files hold them (their attributes: ``cur_scale``, ``dynamic``, ...), for code that
reads those files with ``torch.load(weights_only=False)``. zerostack's engine scales the loss
itself (``engine.optimizer.cur_scale``); these hold values, no scaling code."""

from zerostack.checkpoint.deepspeed_read import _DynamicLossScaler as DynamicLossScaler
from zerostack.checkpoint.deepspeed_read import _LossScaler as LossScaler

__all__ = ["DynamicLossScaler", "LossScaler"]
