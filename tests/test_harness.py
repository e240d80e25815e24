"""The test harness itself: results per rank, and failures that name the rank instead of hanging."""

from __future__ import annotations

import os
import re
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.ranks import DistributedTestError, run_distributed

pytestmark = pytest.mark.distributed  # every test here starts ranks

# Whatever goes wrong, a failing run must come back well within this (a guard against hangs).
BOUND = 60.0


def _report(rank, world, scale, *, offset=0):
    time.sleep((world - 1 - rank) * 0.3)  # higher ranks finish first
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "env": (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]),
        "threads": torch.get_num_threads(),
        "dist": (dist.get_rank(), dist.get_world_size(), dist.get_backend()),
        "sum": t.item(),
        "tensor": torch.arange(4, dtype=torch.float32) * rank * scale + offset,
        "nested": [torch.full((2, 2), rank, dtype=torch.int64)],
    }


def test_results_come_back_in_rank_order():
    world = 3
    results = run_distributed(_report, world, args=(2.0,), kwargs={"offset": 1}, timeout=60)
    assert len(results) == world
    for rank, r in enumerate(results):
        assert r["rank"] == rank
        assert r["env"] == (str(rank), str(world), str(rank))
        assert r["threads"] == 1
        assert r["dist"] == (rank, world, "gloo")
        assert r["sum"] == 6.0
        assert torch.equal(r["tensor"], torch.arange(4, dtype=torch.float32) * rank * 2.0 + 1)
        assert torch.equal(r["nested"][0], torch.full((2, 2), rank, dtype=torch.int64))


def _none(rank, world):
    return None


def test_world_of_one_and_none_results():
    assert run_distributed(_none, 1, timeout=60) == [None]


def _raises_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError(f"boom from rank {rank}")
    return rank


def test_rank_exception_names_rank_type_message_and_traceback():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raises_on_rank_one, 2, timeout=60)
    assert time.monotonic() - t0 < BOUND
    msg = str(info.value)
    assert "_raises_on_rank_one on 2 ranks failed" in msg
    assert "rank 1: ValueError: boom from rank 1" in msg
    assert "Traceback (most recent call last)" in msg
    assert 'raise ValueError(f"boom from rank {rank}")' in msg  # the failing source line
    assert "rank 0:" not in msg
    assert isinstance(info.value, AssertionError)  # pytest reports it as a test failure


def _raises_while_peer_waits(rank, world):
    if rank == 1:
        raise RuntimeError("rank 1 gave up before the all_reduce")
    dist.all_reduce(torch.ones(1))  # rank 0 waits for a partner that never comes
    return rank


def test_exception_with_a_peer_stuck_in_a_collective_is_bounded():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raises_while_peer_waits, 2, timeout=60, collective_timeout=5)
    assert time.monotonic() - t0 < BOUND
    assert "rank 1: RuntimeError: rank 1 gave up before the all_reduce" in str(info.value)


def _hangs_on_rank_one(rank, world):
    if rank == 1:
        time.sleep(120)
    return rank


def _missing_ranks(msg):
    m = re.search(r"ranks \[([\d, ]*)\] did not finish within (\d+)s", msg)
    assert m, msg
    return [int(r) for r in m.group(1).split(",")], int(m.group(2))


@pytest.mark.slow
def test_hanging_rank_fails_naming_the_missing_rank():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_hangs_on_rank_one, 2, timeout=5)
    elapsed = time.monotonic() - t0
    assert 4.5 <= elapsed < BOUND, elapsed
    msg = str(info.value)
    assert msg.startswith("_hangs_on_rank_one on 2 ranks")
    assert _missing_ranks(msg) == ([1], 5)


def _dies_on_rank_one(rank, world):
    if rank == 1:
        os._exit(3)  # no exception, no result: the process is simply gone
    return rank


@pytest.mark.slow
def test_dead_rank_fails_naming_it():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_dies_on_rank_one, 2, timeout=60)
    assert time.monotonic() - t0 < 30, "a dead rank must be noticed, not waited out"
    assert "rank 1: exited with code 3 without reporting a result" in str(info.value)


def _raises_on_zero_hangs_on_one(rank, world):
    # both past the group's set-up first: on a loaded machine rank 0 could otherwise fail and
    # tear its side down while rank 1 still connects, and rank 1 would fail instead of hanging
    dist.barrier()
    if rank == 0:
        raise KeyError("first failure")
    time.sleep(120)


@pytest.mark.slow
def test_error_and_hang_together_report_both():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raises_on_zero_hangs_on_one, 2, timeout=3)
    assert time.monotonic() - t0 < BOUND
    msg = str(info.value)
    missing, _ = _missing_ranks(msg)
    assert 1 in missing
    assert "rank 0: KeyError: 'first failure'" in msg


def _listening_socket_held_by(port: int, pid: int) -> bool | None:
    """Whether process ``pid`` holds the socket listening on ``port`` (None: no /proc here)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            return None
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    fds = f"/proc/{pid}/fd"
    return any(os.readlink(os.path.join(fds, fd)) in inodes for fd in os.listdir(fds))


def _holds_its_port(rank, world, parent):
    port = int(os.environ["MASTER_PORT"])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            grabbed = True
        except OSError:
            grabbed = False
    held = _listening_socket_held_by(port, parent)
    time.sleep(1.0)  # overlap with the other run
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return port, grabbed, held, t.item()


@pytest.mark.slow
def test_concurrent_runs_get_their_own_port_held_for_the_whole_run():
    # The parent listens on the rendezvous port from before the ranks start until the run ends,
    # so nothing else (a rank's own bind here, another run started meanwhile) can take it.
    out: dict[int, list] = {}

    def run(i):
        out[i] = run_distributed(
            _holds_its_port, 2, args=(os.getpid(),), timeout=60, collective_timeout=20
        )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(out) == [0, 1], "a run raised (see the thread's traceback above)"
    ports = set()
    for results in out.values():
        for _, grabbed, held, total in results:
            assert not grabbed and total == 3.0  # the port is busy; each run is its own world
            assert held in (True, None)  # by the parent, not by a rank that might start late
        (port,) = {r[0] for r in results}
        ports.add(port)
    assert len(ports) == 2


def test_the_cpu_census_charges_a_test_the_cpu_of_its_processes():
    """tests/support/suite_cpu.py: a subprocess's CPU counts while it runs and after it is
    reaped (half a second of it here, spun in the child)."""
    import subprocess
    import sys

    from tests.support.suite_cpu import tree_cpu

    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < {}: pass\nprint()"
    before = tree_cpu()
    subprocess.run([sys.executable, "-c", spin.format(0.5)], check=True)
    assert 0.5 <= tree_cpu() - before < 5.0  # reaped: its parent's children's time
    child = subprocess.Popen([sys.executable, "-c", spin.format(60)], stdout=subprocess.PIPE)
    try:
        time.sleep(1.0)
        live = tree_cpu()
        time.sleep(1.0)
        assert tree_cpu() - live >= 0.3  # still running: its own time, read from /proc
    finally:
        child.kill()
        child.wait()
