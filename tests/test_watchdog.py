"""The watchdog: a frozen rank (``SIGSTOP``, real processes) or ranks in different collectives
end the job within the bound, with a report that names who stopped where; the verdict logic on
its own against an in-memory store; SIGUSR1 prints the report without ending anything."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from zerostack.comm import CommLog
from zerostack.comm.grid import Handle
from zerostack.config import ConfigError, load_config
from zerostack.core.clock import Clock
from zerostack.watchdog import EXIT_CODE, PREFIX, Watchdog

from tests.support.ranks import job, job_env

JOB = job("watchdog_job.py")
TIMEOUT, INTERVAL = 2.0, 0.25  # as tests/jobs/watchdog_job.py configures the watchdog


# ------------------------------------------------------------------ the verdicts, in process
def _dog(store, rank=0, world=2, **kw) -> tuple[Watchdog, list[int]]:
    codes: list[int] = []
    log = CommLog()
    kw.setdefault("timeout", 0.3)
    dog = Watchdog(log, store, rank=rank, world=world, exit=codes.append, out=io.StringIO(), **kw)
    return dog, codes


def _beat(store, rank, beat, step=0, calls=0, waiting=None, left=False):
    body = dict(beat=beat, step=step, calls=calls, waiting=waiting, left=left)
    store.set(f"{PREFIX}hb/{rank}", json.dumps(body))


def test_a_silent_peer_is_named_with_its_last_position():
    store = dist.HashStore()
    dog, _ = _dog(store)
    dog.beats.publish()
    dog.beats.seen = {1: (-1, time.monotonic())}
    _beat(store, 1, 1, step=7, calls=152, waiting=["all_gather", 151, "dp", 0.5])
    assert dog.beats.check() is None  # it just beat
    time.sleep(0.4)
    verdict = dog.beats.check()
    assert verdict.startswith("rank 1 stopped answering (no heartbeat for more than 0.3 s")
    assert "rank 1, last heard 0.4 s ago, at step 7, after 152 collectives, in all_gather #151" in (
        verdict
    )
    assert verdict.endswith("rank 0 is at step 0, after 0 collectives, in no collective")


def test_a_peer_that_keeps_beating_is_not_stale():
    store = dist.HashStore()
    dog, _ = _dog(store)
    dog.beats.seen = {1: (-1, time.monotonic())}
    for beat in range(6):
        _beat(store, 1, beat)
        assert dog.beats.check() is None
        time.sleep(0.1)


def test_a_peer_that_left_on_purpose_is_not_stale():
    store = dist.HashStore()
    dog, _ = _dog(store)
    dog.beats.seen = {1: (-1, time.monotonic())}
    _beat(store, 1, 3, left=True)
    dog.beats.check()
    time.sleep(0.4)
    assert dog.beats.check() is None


def test_waiting_too_long_in_a_collective_lists_every_rank():
    store = dist.HashStore()
    dog, _ = _dog(store)
    dog.beats.seen = {1: (-1, time.monotonic())}
    rec = dog.log.begin("reduce_scatter", "dp", 1024)
    rec.started -= 1.0  # posted a second ago
    _beat(store, 1, 1, step=3, calls=9, waiting=["all_gather", 8, "dp", 1.0])
    verdict = dog.beats.check()
    assert verdict.startswith("rank 0 waited more than 0.3 s in reduce_scatter #0 on dp at step 0")
    assert "rank 1 at step 3, after 9 collectives, in all_gather #8 on dp" in verdict
    dog.log.end(rec)
    assert dog.beats.check() is None


def test_a_peer_that_froze_as_this_rank_began_waiting_is_named_stopped():
    """Seen on CI: rank 1 froze just as rank 0 entered a barrier, and rank 0 heard rank 1's last
    beat up to an interval late, so rank 0's wait crossed the timeout before rank 1's silence
    did. A peer that has missed two beats holds the rival verdict back until its silence is the
    timeout; a peer that beats again releases it."""
    for beats_again in (False, True):
        store = dist.HashStore()
        dog, _ = _dog(store, interval=0.05)  # timeout 0.3 s
        dog.beats.seen = {1: (-1, time.monotonic())}
        _beat(store, 1, 1, step=0, calls=15)
        assert dog.beats.check() is None  # heard now
        rec = dog.log.begin("barrier", "world", 0)
        rec.started -= 1.0  # this rank has waited past the timeout
        time.sleep(0.15)  # three intervals: rank 1 missed two beats, not yet the timeout
        if beats_again:
            _beat(store, 1, 2, step=3, calls=24, waiting=["all_gather", 23, "dp", 0.1])
            verdict = dog.beats.check()
            assert verdict.startswith("rank 0 waited more than 0.3 s in barrier #0 on world")
            continue
        assert dog.beats.check() is None
        time.sleep(0.2)
        verdict = dog.beats.check()
        assert verdict.startswith("rank 1 stopped answering (no heartbeat for more than 0.3 s")
        assert "at step 0, after 15 collectives, in no collective" in verdict


class _NcclWork:
    """An NCCL collective's Work as the host sees it: ``wait()`` returns at once (the stream
    waits, not the host)."""

    def wait(self) -> bool:
        return True


class _Event:
    """A CUDA event: ``query()`` says whether the device has reached it."""

    made: list[_Event] = []

    def __init__(self) -> None:
        self.reached = False
        _Event.made.append(self)

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.reached


@pytest.fixture
def events(monkeypatch):
    _Event.made = []
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    return _Event.made


def test_a_collective_the_device_never_completes_is_named(events):
    """NCCL: the host went on after ``wait()`` and blocks later elsewhere (the norm's read);
    the collective that never completed (a peer took another branch) stays in flight, on the
    device, and the verdict and both ranks' positions name it."""
    store = dist.HashStore()
    dog, _ = _dog(store)
    dog.beats.seen = {1: (-1, time.monotonic())}
    rec = dog.log.begin("all_reduce", "dp", 4)
    Handle(_NcclWork(), rec, dog.log, Clock(), on_device=True).wait()
    assert dog.log.in_flight == {0: rec} and rec.on_device  # the host went on
    assert dog.beats.state()["waiting"][4] is True
    rec.started -= 1.0
    _beat(store, 1, 1, step=0, calls=2, waiting=["all_reduce", 1, "dp", 1.0, True])
    verdict = dog.beats.check()
    assert verdict.startswith(
        "rank 0's all_reduce #0 on dp at step 0 has not completed on the device after 0.3 s "
        "while its peers answer"
    )
    assert (
        "rank 1 at step 0, after 2 collectives, with all_reduce #1 on dp unfinished on the "
        "device (1.0 s) when last seen"
    ) in verdict
    assert "queued on the device" in rec.describe()
    events[0].reached = True  # the device ran it: out of flight at the next look
    assert dog.beats.check() is None and dog.log.in_flight == {} and rec.event is None


def test_a_collective_done_when_waited_for_leaves_at_once(events):
    """On the CPU (gloo) a collective is done in ``wait()`` and leaves the log there; on the
    GPU it leaves once the device has reached the event behind its wait, looked at as the next
    collective begins (or by the watchdog)."""
    log = CommLog()
    for work in (None, _NcclWork()):
        rec = log.begin("all_gather", "dp", 8)
        Handle(work, rec, log, Clock()).wait()
        assert log.in_flight == {} and rec.done and rec.event is None
    assert events == []
    first = log.begin("reduce_scatter", "dp", 8)
    Handle(_NcclWork(), first, log, Clock(), on_device=True).wait()
    assert first.on_device and not first.done
    events[0].reached = True
    log.begin("all_reduce", "dp", 8)  # the next collective looks first
    assert first.done and list(log.in_flight) == [3]
    blocking = log.begin("send", "pp", 8)  # torch's blocking call: no Work, waited all the same
    Handle(None, blocking, log, Clock(), on_device=True).wait()
    assert blocking.on_device


def test_a_posted_verdict_ends_every_rank():
    store = dist.HashStore()
    dog, codes = _dog(store, interval=0.05)
    store.set(f"{PREFIX}verdict", "rank 3 stopped answering")
    dog.start()
    dog._thread.join(timeout=5)
    dog.stop()
    assert codes == [EXIT_CODE]
    assert "ending the job: rank 3 stopped answering" in dog._out.getvalue()


def test_the_verdict_and_the_traceback_reach_the_log_when_a_rank_raises(monkeypatch):
    """torch's excepthook swaps ``sys.stderr`` for a StringIO while it formats a traceback: the
    watchdog still prints into the real stream, and waits for the traceback before ending."""
    real, swapped, events = io.StringIO(), io.StringIO(), []

    def torch_like_hook(kind, value, tb):
        sys.stderr = swapped
        try:
            swapped.write(f"Traceback: {kind.__name__}: {value}\n")
            deadline = time.monotonic() + 2
            while "ending the job" not in real.getvalue() and time.monotonic() < deadline:
                time.sleep(0.01)
            if "ending the job" in real.getvalue():
                events.append("verdict printed at once")
        finally:
            sys.stderr = real
        real.write(swapped.getvalue())
        events.append("traceback printed")

    monkeypatch.setattr(sys, "stderr", real)
    monkeypatch.setattr(sys, "excepthook", torch_like_hook)
    store = dist.HashStore()
    dog = Watchdog(CommLog(), store, rank=0, world=2, timeout=60, interval=0.05,
                   exit=lambda code: events.append(code))  # fmt: skip
    dog.start()
    try:
        sys.excepthook(RuntimeError, RuntimeError("out of data"), None)
        dog._thread.join(timeout=10)
    finally:
        dog.stop()
    assert events == ["verdict printed at once", "traceback printed", EXIT_CODE]
    out = real.getvalue()
    assert "ending the job: rank 0 raised RuntimeError: out of data (at step 0)" in out
    assert "Traceback: RuntimeError: out of data" in out


def test_sigusr1_prints_the_report_and_the_job_goes_on():
    store = dist.HashStore()
    dog, codes = _dog(store, timeout=60, interval=5)
    dog.log.add("all_reduce", "dp", 64, 0.0)
    dog.start()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while "all_reduce #0 on dp" not in dog._out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "[zerostack watchdog] rank 0:   all_reduce #0 on dp (64 bytes" in dog._out.getvalue()
        assert codes == []
    finally:
        dog.stop()


def test_an_error_raised_as_the_job_ends_is_not_printed_as_its_cause(monkeypatch):
    """The watchdog ends a rank while its training goes on (a peer posted the verdict) and
    removes its swap files first: a read of a removed file raises in the training thread. That
    error is a consequence: one line says so, no traceback races the exit, the verdict stands."""
    out, events = io.StringIO(), []
    monkeypatch.setattr(sys, "excepthook", lambda *_: events.append("traceback"))
    store = dist.HashStore()
    store.set(f"{PREFIX}verdict", "rank 1 raised OSError: disk full (at step 2)")
    dog = Watchdog(CommLog(), store, rank=0, world=2, timeout=60, interval=0.05,
                   exit=events.append, out=out)  # fmt: skip
    dog.start()
    try:
        dog._thread.join(timeout=10)  # it read the posted verdict and ended the rank
        sys.excepthook(FileNotFoundError, FileNotFoundError("param0.bin"), None)
    finally:
        dog.stop()
    assert events == [EXIT_CODE]  # no traceback
    assert "ending the job: rank 1 raised OSError: disk full" in out.getvalue()
    assert "the training thread raised FileNotFoundError as the job was ending" in out.getvalue()
    assert store.get(f"{PREFIX}verdict") == b"rank 1 raised OSError: disk full (at step 2)"


def test_config_block():
    cfg = load_config({"watchdog": {"timeout": 30}})
    assert cfg.watchdog.enabled and cfg.watchdog.timeout == 30
    with pytest.raises(ConfigError, match="watchdog.timeout"):
        load_config({"watchdog": {"timeout": 0}})


# ------------------------------------------------------------------ real processes
def _launch(phase: str, world: int) -> dict:
    """Run the job on ``world`` processes around a store this test holds (as torchrun's agent
    holds it, it outlives any worker); SIGKILL whatever is left once the live ranks have ended
    (torchrun does the same after its grace period). Returns the ranks' outputs and timings."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = job_env(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        TORCHELASTIC_USE_AGENT_STORE="True",  # every rank joins this store as a client
    )
    procs = []
    for r in range(world):
        env_r = dict(env, RANK=str(r), LOCAL_RANK=str(r))
        procs.append(
            subprocess.Popen(
                [sys.executable, JOB, phase],
                env=env_r,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    victim = procs[1]
    live = [p for i, p in enumerate(procs) if i != 1]
    ended: dict[int, float] = {}
    deadline = time.monotonic() + 120
    try:
        while len(ended) < len(procs) and time.monotonic() < deadline:
            for p in procs:  # the stopped one too: the rank that names it kills it
                if p.pid not in ended and p.poll() is not None:
                    ended[p.pid] = time.time()
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        outs = [p.communicate(timeout=30)[0] for p in procs]
        del store
    return {
        "outs": outs,
        "codes": [p.returncode for p in procs],
        "ended": [ended.get(p.pid) for p in live],
        "victim_code": victim.returncode,
        "victim_ended": ended.get(victim.pid),
    }


def _frozen_at(out: str) -> float:
    line = next(ln for ln in out.splitlines() if ln.startswith("FROZE "))
    return float(line.split()[1])


@pytest.mark.distributed
@pytest.mark.parametrize(
    "phase, world, waiting",
    [
        ("forward", 2, "all_gather"),  # stage 3: rank 0 gathers the next block's weights
        ("backward", 2, "reduce_scatter"),  # stage 3: the gradients of the last block done
        ("step", 2, "all_reduce"),  # the optimizer step's gradient norm
        ("checkpoint", 2, None),  # a collective of save_checkpoint
        ("pipeline", 4, None),  # pp 2 x dp 2: a send/recv or the dp reduction
    ],
)
@pytest.mark.slow
def test_a_frozen_rank_ends_the_job_within_the_bound(phase, world, waiting):
    got = _launch(phase, world)
    frozen = _frozen_at(got["outs"][1])
    live_outs = [o for i, o in enumerate(got["outs"]) if i != 1]
    for code, out, ended in zip(
        [c for i, c in enumerate(got["codes"]) if i != 1], live_outs, got["ended"], strict=True
    ):
        # the watchdog's exit, or gloo's error once a peer's exit reset the connection: then
        # the error carries the verdict
        assert code == EXIT_CODE or "[zerostack watchdog] the job is ending" in out, out[-3000:]
        assert code != 0 and "FINISHED" not in out
        # every live rank names the frozen one; the bound: the timeout, a few rounds of checks
        # (the verdict reached, posted, seen) and the exit, plus slack for a 2-core machine
        # running other tests (the watchdog thread waits for a core like everything else); the
        # alternative is the process group's 30 minutes
        assert "rank 1 stopped answering" in out, out[-3000:]
        assert ended - frozen < TIMEOUT + 4 * INTERVAL + 6.0, (ended - frozen, out[-2000:])
    # the rank that saw it says where it was itself: in a collective it could not finish
    verdict = next(ln for o in live_outs for ln in o.splitlines() if "seen by rank" in ln)
    own = verdict.split("; rank ")[-1]  # "R is at step S, after N collectives, in OP #K on AXIS"
    assert " (waiting " in own, verdict
    if waiting is not None:
        assert f", in {waiting} #" in own, verdict
    # the stopped rank itself is killed by the rank that named it (same host), within the bound
    assert got["victim_code"] == -signal.SIGKILL
    assert any("killed stopped rank 1 (pid " in o for o in live_outs), live_outs[0][-2000:]
    assert got["victim_ended"] - frozen < TIMEOUT + 4 * INTERVAL + 6.0


@pytest.mark.distributed
@pytest.mark.slow
def test_ranks_in_different_collectives_are_reported_and_end():
    """Rank 1 skips a forward: the ranks wait in different collectives; each report lists both
    positions, and the job ends."""
    got = _launch("skip", 2)
    outs = got["outs"]
    # the job ends: the rank that reached the verdict with the watchdog's code, the other with
    # it too or, when its peer's exit reset the connection first, with gloo's error
    assert all(c not in (0, None) for c in got["codes"]), [o[-2000:] for o in outs]
    verdicts = [ln for o in outs for ln in o.splitlines() if "ending the job:" in ln]
    assert verdicts, [o[-2000:] for o in outs]
    first = verdicts[0]
    assert "waited more than 2 s in" in first, first
    # both positions, this rank's and its peer's, in one line
    waiter = int(first.split("ending the job: rank ")[1].split()[0])
    assert f"rank {waiter} waited more than 2 s in " in first
    assert f"rank {1 - waiter} at step " in first, first


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_that_raises_is_named_by_every_rank():
    """Rank 1 raises: it ends with its traceback, and rank 0 names rank 1, its exception and its
    step, whether its watchdog reads the posted verdict first or its collective fails first (as
    rank 1's process exits) and raises it."""
    got = _launch("raise", 2)
    outs = got["outs"]
    assert all(c not in (0, None) for c in got["codes"]), [o[-2000:] for o in outs]
    assert "RuntimeError: rank 1 ran out of data" in outs[1]
    named = "rank 1 raised RuntimeError: rank 1 ran out of data (at step 2)"
    assert named in outs[0], outs[0][-3000:]
    assert not any("terminate called" in o for o in outs)


def test_sigusr1_is_heard_above_descriptor_1023_and_stop_closes_what_it_opened():
    """A long job holds many descriptors (groups' sockets, files): the watchdog's wake socket
    numbered past select()'s limit of 1024 still hears SIGUSR1, and stop() closes it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 2048)), hard))
    held = []
    try:
        while True:  # until the next descriptor is past 1023
            fd = os.open(os.devnull, os.O_RDONLY)
            held.append(fd)
            if fd >= 1030:
                break
        store = dist.HashStore()
        dog, codes = _dog(store, timeout=60, interval=0.05)
        dog.log.add("all_reduce", "dp", 64, 0.0)
        dog.start()
        sockets = (dog._wake_r, dog._wake_w)
        assert sockets[0].fileno() > 1023
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while "all_reduce #0 on dp" not in dog._out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dog._thread.is_alive()
        assert "all_reduce #0 on dp" in dog._out.getvalue()
        dog.stop()
        assert [s.fileno() for s in sockets] == [-1, -1]  # closed (not left to the collector)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_stop_returns_at_once():
    """engine.destroy() stops the watchdog: it must not sit out an interval (10 s by default)."""
    dog, _ = _dog(dist.HashStore(), timeout=120, interval=5)
    dog.start()
    t0 = time.monotonic()
    dog.stop()
    assert time.monotonic() - t0 < 2.0


def test_a_failed_collective_carries_the_posted_verdict():
    """A rank whose collective fails because a peer ended the job (connection reset) raises the
    verdict, so its log names the cause too; without a verdict the error is gloo's own."""
    store = dist.HashStore()
    dog, _ = _dog(store)
    dog.log.explain = dog.beats.posted_verdict
    rec = dog.log.begin("all_gather", "dp", 64)
    plain = RuntimeError("Connection reset by peer")
    assert dog.log.failed(rec, plain) is plain
    store.set(f"{PREFIX}verdict", "rank 1 stopped answering")
    rec = dog.log.begin("all_gather", "dp", 64)
    err = dog.log.failed(rec, plain)
    assert str(err) == (
        "[zerostack watchdog] the job is ending: rank 1 stopped answering; this rank's "
        "all_gather #1 on dp at step 0 failed: Connection reset by peer"
    )
    assert dog.log.in_flight == {}


def test_a_rank_ended_by_an_exception_exits_with_it_not_an_abort():
    """The watchdog thread, inside a store call as the interpreter finalises, must not take the
    process down with std::terminate ("terminate called without an active exception", exit
    -6): it is stopped before. Without that, 22 of 30 runs of this job aborted here; each of
    four runs must end by its exception (code 1), or by the watchdog acting on the exception it
    posted once the traceback is out (75: a rank whose non-daemon threads outlive the exception
    still ends). The abort is a race; its cause is not: a fifth run, ended by ``sys.exit(3)``,
    reports from an exit handler that runs after the watchdog's that the thread is gone."""
    runs = [
        subprocess.Popen(
            [sys.executable, job("watchdog_exit_job.py"), *args],
            env=job_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for args in ([], [], [], [], ["exit"])
    ]
    *raised, exited = runs
    out = exited.communicate(timeout=120)[0]
    assert exited.returncode == 3, (exited.returncode, out[-2000:])
    assert "watchdog thread alive at exit: False" in out, out[-2000:]
    for run in raised:
        out = run.communicate(timeout=120)[0]
        assert "terminate called" not in out, out[-2000:]
        assert run.returncode in (1, EXIT_CODE), (run.returncode, out[-2000:])
        assert "RuntimeError: rank 0 ran out of data" in out, out[-2000:]
