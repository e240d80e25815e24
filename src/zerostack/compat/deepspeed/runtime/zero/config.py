"""``deepspeed.runtime.zero.config``: ``ZeroStageEnum``, the ZeRO stage as DeepSpeed's checkpoint
files hold it (code that reads those files with ``torch.load(weights_only=False)``, as
Lightning's converter does, finds the class here)."""

from zerostack.checkpoint.deepspeed_read import _ZeroStageEnum as ZeroStageEnum

__all__ = ["ZeroStageEnum"]
