"""Tokens per second, compiled against eager: ``engine.compile()`` at ZeRO stages 0 and 3.

    python benchmarks/compile.py                 # GPT 8L d512 (25M), 2 ranks, inductor, 3 rounds
    python benchmarks/compile.py --n-layer 2 --d-model 128 --repeats 1 --backend aot_eager

Each side is one torchrun launch of 2 ranks training the reference GPT with the same batches
(``benchmarks/zero.py``'s model, batches and config: AdamW, clipping at 1.0), eager or after
``engine.compile(backend=...)`` (block by block: ``zerostack.engine.compiling``). The warm-up steps
include the compilation, whose seconds are reported apart (the first step's time); the timed
steps after it must compile nothing (``graphs_after_warmup`` is 0). Rounds visit the sides in
alternating order; per side the round with the lowest median is kept. Prints per side the median
step time, tokens per second over the 2 ranks and peak RSS, and each compiled side's ratio to its
eager side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

try:
    import zerostack
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    import zerostack
from _bench import best_of_rounds, emit, slowest_rank, torchrun  # benchmarks/_bench.py
from zero import _batch, _config, _ds_config  # benchmarks/zero.py

from zerostack.models import GPT

SIDES = [f"stage{s}_{mode}" for s in (0, 3) for mode in ("eager", "compiled")]


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=3, help="steps before timing (compile included)")
    p.add_argument("--repeats", type=int, default=3, help="rounds over all sides")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--sides", default=",".join(SIDES), help="comma list, a subset of the default")
    p.add_argument("--out", help="also write the JSON object to this file")
    p.add_argument("--side-timeout", type=float, default=1800, help="seconds per side launch")
    p.add_argument("--side", help=argparse.SUPPRESS)  # set by the parent for one child launch
    args = p.parse_args(argv)
    args.zero_extra = {}  # what benchmarks/zero.py's _ds_config reads
    return args


def run_side(args) -> None:
    side = args.side
    stage, compiled = int(side[5]), side.endswith("_compiled")
    zerostack.init_distributed("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    engine, *_ = zerostack.initialize(model=GPT(_config(args)), config=_ds_config(args, stage))
    if compiled:
        engine.compile(backend=args.backend)
    times, graphs = [], []
    for i in range(args.warmup + args.steps):
        dist.barrier()  # each step starts together, so the max over ranks is its real cost
        t0 = time.perf_counter()
        engine.backward(engine(*_batch(args, rank, i)))
        engine.step()
        times.append(time.perf_counter() - t0)
        graphs.append(engine.compile_report.graphs if compiled else 0)
    times, peak_rss = slowest_rank(times)
    median = statistics.median(times[args.warmup :])
    tokens = args.micro_batch * args.block_size * args.nproc
    result = {
        "side": side,
        "median_s": round(median, 5),
        "tokens_per_s": round(tokens / median, 1),
        "first_step_s": round(times[0], 3),
        "peak_rss_mib": peak_rss,
    }
    if compiled:
        report = engine.compile_report
        result.update(
            mode=report.mode,
            blocks=len(report.blocks),
            graphs=graphs[-1],
            graphs_after_warmup=graphs[-1] - graphs[args.warmup - 1],
        )
    if rank == 0:
        print(json.dumps(result), flush=True)
    engine.destroy()
    zerostack.shutdown()


def main(args) -> dict:
    wanted = [s for s in args.sides.split(",") if s]
    unknown = sorted(set(wanted) - set(SIDES))
    if unknown:
        sys.exit(f"--sides: unknown {unknown}; choose from {SIDES}")
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.nproc)))
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)

    def launch(side: str) -> dict:
        argv = [*sys.argv[1:], "--side", side]
        return torchrun(os.path.abspath(__file__), args.nproc, argv, env, args.side_timeout)

    results = best_of_rounds(wanted, args.repeats, launch)
    ratios = {}
    for stage in (0, 3):
        eager, comp = results.get(f"stage{stage}_eager", {}), results.get(f"stage{stage}_compiled")
        if comp and "median_s" in comp and "median_s" in eager:
            ratios[f"stage{stage}"] = {
                "tokens_per_s": round(comp["tokens_per_s"] / eager["tokens_per_s"], 4),
                "peak_rss": round(comp["peak_rss_mib"] / eager["peak_rss_mib"], 4),
            }
    cfg = _config(args)
    out = {
        "benchmark": "compile",
        "backend": args.backend,
        "world_size": args.nproc,
        "model": vars(cfg),
        "parameters": cfg.num_params,
        "micro_batch_per_rank": args.micro_batch,
        "steps_timed": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "sides": {s: {k: v for k, v in results[s].items() if k != "side"} for s in wanted},
        "compiled_over_eager": ratios,
    }
    return emit(out, args.out)


if __name__ == "__main__":
    a = _args()
    if a.side is not None:
        run_side(a)
    else:
        main(a)
