"""``deepspeed.launcher.runner``: ``DEEPSPEED_ENVIRONMENT_NAME``, the file of variables the
launcher exports to every rank; ``zerostack launch`` reads the same file
(:mod:`zerostack.launcher.environment`), then ``.zerostack_env``."""

from __future__ import annotations

import os

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
"""As DeepSpeed's: ``DS_ENV_FILE``, else ``.deepspeed_env``."""

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME"]
