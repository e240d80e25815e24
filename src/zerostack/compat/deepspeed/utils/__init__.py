"""``deepspeed.utils``: zerostack's ``safe_get_*`` / ``safe_set_*`` (:mod:`zerostack.utils`),
the logger, and the ``groups`` and ``zero_to_fp32`` modules."""

from zerostack.utils import *  # noqa: F403
from zerostack.utils import __all__ as _zerostack_utils

from . import groups, logging, zero_to_fp32
from .logging import log_dist, logger

__all__ = [*_zerostack_utils, "groups", "log_dist", "logger", "logging", "zero_to_fp32"]
