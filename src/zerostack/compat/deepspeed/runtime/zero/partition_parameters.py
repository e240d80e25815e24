"""``deepspeed.runtime.zero.partition_parameters``: what Transformers' ZeRO-3 model construction
reaches into (``prevent_arange_dtype_change`` swaps ``zero_wrapper_for_fp_tensor_constructor``
and compares against ``_orig_torch_arange``), and ``ZeroParamStatus``, which TRL and OpenRLHF
compare a parameter's ``ds_status`` with.

DeepSpeed's ``zero.Init`` patches torch's tensor constructors to cast and place every new
tensor; zerostack's wraps module construction and leaves tensor constructors alone, so the
wrapper here returns the constructor as it is and nothing is ever cast.
"""

from __future__ import annotations

import torch

from zerostack.zero import GatheredParameters, Init
from zerostack.zero.stage3.module_hooks import (
    register_external_parameter,
    unregister_external_parameter,
)
from zerostack.zero.stage3.params import ZeroParamStatus

from ...accelerator import get_accelerator

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype=None, target_device=None):
    """``fn`` unchanged: zerostack's ``zero.Init`` does not patch tensor constructors."""
    return fn


__all__ = [
    "GatheredParameters",
    "Init",
    "register_external_parameter",
    "unregister_external_parameter",
    "ZeroParamStatus",
    "_orig_torch_arange",
    "get_accelerator",
    "zero_wrapper_for_fp_tensor_constructor",
]
