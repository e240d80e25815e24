"""Ranks of an unmodified script, forked from a server that has already imported the libraries.

``torchrun --nproc_per_node 2 -m zerostack.as_deepspeed examples/trl_grpo.py ...`` starts a
fresh interpreter per rank, and each spends 5-7 s of CPU importing torch, zerostack,
Transformers, TRL or Lightning before the script's first line: a third of a downstream test's
time on this 2-core machine. :func:`run_script` runs the same script the same way (as
``__main__`` through :func:`zerostack.as_deepspeed.main`, with the variables torchrun gives a
rank and the rendezvous store held by the caller, as torchrun's agent holds it) in processes
forked from one server per test process, which imported those libraries once.

The server is this module run as a program: it installs the ``deepspeed`` name first (as the
runner does before a script's imports), imports what it is told, then reads one JSON request
per line (argv, environment, folder, output files) and answers with the pid it forked; when a
rank ends it writes its exit code. It has no thread, so a fork never copies a held lock. Each
rank starts a session of its own, so a run that outlives its timeout is killed whole.

Launching itself is proven elsewhere with real torchrun (tests/test_cli.py, test_launch.py,
test_auto_resume.py, test_deepspeed_name.py); ``ZEROSTACK_TEST_TORCHRUN=1`` sends these runs
through torchrun too.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid

HOST = "127.0.0.1"


# ------------------------------------------------------------------------------ the server


def _rank(request: dict) -> int:
    """In the forked child: become the rank ``request`` describes and run its script."""
    os.setsid()
    with open(os.devnull, "rb") as null:
        os.dup2(null.fileno(), 0)
    with open(request["out"], "wb") as out, open(request["err"], "wb") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    code = 1
    try:
        from zerostack.as_deepspeed import main

        code = main(request["argv"])
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if not isinstance(done.code, (int, type(None))):
            print(done.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as python would, exit 1
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
    return code


def serve(preload: list[str]) -> None:
    """Import ``preload`` (``module`` or ``module:attribute``, to load a lazy attribute), then
    fork a rank per request until stdin closes."""
    import importlib

    from zerostack.compat.deepspeed import install

    install()
    for name in preload:
        module, _, attr = name.partition(":")
        obj = importlib.import_module(module)
        if attr:
            getattr(obj, attr)
    os.write(1, b'{"ready": true}\n')
    buffer = b""
    running: set[int] = set()
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            chunk = os.read(0, 65536)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    os._exit(_rank(request))
                running.add(pid)
                os.write(1, json.dumps({"pid": pid}).encode() + b"\n")
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                os.write(1, json.dumps({"exit": pid, "code": code}).encode() + b"\n")
    for pid in running:  # stdin closed: the test process is gone
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ------------------------------------------------------------------------------ the client

PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "zerostack",
    "transformers",
    "transformers:Trainer",
    "transformers:AutoModelForCausalLM",
    "transformers:LlamaForCausalLM",
    "transformers:GPT2LMHeadModel",
    "accelerate",
    "datasets",
    "peft",
    "trl:GRPOTrainer",
    "trl:DPOTrainer",
    "trl:SFTTrainer",
    "lightning.pytorch",
    "lightning.pytorch.strategies:DeepSpeedStrategy",
]
"""What the server imports: the libraries the downstream scripts of tests/ use."""
VOLATILE = ("PYTEST_CURRENT_TEST",)
"""Variables that change from test to test and that no library reads at import: left out of
the server's environment (a rank gets them)."""


class ScriptServer:
    """One server process (started at first use, for this test process's lifetime)."""

    _lock = threading.Lock()
    _one: ScriptServer | None = None

    def __init__(self, env: dict[str, str]) -> None:
        from tests.support.ranks import ROOT

        self.env = env
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.script_server", *PRELOAD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env=env,
        )
        self._pending = b""
        if self._read(timeout=300).get("ready") is not True:
            raise RuntimeError("the script server did not start")

    @classmethod
    def get(cls, env: dict[str, str]) -> ScriptServer:
        """The server for ``env`` (the libraries read some variables once, at import: a run
        with another environment gets a server of its own)."""
        with cls._lock:
            if cls._one is None or cls._one.env != env or cls._one.proc.poll() is not None:
                if cls._one is not None:
                    cls._one.close()
                cls._one = ScriptServer(env)
            return cls._one

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the script server exited ({self.proc.wait()})")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, requests: list[dict], timeout: float) -> list[int | None]:
        """Fork one rank per request; their exit codes (None: killed at ``timeout``)."""
        pids = []
        for request in requests:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            pids.append(self._read(timeout=60)["pid"])
        codes: dict[int, int] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(codes) < len(pids):
                message = self._read(timeout=max(0.0, deadline - time.monotonic()))
                codes[message["exit"]] = message["code"]
        except TimeoutError:
            for pid in pids:
                if pid not in codes:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            while len(codes) < len(pids):  # the kills' exits, so the next run starts clean
                message = self._read(timeout=30)
                codes[message["exit"]] = None
        return [codes[p] for p in pids]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def run_script(
    argv: list[str], world: int, env: dict[str, str], timeout: float, cwd: str | None = None
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node WORLD -m zerostack.as_deepspeed *argv`` with
    ``env``, its ranks forked from the :class:`ScriptServer`: the ranks' stdout and stderr one
    after another (rank 0 first), and the worst exit code (torchrun's: the first non-zero)."""
    import torch.distributed as dist

    from tests.support.ranks import UNMARKED, refuse

    if os.environ.get(UNMARKED):
        refuse(f"run_script({' '.join(argv)}, world={world})")
    server = ScriptServer.get({k: v for k, v in env.items() if k not in VOLATILE})
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    run_id = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="zs-ranks-") as tmp:
        requests = []
        for rank in range(world):
            rank_env = {
                **env,
                "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
                "ROLE_RANK": str(rank), "ROLE_NAME": "default",
                "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(world),
                "MASTER_ADDR": HOST, "MASTER_PORT": str(store.port),
                "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": run_id,
                "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            }  # fmt: skip
            requests.append(
                {
                    "argv": list(argv),
                    "env": rank_env,
                    "cwd": cwd or os.getcwd(),
                    "out": os.path.join(tmp, f"{rank}.out"),
                    "err": os.path.join(tmp, f"{rank}.err"),
                }
            )
        codes = server.run(requests, timeout)
        outs, errs = [], []
        for request in requests:
            with open(request["out"], errors="replace") as f:
                outs.append(f.read())
            with open(request["err"], errors="replace") as f:
                errs.append(f.read())
    del store
    if any(c is None for c in codes):
        raise subprocess.TimeoutExpired(argv, timeout, "".join(outs), "".join(errs))
    code = next((c for c in codes if c != 0), 0)
    return subprocess.CompletedProcess(argv, code, "".join(outs), "".join(errs))


if __name__ == "__main__":
    serve(sys.argv[1:])
