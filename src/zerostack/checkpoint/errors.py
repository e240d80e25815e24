"""The error every checkpoint module raises (its own module: ``client_state`` and ``state``
both raise it, and ``state`` imports ``client_state``)."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded; the message names the file or key."""
