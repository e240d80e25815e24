"""The ``torch_autocast`` block (DeepSpeed 0.16+)."""

from .base import _Model
from .zero import DtypeName


class TorchAutocastConfig(_Model):
    """The ``torch_autocast`` block (DeepSpeed 0.16+): the engine's forward runs under
    ``torch.autocast`` in ``dtype``, beside the bf16 block or fp32 weights
    (:func:`zerostack.core.precision.forward_autocast`; which combinations are served: see
    :func:`zerostack.validate.validate`)."""

    enabled: bool = False
    """Run forward under ``torch.autocast``."""
    dtype: DtypeName | None = None
    """The autocast dtype (DeepSpeed's spellings: ``torch.bfloat16``, ``bf16``, ...); None:
    torch's default for the device (bf16 on CPU, fp16 on CUDA)."""
    lower_precision_safe_modules: list[str] | None = None
    """Module classes (``"package.Class"``) whose gradients DeepSpeed reduces in ``dtype``
    (None: Linear and Conv1d/2d/3d); each must import. Where zerostack serves autocast, those
    gradients are reduced in ``dtype`` already (the bf16 block) or not at all (stage 0)."""
