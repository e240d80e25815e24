"""Automatic checkpoints: the config's ``checkpoint`` block, run by the engine.

    "checkpoint": {"save_dir": "ckpt", "auto_resume": true, "save_interval": 50,
                   "keep_last": 3, "async_save": false}

- ``auto_resume``: ``initialize`` loads ``latest`` from ``save_dir`` when there is one (every
  rank agrees first whether there is), so a script restarted by ``torchrun --max-restarts N``
  continues where the last complete checkpoint left it: weights, optimizer, LR schedule, loss
  scaler, counters, and the engine loader's sampler (the next ``train_batch()``, or the next
  ``iter(loader)``, starts at the first sample the saved run had not trained on). Folders a
  killed save left (``.<tag>.incomplete``) are removed first.
- ``save_interval`` K: ``step()`` saves ``global_step<N>`` to ``save_dir`` after every K-th
  optimizer step (asynchronously with ``async_save``, :mod:`.async_save`).
- ``keep_last`` M: after a save into ``save_dir`` becomes ``latest``, only the newest M
  ``global_step<N>`` tags stay; the one ``latest`` names is never removed, other tags are never
  touched, and a tag goes by a rename (``.<tag>.deleting``) before its files are removed, so
  no half-removed folder is ever taken for a checkpoint.

The user's loop needs nothing more than ``for step in range(engine.global_steps, total)``.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil

from .state import LATEST, MANIFEST, _gather_errors
from .tags import prune

log = logging.getLogger("zerostack")

class AutoCheckpoint:
    """The engine's checkpoint policy (``engine.auto_checkpoint``): resume at ``initialize``,
    save every ``save_interval`` steps, prune, and the pending background save."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self._saver = None  # an AsyncSaver, made at the first background save

    # ------------------------------------------------------------------ saving
    def save(
        self,
        engine,
        save_dir: str,
        tag=None,
        client_state=None,
        save_latest: bool = True,
        exclude_frozen: bool = False,
        async_save: bool | None = None,
    ) -> str:
        """``engine.save_checkpoint``: in the background with ``async_save`` (None: the
        config's), else now; either waits for a pending background save first."""
        from .state import save

        keep = self.cfg.keep_last if self._is_save_dir(save_dir) else 0
        if self.cfg.async_save if async_save is None else async_save:
            if self._saver is None:
                from .async_save import AsyncSaver

                self._saver = AsyncSaver()
            return self._saver.save(
                engine, save_dir, tag, client_state, save_latest, exclude_frozen, keep
            )
        self.wait()
        path = save(engine, save_dir, tag, client_state, save_latest, exclude_frozen)
        if keep and save_latest and engine.global_rank == 0:
            prune(save_dir, keep)
        return path

    def _is_save_dir(self, save_dir: str) -> bool:
        mine = self.cfg.save_dir
        return mine is not None and os.path.abspath(save_dir) == os.path.abspath(mine)

    def wait(self) -> None:
        """Finish the pending background save; raise its error (every rank alike)."""
        if self._saver is not None:
            self._saver.wait()

    def poll(self) -> None:
        """Raise a finished background save's error without waiting."""
        if self._saver is not None:
            self._saver.poll()

    def after_step(self, engine, save: bool = True) -> None:
        """After each optimizer step (counters updated): a finished background save's error,
        and the save every ``save_interval`` steps (unless ``save`` is False: the loss_spike
        guard holds it back)."""
        self.poll()
        every = self.cfg.save_interval
        if save and every and engine.global_steps % every == 0:
            engine.save_checkpoint(self.cfg.save_dir)

    # ------------------------------------------------------------------ resuming
    def resume(self, engine) -> str | None:
        """At ``initialize`` with ``auto_resume``: load ``save_dir``'s ``latest`` if the
        directory has one (a collective); returns the loaded path, or None for a fresh start."""
        if not self.cfg.auto_resume:
            return None
        save_dir = self.cfg.save_dir
        if engine.global_rank == 0:  # what a killed save or prune left: never a checkpoint
            for stale in glob.glob(
                os.path.join(glob.escape(save_dir), ".*.incomplete")
            ) + glob.glob(os.path.join(glob.escape(save_dir), ".*.deleting")):
                shutil.rmtree(stale, ignore_errors=True)
        have = os.path.isfile(os.path.join(save_dir, LATEST))
        if not _gather_errors(engine.comm, "latest" if have else None):
            return None  # no rank sees one: a fresh start
        saved = _saved_batch(save_dir)
        path, _ = engine.load_checkpoint(save_dir)
        if engine.global_rank == 0:
            log.warning(
                "checkpoint.auto_resume: resumed from %s at step %d (saved on dp=%s with a "
                "global batch of %s; now dp=%d, global batch %d)",
                path,
                engine.global_steps,
                saved[0],
                saved[1],
                engine.dp_world_size,
                engine.train_batch_size(),
            )
        return path


def _saved_batch(save_dir: str) -> tuple[int | None, int | None]:
    """(data-parallel replicas, global batch) of the run that wrote ``latest`` (its samples
    over its steps)."""
    try:
        tag = open(os.path.join(save_dir, LATEST)).read().strip()
        manifest = json.loads(open(os.path.join(save_dir, tag, MANIFEST)).read())
        c = manifest["counters"]
        batch = c["global_samples"] // c["global_steps"] if c["global_steps"] else None
        layout = manifest["layout"]
        return layout["dp"] // layout.get("sp", 1), batch
    except (OSError, ValueError, KeyError):
        return None, None
