"""What a run has done so far, in one object: the step counters, the loss scaler and where the
engine's data loader is. A checkpoint keeps it whole (:meth:`TrainState.state_dict`, three
entries of the manifest) and a load puts it back whole (:meth:`TrainState.load_state_dict`).

The counters are DeepSpeed's: ``micro_steps`` (backward passes counted by ``step()``),
``global_steps`` (optimizer steps, skipped ones included), ``global_samples`` (the global batch
times ``global_steps``) and ``skipped_steps`` (steps a non-finite gradient norm skipped). The
engine reads and writes them under the same names (``engine.global_steps`` is this object's).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def repeat_loader(loader) -> Iterator:
    """``loader`` forever, epoch after epoch, from its sampler's epoch (a loaded checkpoint's,
    whose position the sampler keeps): DeepSpeed's ``RepeatingLoader``."""
    sampler = getattr(loader, "sampler", None)
    for epoch in itertools.count(getattr(sampler, "epoch", 0)):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        yield from loader


@dataclass
class TrainState:
    """The counters, the loss scaler (``state_dict`` / ``load_state_dict``, see
    :mod:`zerostack.core.precision`) and the engine's loader with the iterator ``train_batch()``
    reads from it."""

    loss_scaler: Any
    micro_steps: int = 0
    global_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0
    loader: Any = None  # initialize(training_data=...)'s, or set_dataloader's
    data_iter: Iterator | None = None  # the loader, repeated; made at the first read
    random_ltd: Any = None  # the token-dropping schedule (zerostack.data.token_drop), if any

    def set_loader(self, loader) -> None:
        """The loader ``train_batch()`` reads when given no iterator (a fresh iterator)."""
        self.loader, self.data_iter = loader, None

    def batches(self) -> Iterator | None:
        """The loader, repeated epoch after epoch (None without a loader)."""
        if self.data_iter is None and self.loader is not None:
            self.data_iter = repeat_loader(self.loader)
        return self.data_iter

    def sampler(self):
        """The loader's sampler if it keeps a position (``state_dict`` / ``load_state_dict``)."""
        sampler = getattr(self.loader, "sampler", None)
        return sampler if callable(getattr(sampler, "load_state_dict", None)) else None

    def counters(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in COUNTERS}

    def state_dict(self) -> dict[str, Any]:
        """The manifest's ``counters``, ``loss_scaler``, ``data_sampler`` and ``random_ltd``
        entries (rank 0's sampler: epoch and samples handed out in it; the random-LTD schedule:
        tokens kept and layer-tokens consumed; None without one)."""
        sampler, ltd = self.sampler(), self.random_ltd
        return {
            "counters": self.counters(),
            "loss_scaler": self.loss_scaler.state_dict(),
            "data_sampler": sampler.state_dict() if sampler is not None else None,
            "random_ltd": ltd.state_dict() if ltd is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Counters and loss scaler from ``state``; the loader's sampler and the random-LTD
        schedule too when both the checkpoint and this run have one (the next ``iter()`` and the
        next ``train_batch()`` continue at the first sample the saved run had not trained on)."""
        for k in COUNTERS:
            setattr(self, k, state["counters"][k])
        self.loss_scaler.load_state_dict(state["loss_scaler"])
        sampler = self.sampler()
        if sampler is not None and state.get("data_sampler") is not None:
            sampler.load_state_dict(state["data_sampler"])
            self.data_iter = None
        if self.random_ltd is not None and state.get("random_ltd") is not None:
            self.random_ltd.load_state_dict(state["random_ltd"])


class PartField:
    """``engine.<name>``: the field of that name (``attr`` when it differs) of one of the
    engine's parts (``part``: ``"state"``, the :class:`TrainState`), read and written under
    DeepSpeed's name (``engine.global_steps`` is ``engine.state.global_steps``)."""

    def __init__(self, part: str, attr: str | None = None) -> None:
        self.part, self.attr = part, attr

    def __set_name__(self, owner, name: str) -> None:
        self.attr = self.attr or name

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(getattr(obj, self.part), self.attr)

    def __set__(self, obj, value) -> None:
        setattr(getattr(obj, self.part), self.attr, value)
