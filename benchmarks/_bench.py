"""What every benchmark here shares: launching one measured run under torchrun and reading back
its JSON line, and printing (and optionally saving) the result."""

from __future__ import annotations

import json
import re
import subprocess
import sys


def torchrun(script: str, nproc: int, argv: list[str], env: dict, timeout: float,
             python: str | None = None) -> dict:
    """Run ``script`` on ``nproc`` ranks (under ``python``, by default this one); its last
    stdout line starting with ``{``, parsed, or ``{"error": ...}`` with the failing rank's own
    exception line (never raised)."""
    cmd = [python or sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", script, *_without_nproc(argv)]
    p = subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.terminate()  # torchrun passes SIGTERM on to its workers (they are in other sessions)
        p.communicate(timeout=60)
        return {"error": f"timed out after {timeout} s"}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if p.returncode == 0 and lines:
        return json.loads(lines[-1])
    # The worker's own exception line, not the summary banner torchrun prints after it.
    err = [m[1] for m in re.finditer(r"^\[rank\d+\]: (\S.*)$", stderr, re.M)]
    err = err or [ln for ln in stderr.splitlines() if ln.strip() and ln.strip()[0] not in "=-"]
    return {"error": (err or [f"exit code {p.returncode}"])[-1].strip()}


def _without_nproc(argv: list[str]) -> list[str]:
    """The child's arguments less ``--nproc``: torchrun's own parser would take it for an
    abbreviation of its ``--nproc-per-node`` even after the script (argparse matches prefixes
    before it hands the rest to the script), and the children do not need it."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def emit(out: dict, path: str | None) -> dict:
    """Print the result as one JSON line (and write it, indented, to ``path``)."""
    print(json.dumps(out), flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
    return out


def best_of_rounds(sides: list[str], repeats: int, launch) -> dict[str, dict]:
    """``launch(side)`` for each side once a round, in alternating order each round (so machine
    noise hits all alike), each result printed to stderr as it comes; per side the round with
    the lowest ``median_s`` is kept."""
    results: dict[str, dict] = {}
    for r in range(repeats):
        for side in sides if r % 2 == 0 else sides[::-1]:
            res = launch(side)
            res["side"] = side
            print(f"round {r} {side}: {json.dumps(res)}", file=sys.stderr, flush=True)
            best = results.get(side)
            if best is None or res.get("median_s", 1e9) < best.get("median_s", 1e9):
                results[side] = res
    return results


def slowest_rank(times: list[float]) -> tuple[list[float], float]:
    """Under torchrun: each step's seconds on its slowest rank (a step is as slow as that), and
    the largest peak RSS of any rank, MiB (collectives: every rank calls it)."""
    import resource

    import torch
    import torch.distributed as dist

    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss], dtype=torch.int64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    return t.tolist(), round(rss.item() / 1024, 1)  # ru_maxrss is KiB on Linux


def deepspeed_api(impl: str, root: str):
    """(deepspeed module, its ``runtime.sequence_parallel.ulysses_sp``) for one side of a
    DeepSpeed script run both ways: DeepSpeed's own (``impl == "deepspeed"``, gloo started), or
    zerostack's under DeepSpeed's names (``root``'s ``src`` put on the path when not installed)."""
    import os

    if impl == "deepspeed":
        import deepspeed
        from deepspeed.runtime.sequence_parallel import ulysses_sp

        deepspeed.init_distributed(dist_backend="gloo")
        return deepspeed, ulysses_sp
    try:
        import zerostack.compat.deepspeed as deepspeed
    except ImportError:
        sys.path.insert(0, os.path.join(root, "src"))
        import zerostack.compat.deepspeed as deepspeed
    from zerostack.compat.deepspeed.runtime.sequence_parallel import ulysses_sp

    return deepspeed, ulysses_sp


def run_side(script: str, nproc: int, argv: list[str], side: str, impl: str, peers: str,
             timeout: float) -> dict:
    """One side of a benchmark run both ways: ``script --side side`` on ``nproc`` ranks, under
    DeepSpeed's peer venv (``peers``, its python; its ninja first on PATH, as two ninjas rebuild
    its ops each time) when ``impl`` is "deepspeed", else this interpreter; a DeepSpeed side
    without the venv is ``{"skipped": ...}``."""
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    python = sys.executable
    if impl == "deepspeed":
        if not os.path.exists(peers):
            return {"skipped": f"no DeepSpeed peer venv at {peers} (../shared/PEERS.md)"}
        python = peers
        env["PATH"] = os.path.dirname(peers) + os.pathsep + env["PATH"]
    return torchrun(script, nproc, [*argv, "--side", side], env, timeout, python=python)
