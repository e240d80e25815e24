"""The engine's checkpoints, and the automatic ones: the config's ``checkpoint`` block.

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

from ..core.run import Run
from ..core.steps import StepReport
from .state import LATEST, MANIFEST, _gather_errors
from .tags import prune

log = logging.getLogger("zerostack")


class Checkpointer:
    """The engine's checkpoints (``engine.checkpoints``), given the run's parts (a
    :class:`~..core.run.Run`, not the engine): saves now or in the background, loads, and
    the config's ``checkpoint`` block: resume at ``initialize``, save every ``save_interval``
    steps (:meth:`after_step`, a step callback), prune."""

    def __init__(self, run: Run, cfg) -> None:
        self.run, self.cfg = run, cfg
        self._saver = None  # an AsyncSaver, made at the first background save

    # ------------------------------------------------------------------ saving
    def save(
        self,
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
                self.run, save_dir, tag, client_state, save_latest, exclude_frozen, keep
            )
        self.wait()
        path = save(self.run, save_dir, tag, client_state, save_latest, exclude_frozen)
        if keep and save_latest and self.run.global_rank == 0:
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

    def after_step(self, report: StepReport) -> None:
        """After each optimizer step (counters updated): a finished background save's error,
        and the save every ``save_interval`` steps (unless the loss-spike guard holds it back:
        ``report.hold_save``)."""
        self.poll()
        every = self.cfg.save_interval
        if not report.hold_save and every and report.step % every == 0:
            self.save(self.cfg.save_dir)

    # ------------------------------------------------------------------ loading
    def load(self, load_dir: str, tag=None, **options):
        """``engine.load_checkpoint`` (:func:`.restore.load`), once a pending background save
        has completed."""
        from .restore import load

        self.wait()
        return load(self.run, load_dir, tag, **options)

    def resume(self) -> str | None:
        """At ``initialize`` with ``auto_resume``: load ``save_dir``'s ``latest`` if the
        directory has one (a collective); returns the loaded path, or None for a fresh start."""
        if not self.cfg.auto_resume:
            return None
        save_dir, run = self.cfg.save_dir, self.run
        if run.global_rank == 0:  # what a killed save or prune left: never a checkpoint
            for stale in glob.glob(
                os.path.join(glob.escape(save_dir), ".*.incomplete")
            ) + glob.glob(os.path.join(glob.escape(save_dir), ".*.deleting")):
                shutil.rmtree(stale, ignore_errors=True)
        have = os.path.isfile(os.path.join(save_dir, LATEST))
        if not _gather_errors(run.comm, "latest" if have else None):
            return None  # no rank sees one: a fresh start
        saved = _saved_batch(save_dir)
        path, _ = self.load(save_dir)
        if run.global_rank == 0:
            log.warning(
                "checkpoint.auto_resume: resumed from %s at step %d (saved on dp=%s with a "
                "global batch of %s; now dp=%d, global batch %d)",
                path,
                run.global_steps,
                saved[0],
                saved[1],
                run.topology.data_parallel_size,
                run.config["train_batch_size"],
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
