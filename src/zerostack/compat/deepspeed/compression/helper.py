"""``deepspeed.compression.helper``: where DeepSpeed-Chat imports ``recursive_getattr`` and
``recursive_setattr`` from. Deprecated in DeepSpeed 0.19.8, which warns on import (a
``FutureWarning``, as here) and serves them from ``deepspeed.utils.module_utils``."""

import warnings

from ..utils.module_utils import recursive_getattr, recursive_setattr

warnings.warn(
    "deepspeed.compression.helper is deprecated; import recursive_getattr and "
    "recursive_setattr from deepspeed.utils.module_utils instead",
    FutureWarning,
    stacklevel=2,
)

__all__ = ["recursive_getattr", "recursive_setattr"]
