"""The progress lines a user sees once per job (the engine's step line, the comms summary)."""

from __future__ import annotations

import logging

log = logging.getLogger("zerostack")


def print_progress(text: str) -> None:
    """A progress line, seen once whatever the logging set-up: DeepSpeed prints its step line
    to stdout on rank 0; zerostack sends it to the "zerostack" logger when logging shows that
    logger's INFO (a handler, and INFO enabled), else prints it to stdout, unless the
    "zerostack" logger's own level is set above INFO (which silences it)."""
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info(text)
    elif log.level <= logging.INFO:
        print(text, flush=True)
