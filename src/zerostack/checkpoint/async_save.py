"""Background checkpoint writes: ``engine.save_checkpoint(dir, async_save=True)`` (or the
config's ``checkpoint.async_save``).

The call copies every tensor the checkpoint holds into host memory on the training thread (the
same :func:`~.state._collect_shard` the synchronous save uses: after it returns, training may
change the parameters without changing the saved bytes) and returns; a thread then writes this
rank's file with the synchronous save's writer (:func:`~.state._write_file`: safetensors, one
sha256 per tensor), flushes it to disk and reads it back against those checksums.

The ranks agree through the job's key-value store (torch.distributed's default store: torchrun's
agent holds it, so it outlives any worker), never through a collective: a collective issued by
the writer thread on the training's process group would be matched, by order, against the
training thread's own, and a second gloo group per engine would cost a rendezvous for one bit of
news. Each rank's writer sets ``<key>/rank<r>`` to its manifest record (or its error); rank 0's
waits for all of them, then writes the manifest, renames ``.<tag>.incomplete`` into place, moves
``latest`` and prunes old tags (``checkpoint.keep_last``), and sets ``<key>/verdict``, which
every rank's writer waits for. So ``latest`` names a tag only once every rank's files are on disk
and verified; a failure anywhere leaves ``latest`` as it was and is every rank's error: raised by
the next ``save_checkpoint`` / ``load_checkpoint`` / :meth:`AsyncSaver.wait` / ``destroy`` (which
wait for the pending write first) and by ``step()`` once the verdict is in. A second save waits
for the first. The writer thread is not a daemon: the interpreter finishes a pending write
before it exits.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from ..watchdog import PREFIX as WATCHDOG_PREFIX
from ..watchdog import default_store
from .client_state import write as client_write
from .errors import CheckpointError
from .state import (
    LATEST,
    MANIFEST,
    _atomic_write,
    _barrier,
    _collect_shard,
    _manifest,
    _sha256,
    _write_file,
    merge_records,
    split_client_state,
)
from .tags import prune

log = logging.getLogger("zerostack")

WAIT_S = 600.0
"""How long a writer waits for the other ranks' writes (or rank 0's verdict) before it fails."""

_SEQ = itertools.count()  # saves in this process: every rank makes the same ones, in order


@dataclass
class _Job:
    save_dir: str
    tag: str
    folder: str
    rank: int
    world: int
    tensors: dict[str, torch.Tensor] | None
    meta: dict
    base: dict | None  # rank 0: the manifest but for the files
    save_latest: bool
    keep_last: int
    store: object | None
    key: str
    error: str | None = field(default=None)

    @property
    def final(self) -> str:
        return os.path.join(self.save_dir, self.tag)


class AsyncSaver:
    """One engine's background checkpoint writer (at most one save in flight)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._job: _Job | None = None

    @property
    def pending(self) -> bool:
        """Whether a save is still being written or agreed on."""
        return self._thread is not None and self._thread.is_alive()

    def save(
        self,
        run,
        save_dir: str,
        tag=None,
        client_state=None,
        save_latest: bool = True,
        exclude_frozen: bool = False,
        keep_last: int = 0,
    ) -> str:
        """Snapshot ``run`` to host memory and write it in the background (a collective:
        every rank calls it); returns the tag's path, complete once :meth:`wait` returns."""
        self.wait()  # one save at a time; the previous one's error is raised here
        tag = str(tag) if tag is not None else f"global_step{run.global_steps}"
        client_state, client_payload = split_client_state(run, client_state)  # copies
        rank, world = run.global_rank, run.world_size
        store = default_store() if world > 1 else None
        if world > 1 and store is None:
            raise CheckpointError("async_save: torch.distributed has no store to agree through")
        folder = os.path.join(save_dir, f".{tag}.incomplete")
        tensors, meta = _collect_shard(run, exclude_frozen)
        base = None
        if rank == 0:  # counters, scaler, schedule, sampler: as they are now
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(folder)
            record = client_write(folder, client_payload)  # small: written now, not queued
            base = json.loads(json.dumps(_manifest(run, tag, [], client_state, record)))
        _barrier(run.comm)  # the folder exists before any rank writes into it
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # the store outlives restarts
        job = _Job(
            save_dir=save_dir,
            tag=tag,
            folder=folder,
            rank=rank,
            world=world,
            tensors=tensors,
            meta=meta,
            base=base,
            save_latest=save_latest,
            keep_last=keep_last,
            store=store,
            key=f"zerostack-ckpt/{restart}/{next(_SEQ)}",
        )
        self._job = job
        self._thread = threading.Thread(target=_run, args=(job,), name="zerostack-async-save")
        self._thread.start()
        return job.final

    def wait(self) -> None:
        """Wait for the pending save; raise its error (the same on every rank), once."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def poll(self) -> None:
        """Raise the finished save's error, if any, without waiting for a pending one."""
        if not self.pending:
            self._raise()

    def _raise(self) -> None:
        job, self._job = self._job, None
        if job is not None and job.error is not None:
            raise CheckpointError(f"{job.final}: not saved ({job.error}); latest is unchanged")


def _run(job: _Job) -> None:
    """The writer thread: this rank's file, then the agreement; the outcome in ``job.error``."""
    record, error = None, None
    try:
        record = _write_file(job.folder, job.rank, job.tensors, job.meta)
        _verify(job.folder, record)
    except Exception as exc:  # every rank learns of it through the verdict
        error = f"{type(exc).__name__}: {exc}"
    job.tensors = None  # the snapshot's host memory goes now
    try:
        verdict = _agree(job, record, error)
    except Exception as exc:
        verdict = f"rank {job.rank}: {type(exc).__name__}: {exc}"
    if verdict != "ok":
        job.error = verdict
        log.error("checkpoint %s: not saved (%s)", job.final, verdict)


def _verify(folder: str, record: dict) -> None:
    """The file on disk (flushed) holds exactly the tensors whose checksums ``record`` lists."""
    path = os.path.join(folder, record["file"])
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    with safe_open(path, framework="pt") as f:
        for key, sha in record["sha256"].items():
            if _sha256(f.get_tensor(key)) != sha:
                raise CheckpointError(f"{path}: checksum mismatch in {key} after writing")


def _agree(job: _Job, record: dict | None, error: str | None) -> str:
    """Every rank's outcome through the store; rank 0 completes the checkpoint. Returns "ok" or
    the errors, naming the ranks."""
    answer = json.dumps({"error": error} if error else record)
    if job.store is None:  # a world of one
        answers = {0: answer}
    else:
        job.store.set(f"{job.key}/rank{job.rank}", answer)
        if job.rank != 0:
            return _wait(job.store, [f"{job.key}/verdict"])[0]
        answers = dict(
            enumerate(_wait(job.store, [f"{job.key}/rank{r}" for r in range(job.world)]))
        )
    records = {r: json.loads(a) for r, a in answers.items()}
    errors = [f"rank {r}: {rec['error']}" for r, rec in records.items() if "error" in rec]
    if not errors:
        try:
            _complete(job, [records[r] for r in sorted(records)])
        except Exception as exc:
            errors = [f"rank 0: {type(exc).__name__}: {exc}"]
    verdict = "; ".join(errors) or "ok"
    if errors:  # every rank has answered: nobody writes into it any more
        shutil.rmtree(job.folder, ignore_errors=True)
    if job.store is not None:
        job.store.set(f"{job.key}/verdict", verdict)
    return verdict


POLL_S = (0.02, 1.0)
"""The first and the longest pause between two looks at the store while waiting for answers:
the pause doubles, so a thousand ranks waiting on a slow writer ask the store a few times a
second each, not fifty (every look is two requests to one TCPStore)."""


def _wait(store, keys: list[str]) -> list[str]:
    """The values of ``keys`` once all are set (polled, with pauses growing from
    :data:`POLL_S`'s first to its last: the training thread keeps the GIL). Gives up when the
    watchdog has posted that the job is ending (a rank died or froze: its answer will never
    come, and this thread must not hold the process at exit)."""
    deadline = time.monotonic() + WAIT_S
    verdict = f"{WATCHDOG_PREFIX}verdict"
    pause, longest = POLL_S
    while not store.check(keys):
        if store.check([verdict]):
            raise RuntimeError(f"the job is ending ({store.get(verdict).decode()})")
        if time.monotonic() > deadline:
            missing = [k for k in keys if not store.check([k])]
            raise TimeoutError(f"no answer within {WAIT_S:g} s for {', '.join(missing)}")
        time.sleep(pause)
        pause = min(2 * pause, longest)
    return [v.decode() for v in store.multi_get(keys)]


def _complete(job: _Job, records: list[dict]) -> None:
    """Rank 0, every rank's file written and verified: the manifest, the rename, ``latest``."""
    manifest = job.base  # made with no records: merged here, once every rank has written
    manifest.update(merge_records(records))
    excluded = set(manifest["excluded"])
    manifest["aliases"] = {a: n for a, n in manifest["aliases"].items() if n not in excluded}
    manifest["files"] = records
    _atomic_write(os.path.join(job.folder, MANIFEST), json.dumps(manifest, indent=1))
    if os.path.exists(job.final):
        shutil.rmtree(job.final)
    os.replace(job.folder, job.final)
    if job.save_latest:
        _atomic_write(os.path.join(job.save_dir, LATEST), job.tag)
    if job.keep_last and job.save_latest:
        prune(job.save_dir, job.keep_last)
