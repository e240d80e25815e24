"""Heartbeats and the verdicts drawn from them, for :mod:`zerostack.watchdog`.

Each rank publishes a heartbeat in the job's key-value store: a counter, its step, the collective
it waits in (from its :class:`~zerostack.comm.CommLog`), its host, pid and process start time.
:meth:`Heartbeats.check` reads every peer's and gives one of two verdicts, or none:

* a peer's counter has not moved for ``timeout`` seconds (on this rank's clock): it stopped
  answering; its last heartbeat says at which step and in which collective;
* this rank has waited ``timeout`` seconds in one collective while every peer still beats: the
  ranks are in different collectives (a skipped forward, a rank-dependent branch), or one is
  computing for too long; every rank's position is listed, so a mismatch shows. A peer that has
  missed two beats holds this verdict back until its own silence reaches ``timeout``: a rank
  that froze as this one began waiting is named as stopped, not as being elsewhere. On NCCL the
  host does not wait in the collective itself: its record stays in flight "on the device" until
  the collective completes (:mod:`zerostack.comm.records`), so the verdict names it too when the
  host blocks later in an unrelated read (the norm's, a user's ``.item()``).

A verdict some rank posted (``PREFIX + "verdict"``) comes first. Nothing here runs a thread,
ends a process or touches a signal: the watchdog does, on these answers.
"""

from __future__ import annotations

import json
import os
import socket
import time

from ..comm import CommLog

PREFIX = "zerostack/watchdog/"


class Heartbeats:
    """This rank's heartbeat in ``store`` and its reading of the ``world - 1`` others'."""

    def __init__(
        self, log: CommLog, store, *, rank: int, world: int, timeout: float, interval: float
    ) -> None:
        self.log, self.store, self.rank, self.world = log, store, rank, world
        self.timeout, self.interval = timeout, interval
        self.beat = 0
        self.seen: dict[int, tuple[int, float]] = {}  # peer -> (its counter, when it changed)
        self.peers: dict[int, dict] = {}  # peer -> its last heartbeat
        self.stale: list[int] = []  # the peers the last check found silent
        self.process = {"host": socket.gethostname(), "pid": os.getpid(), "start": started()}

    def start(self) -> None:
        """Publish the first beat; every peer counts as heard now."""
        self.publish()
        now = time.monotonic()
        self.seen = {r: (-1, now) for r in range(self.world) if r != self.rank}

    def state(self) -> dict:
        """This rank's position: step, collectives so far, the one it waits in."""
        pending = self.log.oldest_in_flight()
        waiting = None
        if pending is not None:
            waited = time.monotonic() - pending.started
            waiting = [pending.op, pending.seq, pending.axis, waited, pending.on_device]
        return {
            "beat": self.beat,
            "step": self.log.step,
            "calls": self.log.count,
            "waiting": waiting,
        }

    def publish(self, left: bool = False) -> None:
        self.beat += 1
        body = self.state()
        body["left"] = left
        body.update(self.process)
        self.store.set(f"{PREFIX}hb/{self.rank}", json.dumps(body))

    def read_peers(self) -> None:
        """Every peer's last heartbeat: one round trip to the store once all have beaten (a
        ``multi_get``), not one or two per peer; until then, those that have."""
        now = time.monotonic()
        ranks = list(self.seen)
        keys = [f"{PREFIX}hb/{r}" for r in ranks]
        if self.store.check(keys):
            got = dict(zip(ranks, self.store.multi_get(keys), strict=True))
        else:  # some have not started yet: stale from this rank's start on
            pairs = zip(ranks, keys, strict=True)
            got = {r: self.store.get(k) for r, k in pairs if self.store.check([k])}
        for r, raw in got.items():
            body = json.loads(raw)
            self.peers[r] = body
            if body["beat"] != self.seen[r][0]:
                self.seen[r] = (body["beat"], now)

    # ------------------------------------------------------------------ verdicts
    def posted_verdict(self) -> str | None:
        """The verdict some rank posted, if any (for a collective that failed meanwhile)."""
        key = f"{PREFIX}verdict"
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except Exception:
            return None

    def check(self) -> str | None:
        """A verdict if the job must end now, else None (reads the store; one round)."""
        key = f"{PREFIX}verdict"
        if self.store.check([key]):
            return self.store.get(key).decode()
        self.read_peers()
        now = time.monotonic()
        # how long each peer has been silent (one that left on purpose is not)
        silent = {
            r: now - when
            for r, (_, when) in self.seen.items()
            if not self.peers.get(r, {}).get("left")
        }
        stale = [r for r, quiet_for in silent.items() if quiet_for > self.timeout]
        self.stale = stale
        if stale:
            names = "; ".join(
                f"rank {r}, last heard {now - self.seen[r][1]:.1f} s ago, {self.position(r)}"
                for r in stale
            )
            return (
                f"rank {stale[0]} stopped answering (no heartbeat for more than "
                f"{self.timeout:g} s, seen by rank {self.rank}): {names}; rank {self.rank} is "
                f"{self.own_position()}"
            )
        # a peer that has missed two beats may be the one that stopped: its silence crosses the
        # timeout within ``timeout`` of this rank's wait (it froze as this rank began waiting, and
        # this rank heard its last beat up to an interval late), so the stale verdict names it
        # then; the rival verdict waits for that, or for the peer's next beat
        quiet = any(quiet_for > 2 * self.interval for quiet_for in silent.values())
        pending = self.log.oldest_in_flight()
        if pending is not None and now - pending.started > self.timeout and not quiet:
            others = "; ".join(f"rank {r} {self.position(r)}" for r in sorted(self.peers))
            what = f"{pending.op} #{pending.seq} on {pending.axis} at step {pending.step}"
            if pending.on_device:  # NCCL: the host went on, the collective never completed
                head = (
                    f"rank {self.rank}'s {what} has not completed on the device after "
                    f"{self.timeout:g} s"
                )
            else:
                head = f"rank {self.rank} waited more than {self.timeout:g} s in {what}"
            return (
                f"{head} while its peers answer (ranks in different collectives, or one "
                f"computing too long): {others}"
            )
        return None

    def own_position(self) -> str:
        pending = self.log.oldest_in_flight()
        where = f"at step {self.log.step}, after {self.log.count} collectives"
        if pending is None:
            return where + ", in no collective"
        waited = time.monotonic() - pending.started
        return where + _pending(pending.op, pending.seq, pending.axis, pending.on_device, waited)

    def position(self, r: int) -> str:
        body = self.peers.get(r)
        if body is None:
            return "(never beat)"
        where = f"at step {body['step']}, after {body['calls']} collectives"
        if body["waiting"]:
            op, seq, axis, waited, *device = body["waiting"]
            where += _pending(op, seq, axis, bool(device and device[0]), waited)
            where += " when last seen"
        else:
            where += ", in no collective"
        return where

    def report(self, history: int) -> str:
        """This rank's position and its last ``history`` collectives, one per line."""
        lines = [f"[zerostack watchdog] rank {self.rank}: step {self.log.step}"]
        recent = self.log.records[-history:]
        lines += [f"[zerostack watchdog] rank {self.rank}:   {r.describe()}" for r in recent]
        return "\n".join(lines)


def _pending(op: str, seq: int, axis: str, on_device: bool, waited: float) -> str:
    """A position's pending collective: the one the host waits in, or one the host went on
    from that the device (NCCL) has not completed."""
    if on_device:
        return f", with {op} #{seq} on {axis} unfinished on the device ({waited:.1f} s)"
    return f", in {op} #{seq} on {axis} (waiting {waited:.1f} s)"


def started(pid: int | str = "self") -> int | None:
    """A process's start time in clock ticks since boot (Linux), to tell it from a later process
    given the same pid; None where /proc is not there."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None
