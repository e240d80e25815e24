"""CPU Adam(W) step time on one flat fp32 tensor: zerostack CPUAdam vs torch and DeepSpeed.

    python benchmarks/cpu_adam.py                                  # 50M params, 1 and 2 threads
    python benchmarks/cpu_adam.py --numel 1e6 --threads 1 --sides zerostack,torch_adamw_fused
    . .peers/bin/activate && python benchmarks/cpu_adam.py --out cpu_adam.json  # + DeepSpeed

Sides (all AdamW, lr 1e-3, weight decay 0.01, the same gradient every step):

* ``torch_adamw``: ``torch.optim.AdamW()`` with its defaults (on CPU the single-tensor loop);
* ``torch_adamw_foreach`` / ``torch_adamw_fused``: ``foreach=True`` / ``fused=True``;
* ``zerostack``: ``zerostack.optim.CPUAdam``; ``zerostack_no_bias_correction``: the same with
  ``bias_correction=False``;
* ``zerostack_copy_bf16``: CPUAdam writing the updated params to a bf16 tensor in the step
  (``step(copy_to=...)``); ``torch_adamw_fused_copy_bf16``: fused AdamW then ``bf16.copy_(p)``;
* ``deepspeed``: ``DeepSpeedCPUAdam`` when ``import deepspeed`` works here (its cpu_adam op builds
  on first use, about two minutes, outside the timing; see shared/PEERS.md), else skipped with why.

Each thread count runs in its own process (``OMP_NUM_THREADS`` and ``torch.set_num_threads``, so
DeepSpeed's OpenMP loop gets the same count). In it, rounds visit the sides in alternating order;
each visit builds the side afresh, runs ``--warmup`` steps, then times ``--steps``; per side the
round with the lowest median is kept. Prints one JSON object: per thread count and side the median
ms per step, the speedup over ``torch_adamw`` and the largest relative difference of the final
params from ``torch_adamw``'s (every side takes the same steps from the same start).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

try:
    import zerostack
except ImportError:  # e.g. the DeepSpeed peers venv: use this checkout's source
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    import zerostack
from _bench import emit  # benchmarks/_bench.py

from zerostack.optim import CPUAdam

SIDES = [
    "torch_adamw",
    "torch_adamw_foreach",
    "torch_adamw_fused",
    "zerostack",
    "zerostack_no_bias_correction",
    "zerostack_copy_bf16",
    "torch_adamw_fused_copy_bf16",
    "deepspeed",
]
BASELINE = "torch_adamw"
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=float, default=50e6, help="fp32 parameters (one flat tensor)")
    p.add_argument("--threads", default="1,2", help="comma list of thread counts, one process each")
    p.add_argument("--steps", type=int, default=10, help="timed steps per side per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="visits to every side")
    p.add_argument("--sides", default=",".join(SIDES), help="comma list, a subset of the default")
    p.add_argument("--out", help="also write the JSON object to this file")
    p.add_argument("--child-threads", type=int, help=argparse.SUPPRESS)  # set by the parent
    args = p.parse_args(argv)
    args.numel = int(args.numel)
    return args


def _deepspeed_cpu_adam():
    """DeepSpeedCPUAdam, or the reason it is unavailable (a string)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))])  # builds or loads the op
        return DeepSpeedCPUAdam
    except Exception as e:  # an ImportError, or the op failing to build
        return f"{type(e).__name__}: {e}".splitlines()[0]


def _make_side(side: str, init: torch.Tensor, grad: torch.Tensor, ds_cls):
    """(step function, the param it updates) for one fresh copy of the side."""
    p = torch.nn.Parameter(init.clone())
    p.grad = grad
    if side.startswith("torch_adamw"):
        kw = dict(foreach=True) if side == "torch_adamw_foreach" else {}
        opt = torch.optim.AdamW([p], **HYPER, **kw, **(dict(fused=True) if "fused" in side else {}))
    elif side.startswith("zerostack"):
        opt = CPUAdam([p], **HYPER, bias_correction=side != "zerostack_no_bias_correction")
    else:
        opt = ds_cls([p], **HYPER, adamw_mode=True)
    if side.endswith("copy_bf16"):
        dst = torch.empty(p.shape, dtype=torch.bfloat16)
        if isinstance(opt, CPUAdam):
            copy_to = {p: dst}
            return (lambda: opt.step(copy_to=copy_to)), p
        return (lambda: (opt.step(), dst.copy_(p.detach()))), p
    return opt.step, p


def _time_side(step, args) -> float:
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def child(args) -> dict:
    """All sides at one thread count, in this process; returns {side: result}."""
    torch.set_num_threads(args.child_threads)
    wanted = [s for s in args.sides.split(",") if s]
    ds = _deepspeed_cpu_adam() if "deepspeed" in wanted else None
    results = {}
    if isinstance(ds, str):
        results["deepspeed"] = {"skipped": ds}
        wanted.remove("deepspeed")
    g = torch.Generator().manual_seed(0)
    init = torch.randn(args.numel, generator=g)
    grad = torch.randn(args.numel, generator=g) * 1e-2
    reference = None  # torch_adamw's final params, for the numerical check
    for r in range(args.rounds):
        for side in wanted if r % 2 == 0 else wanted[::-1]:
            step, p = _make_side(side, init, grad, ds)
            ms = _time_side(step, args)
            res = results.setdefault(side, {"ms_per_step": ms, "rounds_ms": []})
            res["rounds_ms"].append(round(ms, 3))
            res["ms_per_step"] = round(min(res["ms_per_step"], ms), 3)
            if side == BASELINE and reference is None:
                reference = p.detach().clone()
            key = "max_rel_diff_vs_torch_adamw"
            if reference is not None and key not in res and side != "zerostack_no_bias_correction":
                err = ((p.detach() - reference).abs().max() / reference.abs().max()).item()
                res[key] = float(f"{err:.3g}")
            del step, p
    base = results.get(BASELINE, {}).get("ms_per_step")
    for res in results.values():
        if base and "ms_per_step" in res:
            res["speedup_vs_torch_adamw"] = round(base / res["ms_per_step"], 3)
    copy_cost = {}
    for plain, copied in [
        ("zerostack", "zerostack_copy_bf16"),
        ("torch_adamw_fused", "torch_adamw_fused_copy_bf16"),
    ]:
        if plain in results and "ms_per_step" in results.get(copied, {}):
            copy_cost[copied] = round(
                results[copied]["ms_per_step"] - results[plain]["ms_per_step"], 3
            )
    return {"threads": args.child_threads, "sides": results, "copy_out_cost_ms": copy_cost}


def _launch(args, threads: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child-threads", str(threads)]
    cmd += ["--numel", str(args.numel), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--rounds", str(args.rounds), "--sides", args.sides]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.setdefault("DS_ACCELERATOR", "cpu")
    p = subprocess.run(cmd, env=env, text=True, capture_output=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode == 0 and lines:
        return json.loads(lines[-1])
    err = [ln for ln in p.stderr.splitlines() if ln.strip()]
    return {"threads": threads, "error": (err or [f"exit code {p.returncode}"])[-1].strip()}


def _versions() -> dict:
    out = {"torch": torch.__version__, "zerostack": getattr(zerostack, "__version__", None)}
    try:
        from importlib.metadata import version

        out["deepspeed"] = version("deepspeed")
    except Exception:
        out["deepspeed"] = None
    return out


def _cpu() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        return f"{names[0]} x{len(names)}" if names else None
    except OSError:
        return None


def main(args) -> dict:
    wanted = [s for s in args.sides.split(",") if s]
    unknown = sorted(set(wanted) - set(SIDES))
    if unknown:
        sys.exit(f"--sides: unknown {unknown}; choose from {SIDES}")
    by_threads = {}
    for t in [int(x) for x in args.threads.split(",") if x]:
        by_threads[str(t)] = res = _launch(args, t)
        print(f"threads {t}: {json.dumps(res)}", file=sys.stderr, flush=True)
    out = {
        "benchmark": "cpu_adam",
        "params": args.numel,
        "hyper": HYPER,
        "steps_timed": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "cpu": _cpu(),
        "versions": _versions(),
        "by_threads": by_threads,
    }
    return emit(out, args.out)


if __name__ == "__main__":
    a = _args()
    if a.child_threads:
        print(json.dumps(child(a)), flush=True)
    else:
        main(a)
