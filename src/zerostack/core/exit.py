"""Ending a rank at once without leaving its files behind.

The watchdog ends a rank with ``os._exit``: the training thread may be blocked in a collective
that will never finish, and the interpreter's normal exit would wait for it (or abort in gloo's
teardown). ``os._exit`` skips ``atexit``, so what a rank wrote for itself alone (its NVMe swap
files) would stay on disk. Such files register their removal here too; :func:`hard_exit` runs
every removal still pending, then ends the process.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

_PENDING: dict[int, Callable[[], object]] = {}
_LOCK = threading.Lock()


def before_hard_exit(cleanup: Callable[[], object]) -> None:
    """Run ``cleanup`` if the process ends through :func:`hard_exit` (it must be safe to call
    twice, or once from another thread: a ``weakref.finalize`` is)."""
    with _LOCK:
        _PENDING[id(cleanup)] = cleanup


def forget(cleanup: Callable[[], object]) -> None:
    """``cleanup`` already ran (the file was closed): do not keep it."""
    with _LOCK:
        _PENDING.pop(id(cleanup), None)


def hard_exit(code: int) -> None:
    """Run the pending removals (newest first; one that fails does not stop the rest), then
    ``os._exit(code)``."""
    with _LOCK:
        pending = list(_PENDING.values())[::-1]
    for cleanup in pending:
        try:
            cleanup()
        except Exception:
            pass
    os._exit(code)
