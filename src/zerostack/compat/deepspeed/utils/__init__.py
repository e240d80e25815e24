"""``deepspeed.utils``: zerostack's ``safe_get_*`` / ``safe_set_*`` (:mod:`zerostack.utils`),
ZeRO-3's leaf-module flags (:mod:`zerostack.zero.stage3.leaves`), the logger,
``RepeatingLoader``, and the ``groups`` and ``zero_to_fp32`` modules."""

from zerostack.utils import *  # noqa: F403
from zerostack.utils import __all__ as _zerostack_utils
from zerostack.zero.stage3.leaves import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

from ..runtime.dataloader import RepeatingLoader
from . import groups, logging, zero_to_fp32
from .logging import log_dist, logger

__all__ = [
    *_zerostack_utils,
    "RepeatingLoader",
    "get_z3_leaf_modules",
    "groups",
    "log_dist",
    "logger",
    "logging",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
    "zero_to_fp32",
]
