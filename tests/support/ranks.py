"""Run a test function on N real gloo ranks on 127.0.0.1, and bring back results or failures.

    def _check(rank, world, x):          # module level, so it can be pickled
        ...
        return something_picklable

    results = run_distributed(_check, world=2, args=(x,))   # one result per rank

Ranks are forked from a fork server that has already imported torch (a fresh interpreter per rank
would pay the import each time), each with ``OMP_NUM_THREADS=1`` since the suite runs on few cores.
The parent holds the rendezvous: it listens on a port the OS picks (a ``TCPStore`` master on port
0) until the run ends, and the ranks join that store, so two runs at once (``pytest -n``, another
checkout) can never be handed the same port.
A rank's exception fails the test with that rank's traceback; a run that outlives ``timeout``
fails with the ranks that had not finished, instead of hanging the suite. Collectives inside carry
their own timeout (``collective_timeout``) so a mismatched collective errors out in the rank.

Ranks also run as processes of their own: a script in tests/jobs (:func:`job`, :func:`job_env`)
under torchrun, the zerostack launcher, or a plain interpreter given a rank's variables. A test
that starts ranks either way carries ``@pytest.mark.distributed``; tests/conftest.py refuses
them to any other test (:func:`starts_ranks`, :data:`UNMARKED`), so ``pytest -m "not
distributed"`` is the in-process tests.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import subprocess
import threading
import time
import traceback
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")

HOST = "127.0.0.1"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UNMARKED = "ZEROSTACK_TEST_NOT_DISTRIBUTED"
"""Set (to the test's id) by tests/conftest.py while a test without the ``distributed`` marker
runs: :func:`run_distributed` then refuses to start ranks, in that test's process or any it
starts."""
_CTX = None
_CTX_LOCK = threading.Lock()


def _context():
    global _CTX
    with _CTX_LOCK:
        if _CTX is None:
            _CTX = mp.get_context("forkserver")
            # torch._dynamo: torch.optim imports it at the first optimizer, seconds per rank
            _CTX.set_forkserver_preload(
                ["torch", "torch._dynamo", "torch.distributed", "zerostack"]
            )
    return _CTX


def _worker(fn, rank, world, port, args, kwargs, results, collective_timeout):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    results_ok = False
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR=HOST,
        MASTER_PORT=str(port),
    )
    try:
        timeout = timedelta(seconds=collective_timeout)
        store = dist.TCPStore(HOST, port, world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        out = fn(rank, world, *args, **kwargs)
        # Plain pickle: torch's multiprocessing reductions would pass tensors as shared-memory
        # handles that die with this process.
        results.put((rank, "ok", pickle.dumps(out)))
        results_ok = True
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            from zerostack.world import shutdown

            try:  # after a success, tear down together (see zerostack.world.shutdown)
                if results_ok:
                    shutdown()
                else:
                    dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


class DistributedTestError(AssertionError):
    pass


def run_distributed(
    fn,
    world: int,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float = 180.0,
    collective_timeout: float = 60.0,
) -> list:
    """Run ``fn(rank, world, *args, **kwargs)`` on ``world`` gloo ranks; return their results."""
    import torch.distributed as dist

    if os.environ.get(UNMARKED):
        refuse(f"run_distributed({fn.__name__}, world={world})")

    ctx = _context()
    results = ctx.Queue()
    # The listening socket stays open (held by this process) until the run ends.
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, r, world, port, args, kwargs or {}, results, collective_timeout),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    dead_since: dict[int, float] = {}
    try:
        while len(out) + len(errors) < world:
            now = time.monotonic()
            if now > deadline:
                missing = sorted(set(range(world)) - set(out) - set(errors))
                raise DistributedTestError(
                    f"{fn.__name__} on {world} ranks: ranks {missing} did not finish within "
                    f"{timeout:.0f}s" + "".join(f"\n--- rank {r}: {e}" for r, e in errors.items())
                )
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue.Empty:
                # A rank that died without reporting (segfault, os._exit) would otherwise cost
                # the whole timeout; give its last message a moment to arrive, then report it.
                for r, p in enumerate(procs):
                    if r in out or r in errors or p.is_alive():
                        continue
                    if now - dead_since.setdefault(r, now) > 2.0:
                        errors[r] = f"exited with code {p.exitcode} without reporting a result"
                continue
            if status == "ok":
                out[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                # The other ranks are probably blocked in a collective until their collective
                # timeout; wait for them that long at most, then report what we have.
                deadline = min(deadline, time.monotonic() + collective_timeout + 10)
    finally:
        for p in procs:
            if len(out) == world:  # all succeeded: let them tear their process group down
                p.join(timeout=5)
            if p.is_alive():  # a failed run: a rank still running would wait on the others
                p.kill()
                p.join()
        del store  # closes the port, after every rank is gone
    if errors:
        lines = [f"rank {r}: {e}" for r, e in sorted(errors.items())]
        raise DistributedTestError(f"{fn.__name__} on {world} ranks failed:\n" + "\n".join(lines))
    return [out[r] for r in range(world)]


def refuse(what: str) -> None:
    """Fail the running test (named by :data:`UNMARKED`), which starts ranks unmarked."""
    import pytest

    pytest.fail(
        f"{os.environ.get(UNMARKED)} starts ranks ({what}) but is not marked "
        "@pytest.mark.distributed",
        pytrace=False,
    )


def starts_ranks(cmd, env: dict | None) -> bool:
    """Whether command ``cmd`` (argv, or a shell string) started with ``env`` starts ranks: it
    is torchrun, the zerostack launcher or ``zerostack train`` (both start torchrun), or it is
    given a rank's variables (``WORLD_SIZE``, or Open MPI's ``OMPI_COMM_WORLD_SIZE``)."""
    names = {os.path.basename(w) for w in argv(cmd)}
    if names & {"torch.distributed.run", "torchrun", "zerostack.launcher"}:
        return True
    if names & {"zerostack", "zerostack.cli"} and names & {"train", "launch"}:
        return True
    return bool(env) and bool({"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"} & set(env))


def argv(cmd) -> list[str]:
    """A command as ``subprocess`` takes it (a list of str or paths, or one string) as words."""
    if isinstance(cmd, (str, bytes, os.PathLike)):
        return os.fsdecode(cmd).split()
    return [os.fsdecode(w) for w in cmd]


def job(name: str) -> str:
    """The path of ``tests/jobs/<name>``, a script run as a rank."""
    return os.path.join(ROOT, "tests", "jobs", name)


def job_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (``os.environ`` by default) for a rank process: the checkout's root first on
    ``PYTHONPATH`` (a job runs as a file, and imports ``tests.support``), one OpenMP thread,
    and ``extra``."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def session(cmd: list[str], env: dict):
    """``cmd`` started in a session of its own (its whole tree can be killed as one), its
    stdout and stderr together, as text."""
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
