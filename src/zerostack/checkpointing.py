"""DeepSpeed's name (``deepspeed.checkpointing``) for :mod:`zerostack.activation_checkpointing`.

This module replaces itself with that package in ``sys.modules``, so ``zerostack.checkpointing``
*is* the package, not a copy of its names: :func:`configure`'s state, the timers and anything set
on one (a test double of ``host_empty``) are seen through the other.
"""

import sys

from . import activation_checkpointing

sys.modules[__name__] = activation_checkpointing
