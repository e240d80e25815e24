"""Faults under torchrun: how long a killed or frozen rank takes to end the job, and how long the
restarted job takes to resume (restart + load of ``latest``), with ``checkpoint.auto_resume``.

    python benchmarks/faults.py                      # ~50M GPT (d 512, 16 layers), dp 2
    python benchmarks/faults.py --d-model 128 --n-layer 2 --points forward,save --out f.json

Each kill point is one ``torchrun --standalone --nproc_per_node 2 --max-restarts 1`` launch of
``tests/jobs/resume_job.py`` (the test's job: ZeRO stage 2, a checkpoint every 2 steps). On the
first attempt rank 1 SIGKILLs itself in the forward, the backward or the optimizer step of step
``--at`` + 1, or inside the next save after step ``--at`` (``save``), or SIGSTOPs itself in the
forward (``freeze``: the watchdog, ``--watchdog-timeout``, ends the live rank; torchrun's agent
kills the stopped one). The script polls the first attempt's processes (``/proc``, every 10 ms)
and prints JSON per point: seconds from the kill to the last of them ending (gone, or a zombie),
from the kill to the restarted job's processes starting, the restart's ``initialize`` with the
load (``resume_s``), the step it resumed at, whether the final weights equal those of an
uninterrupted run bit for bit, and the launch's whole wall time.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch
from _bench import emit  # benchmarks/_bench.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "jobs", "resume_job.py")


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=16)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--points", default="forward,backward,step,save,freeze")
    p.add_argument("--at", type=int, default=3, help="kill after this many optimizer steps")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--watchdog-timeout", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    p.add_argument("--out", help="also write the JSON object to this file")
    return p.parse_args(argv)


def _ended(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie: it has exited
    except FileNotFoundError:
        return True


def _watch_first_attempt(out: str, world: int, stop: threading.Event, ends: dict) -> None:
    """Record when each first-attempt rank's process ends (its pid file, then /proc)."""
    pids: dict[int, int] = {}
    while not stop.is_set():
        for r in range(world):
            path = os.path.join(out, f"pid0_{r}")
            if r not in pids and os.path.exists(path):
                text = open(path).read()
                if text:
                    pids[r] = int(text)
        for r, pid in pids.items():
            if r not in ends and _ended(pid):
                ends[r] = time.time()
        if len(ends) == world:
            return
        time.sleep(0.01)


def launch(out: str, args, extra: list[str]) -> dict:
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["--max-restarts=1", JOB, out, "--steps", str(args.steps), "--samples", "64"]
    cmd += ["--d-model", str(args.d_model), "--n-layer", str(args.n_layer)]
    cmd += ["--n-head", str(args.n_head), "--watchdog-timeout", str(args.watchdog_timeout)]
    cmd += extra
    # one store per attempt (pytorch/pytorch#135712; see tests/test_auto_resume.py)
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)  # the job imports tests.support
    ends: dict[int, float] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_first_attempt, args=(out, 2, stop, ends))
    watcher.start()
    t0 = time.time()
    proc = subprocess.Popen(
        cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        output = proc.communicate(timeout=args.timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output = proc.communicate()[0]
        return {"error": f"timed out after {args.timeout} s", "log": output[-2000:]}
    finally:
        stop.set()
        watcher.join()
    wall = time.time() - t0
    if proc.returncode != 0:
        return {"error": f"exit code {proc.returncode}", "log": output[-2000:]}
    killed = re.search(r"^KILLED (\S+) (\S+)$", output, re.M)
    res = {"wall_s": round(wall, 2)}
    if killed:
        t_kill = float(killed.group(1))
        times = json.loads(open(os.path.join(out, "times1.json")).read())
        res.update(
            kill_to_last_exit_s=round(max(ends.values()) - t_kill, 3) if len(ends) == 2 else None,
            # rank 0, the live one (rank 1 is the victim): for a freeze, the watchdog's doing
            kill_to_live_rank_exit_s=round(ends[0] - t_kill, 3) if 0 in ends else None,
            kill_to_restart_s=round(times["start"] - t_kill, 3),
            resume_s=round(times["ready"] - times["start"], 3),
            load_and_init_s=round(times["ready"] - times["init"], 3),
            resumed_at_step=times["resumed_at"],
        )
    return res


def main(args) -> dict:
    from safetensors.torch import load_file

    root = tempfile.mkdtemp(prefix="zs-faults-")
    points = [p for p in args.points.split(",") if p]
    results = {}
    try:
        ref_dir = os.path.join(root, "reference")
        results["uninterrupted"] = launch(ref_dir, args, [])
        want = load_file(os.path.join(ref_dir, "final.safetensors"))
        for point in points:
            out = os.path.join(root, point)
            at = args.at if point != "save" else (args.at // 2 + 1) * 2  # the next save
            res = launch(out, args, ["--kill", f"{point}:{at}"])
            if "error" not in res:
                got = load_file(os.path.join(out, "final.safetensors"))
                res["exact"] = all(torch.equal(got[k], want[k]) for k in want)
                res["checkpoints_left"] = sorted(
                    os.path.basename(p) for p in glob.glob(os.path.join(out, "ckpt", "*"))
                )
            results[point] = res
            print(json.dumps({point: res}), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    params = 12 * args.n_layer * args.d_model**2 + (256 + 16) * args.d_model
    out = {
        "benchmark": "faults",
        "world_size": 2,
        "zero_stage": 2,
        "approx_parameters": params,
        "d_model": args.d_model,
        "n_layer": args.n_layer,
        "kill_after_step": args.at,
        "watchdog_timeout_s": args.watchdog_timeout,
        "torch": torch.__version__,
        "cpu_cores": os.cpu_count(),
        "points": results,
    }
    return emit(out, args.out)


if __name__ == "__main__":
    main(_args())
