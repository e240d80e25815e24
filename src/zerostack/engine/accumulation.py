"""The accumulation window: which micro-step closes it, and backward passes that do not reduce.

A window closes on every ``gradient_accumulation_steps``-th micro-step, unless the caller has
said otherwise (DeepSpeed's ``set_gradient_accumulation_boundary``, which Hugging Face's Trainer
calls before each micro-step). Inside ``no_sync()`` backward passes accumulate on each rank
without reducing; the first backward outside it, on a boundary, reduces the sum.
"""

from __future__ import annotations

import contextlib


class Accumulation:
    """The window's length, the caller's override and whether ``no_sync`` is open."""

    def __init__(self, gas: int, stage: int) -> None:
        self.gas = gas
        self.stage = stage  # the configured ZeRO stage: 2 and 3 refuse no_sync
        self.override: bool | None = None  # set_boundary's, once called
        self.inside_no_sync = False

    def is_boundary(self, micro_steps: int) -> bool:
        """Whether the micro-step after ``micro_steps`` counted ones closes the window."""
        if self.override is not None:
            return self.override
        return (micro_steps + 1) % self.gas == 0

    def set_boundary(self, is_boundary: bool) -> None:
        """From now on, every micro-step closes a window (True) or none does (False)."""
        self.override = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients on each rank without reducing them. As in
        DeepSpeed, ZeRO stages 2 and 3 (which reduce gradients as they go, keeping only this
        rank's part) refuse it, and it does not nest."""
        if self.stage >= 2:
            raise RuntimeError(
                f"no_sync context manager is incompatible with gradient partitioning logic of "
                f"ZeRO stage {self.stage}"
            )
        if self.inside_no_sync:
            raise RuntimeError("no_sync context manager reentry is unsupported")
        self.inside_no_sync = True
        try:
            yield
        finally:
            self.inside_no_sync = False
