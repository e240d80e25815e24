"""What every collective did: :class:`CommRecord` (op, axis, bytes, seconds, step) and
:class:`CommLog`, the list of them plus the ones still in flight (which a hang report names).

``bytes`` is the size of the full (unsharded) buffer a call works on: an all-reduce of ``t``
counts ``t.nbytes``; a reduce-scatter counts its input, an all-gather its output. That is the
unit of the ZeRO paper's communication volume (stages 0-2 move 2 psi per step, stage 3 3 psi).

On NCCL a collective's ``work.wait()`` returns once the current stream waits for it, not once it
ran: the record stays in flight, "on the device", until an event recorded on the current stream
after the wait has completed (queried as each collective begins and by the watchdog's thread;
an event holds no tensor, where keeping the ``Work`` would keep its buffers). So ranks that diverge
(a data-dependent branch, MoE routing, ``generate`` with different lengths at ZeRO-3) leave a
collective that never completes, and the watchdog names it, where the host blocks later in an
unrelated read with nothing in flight.
On gloo ``wait()`` returns when the collective is done and the record closes there.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class CommRecord:
    op: str
    axis: str
    bytes: int
    seconds: float
    step: int
    seq: int = 0  # this rank's count of collectives before this one
    started: float = 0.0  # time.monotonic() when it was posted
    done: bool = True
    ranks: int = 1  # the size of the group it ran on (the n of the bandwidth formulas)
    # waited for on the host but maybe still running on the device (NCCL): a CUDA event
    # recorded on the current stream after its wait, which completes once the collective has
    event: Any = None

    @property
    def on_device(self) -> bool:
        return self.event is not None

    def describe(self) -> str:
        waiting = time.monotonic() - self.started
        state = "done" if self.done else f"waiting {waiting:.1f} s"
        if not self.done and self.on_device:
            state = f"queued on the device {waiting:.1f} s"
        where = f"{self.op} #{self.seq} on {self.axis}"
        return f"{where} ({self.bytes} bytes, step {self.step}, {state})"


def running(event) -> bool:
    """Whether the device has not yet reached ``event`` (``query()``, thread-safe)."""
    try:
        return not event.query()
    except RuntimeError:  # the device failed: its error surfaces where the work is used
        return False


class CommLog:
    """Every collective of the job: op, axis, bytes, seconds, and the optimizer step it fell in;
    and the ones posted but not yet complete (``in_flight``), which a hang report names.

    ``records`` holds the collectives of the current step and of the ``keep_steps`` steps before
    it (older ones are dropped as each step ends, so a run of any length holds a bounded log);
    ``count`` is how many were recorded since the start, the next one's ``seq``, and
    :meth:`since` returns those from a given ``seq`` on that are still held.
    ``observers`` are called with each record as it completes (the comms logger's summary).
    """

    def __init__(self, keep_steps: int = 64) -> None:
        if keep_steps < 1:
            raise ValueError(f"CommLog keep_steps must be at least 1, got {keep_steps}")
        self.records: list[CommRecord] = []
        self.count = 0
        self.keep_steps = keep_steps
        self._starts: deque[int] = deque(maxlen=keep_steps)  # seq where each kept step began
        self.step = 0
        self.in_flight: dict[int, CommRecord] = {}
        # the records left on the device, in the order their events were recorded (on one
        # stream they complete in that order): poll looks at the oldest only
        self._on_device: deque[CommRecord] = deque()
        self._polling = threading.Lock()  # the watchdog's thread polls too
        # set by a watchdog: why the job is ending, if it is (a verdict posted by some rank)
        self.explain: Callable[[], str | None] | None = None
        self.observers: list[Callable[[CommRecord], None]] = []

    def add(self, op: str, axis: str, nbytes: int, seconds: float, ranks: int = 1) -> CommRecord:
        rec = CommRecord(op, axis, int(nbytes), seconds, self.step, self.count, ranks=ranks)
        self.count += 1
        self.records.append(rec)
        return rec

    def since(self, seq: int) -> list[CommRecord]:
        """The held records from collective number ``seq`` on (e.g. ``first = log.count``
        before some work, ``log.since(first)`` after it)."""
        if not self.records:
            return []
        return self.records[max(0, seq - self.records[0].seq) :]

    def begin(self, op: str, axis: str, nbytes: int, ranks: int = 1) -> CommRecord:
        """A collective about to be posted: recorded now, in flight until :meth:`end`."""
        self.poll()  # those the device finished meanwhile leave the in-flight list
        rec = self.add(op, axis, nbytes, 0.0, ranks)
        rec.started, rec.done = time.monotonic(), False
        self.in_flight[rec.seq] = rec
        return rec

    def end(self, rec: CommRecord, event=None) -> None:
        """``rec`` was waited for (its ``seconds`` are final): shown to observers, and out of
        flight unless the device has not reached ``event`` (a CUDA event recorded after the
        wait), which :meth:`poll` then watches for."""
        if event is not None and running(event):
            rec.event = event
            self._on_device.append(rec)
        else:
            self._close(rec)
        for observe in self.observers:
            observe(rec)

    def _close(self, rec: CommRecord) -> None:
        rec.done, rec.event = True, None
        self.in_flight.pop(rec.seq, None)

    def poll(self) -> None:
        """Close the records on the device whose collectives completed, oldest first, up to the
        first still running (from any thread; a record completed behind a running one waits
        for it, which only keeps it longer)."""
        with self._polling:
            while self._on_device:
                event = self._on_device[0].event
                if event is not None and running(event):
                    return
                self._close(self._on_device.popleft())

    def failed(self, rec: CommRecord, exc: Exception) -> Exception:
        """The error to raise for a collective that failed: when a watchdog says the job is
        ending (a peer stopped answering and another rank ended the job, resetting this rank's
        connections), that verdict, so every rank names the cause; else ``exc`` itself."""
        self._close(rec)
        verdict = self.explain() if self.explain is not None else None
        if verdict is None:
            return exc
        return RuntimeError(
            f"[zerostack watchdog] the job is ending: {verdict}; this rank's {rec.op} #{rec.seq} "
            f"on {rec.axis} at step {rec.step} failed: {exc}"
        )

    def oldest_in_flight(self) -> CommRecord | None:
        self.poll()
        pending = list(self.in_flight.values())  # read from the watchdog's thread too
        return min(pending, key=lambda r: r.seq) if pending else None

    def next_step(self) -> None:
        """The step ends: later records fall in the next one, and the records of steps more
        than ``keep_steps`` back are dropped."""
        self.step += 1
        if len(self._starts) == self.keep_steps and self.records:
            drop = self._starts[0] - self.records[0].seq  # the oldest kept step's records
            del self.records[: max(0, drop)]
        self._starts.append(self.count)

    def for_step(self, step: int | None = None) -> list[CommRecord]:
        step = self.step if step is None else step
        return [r for r in self.records if r.step == step]

    def step_summary(self, step: int | None = None) -> dict[str, dict[str, float]]:
        """Calls, bytes and seconds per op (``op@axis`` keys when several axes are used)."""
        out: dict[str, dict[str, float]] = defaultdict(
            lambda: {"calls": 0, "bytes": 0, "seconds": 0.0}
        )
        for r in self.for_step(step):
            entry = out[r.op if r.axis == "dp" else f"{r.op}@{r.axis}"]
            entry["calls"] += 1
            entry["bytes"] += r.bytes
            entry["seconds"] += r.seconds
        return dict(out)

    def total_bytes(self, step: int | None = None, op: str | None = None) -> int:
        return sum(r.bytes for r in self.for_step(step) if op is None or r.op == op)

    def clear(self) -> None:
        """Drop the held records (``count`` and the records' ``seq`` go on)."""
        self.records.clear()
