"""What every benchmark here shares: launching one measured run under torchrun and reading back
its JSON line, and printing (and optionally saving) the result."""

from __future__ import annotations

import json
import re
import subprocess
import sys


def torchrun(script: str, nproc: int, argv: list[str], env: dict, timeout: float) -> dict:
    """Run ``script`` on ``nproc`` ranks; its last stdout line starting with ``{``, parsed, or
    ``{"error": ...}`` with the failing rank's own exception line (never raised)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
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
