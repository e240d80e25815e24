"""How far each ZeRO stage runs from the floor: the same per-rank step with no communication.

    python benchmarks/floor.py                       # GPT 8L d512 (27M), 2 ranks, 3 rounds
    python benchmarks/floor.py --n-layer 2 --d-model 128 --repeats 1 --steps 3   # quick
    git worktree add /tmp/base HEAD~3 && python benchmarks/floor.py --baseline /tmp/base

The floor is what a rank's step costs when nothing is shared: each of the ``--nproc`` processes
trains its own copy of the model on the batch a dp rank gets (torch AdamW, fused, and the same
clipping), with no collective at all, on the same cores at the same time as the other sides'
ranks. Every other side (torch DDP, FSDP2, zerostack stages 0-3) runs the same per-rank batch at
dp = ``--nproc``; each is printed as a ratio to the floor, with its peak RSS.

For the zerostack sides the step is split into phases from the engine's own counters, read as
differences over the timed steps: the seconds of forward, backward and the optimizer step
(``engine.timers``), and inside them the seconds the host spent posting and waiting for each kind
of collective (the CommLog: ``all_gather``, ``reduce_scatter``, ``all_reduce``); ``compute`` is
what is left. The per-step losses are printed so a change that speeds a stage up can be seen not
to change what it computes (``--baseline``: the same zerostack sides from another checkout, in
the same rounds, and whether their losses are identical).

Sides are launched one torchrun at a time and visited in alternating order each round; per side
the round with the lowest median step time is kept (see ``benchmarks/zero.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

try:
    import zerostack
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    import zerostack
from _bench import best_of_rounds, emit, slowest_rank, torchrun  # benchmarks/_bench.py
from zero import _batch, _build, _config  # benchmarks/zero.py

from zerostack.models import GPT

ZS = [f"zerostack_stage{s}" for s in range(4)]
SIDES = ["floor", "ddp", "fsdp2", *ZS]
PHASES = ("forward", "backward", "step")


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="rounds over all sides")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--sides", default=",".join(SIDES), help="comma list, a subset of the default")
    p.add_argument("--out", help="also write the JSON object to this file")
    p.add_argument("--side-timeout", type=float, default=1800, help="seconds per side launch")
    p.add_argument("--baseline", help="a zerostack checkout to compare with, side by side")
    p.add_argument("--zero", default="{}", help="JSON: more zero_optimization keys for zerostack")
    p.add_argument("--side", help=argparse.SUPPRESS)  # set by the parent for one child launch
    args = p.parse_args(argv)
    args.zero_extra = json.loads(args.zero)  # what benchmarks/zero.py's _ds_config reads
    return args


def _floor(model: torch.nn.Module, timers: dict[str, float]):
    """This rank's step on its own: no process group call, the other sides' optimizer; the
    seconds of each phase added to ``timers`` as zerostack's engine counts them."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(x, y):
        t0 = time.perf_counter()
        loss = model(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        t3 = time.perf_counter()
        for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            timers[phase] += seconds
        return loss

    return step


def _phases(timers: dict[str, float], records: list, before: dict | None) -> dict:
    """Seconds so far per phase (``timers``) and per collective kind (the CommLog's
    ``records``); ``before``: subtract these."""
    now = {p: timers.get(p, 0.0) for p in PHASES}
    comm: dict[str, float] = defaultdict(float)
    for rec in records:
        comm[rec.op] += rec.seconds
    now["comm"] = dict(comm)
    if before is None:
        return now
    out = {p: now[p] - before[p] for p in PHASES}
    out["comm"] = {op: s - before["comm"].get(op, 0.0) for op, s in now["comm"].items()}
    return out


def run_side(args) -> None:
    side = args.side
    zerostack.init_distributed("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(_config(args))
    engine, timed = None, None  # timed: (timers, comm records) of a side split by phase
    result: dict = {"side": side}
    if side == "floor":
        timed = (defaultdict(float), [])
        step = _floor(model, timed[0])
    else:
        try:
            inner, engine = _build(side, args, model)
        except Exception as e:  # FSDP2 may not support CPU/gloo: record it rather than crash
            if side != "fsdp2":
                raise
            inner, result["skipped"] = None, f"{type(e).__name__}: {e}".splitlines()[0]
        if engine is not None:  # (the CommLog keeps 64 steps' records: the run's all)
            timed = (engine.timers, engine.comm.log.records)

            def step(x, y):
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                return loss
        else:
            step = inner  # DDP's or FSDP2's step (returns None: no loss recorded)
    if step is not None:
        for i in range(args.warmup):
            step(*_batch(args, rank, i))
        before = _phases(*timed, None) if timed is not None else None
        times, losses = [], []
        for i in range(args.warmup, args.warmup + args.steps):
            dist.barrier()  # each step starts together, so the max over ranks is its real cost
            t0 = time.perf_counter()
            loss = step(*_batch(args, rank, i))
            times.append(time.perf_counter() - t0)
            if loss is not None:
                losses.append(float(loss))
        times, result["peak_rss_mib"] = slowest_rank(times)
        result["median_s"] = round(statistics.median(times), 5)
        result["threads_per_rank"] = torch.get_num_threads()
        if losses:
            result["losses_rank0"] = losses
        if timed is not None:
            split = _phases(*timed, before)
            per_step = {p: round(split[p] / args.steps, 5) for p in PHASES}
            comm = {op: round(s / args.steps, 5) for op, s in sorted(split["comm"].items()) if s}
            total = sum(per_step.values())
            per_step["compute"] = round(total - sum(comm.values()), 5)
            result["phases_s_per_step_rank0"] = {**per_step, "comm": comm}
        if engine is not None:
            result["memory_breakdown"] = engine.memory_breakdown()
    if rank == 0:
        print(json.dumps(result), flush=True)
    zerostack.shutdown()


def _launch(args, side: str, env: dict) -> dict:
    argv = [*sys.argv[1:], "--side", side]
    res = torchrun(os.path.abspath(__file__), args.nproc, argv, env, args.side_timeout)
    return res if "error" not in res else {"side": side, **res}


def main(args) -> dict:
    wanted = [s for s in args.sides.split(",") if s]
    unknown = sorted(set(wanted) - set(SIDES))
    if unknown:
        sys.exit(f"--sides: unknown {unknown}; choose from {SIDES}")
    if "floor" not in wanted:
        wanted.insert(0, "floor")  # every ratio is to it
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.nproc)))
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    envs = {s: env for s in wanted}
    runnable = list(wanted)
    if args.baseline:
        src = os.path.join(os.path.abspath(args.baseline), "src")
        if not os.path.isdir(os.path.join(src, "zerostack")):
            sys.exit(f"--baseline: {args.baseline!r} has no src/zerostack")
        path = os.pathsep.join(p for p in (src, env["PYTHONPATH"]) if p)
        base = {f"base_{s}": dict(env, PYTHONPATH=path) for s in wanted if s in ZS}
        envs.update(base)
        runnable += list(base)
    results = best_of_rounds(
        runnable, args.repeats, lambda s: _launch(args, s.removeprefix("base_"), envs[s])
    )
    floor = results.get("floor", {}).get("median_s")
    to_floor = {}
    for s, res in results.items():
        if floor and "median_s" in res:
            to_floor[s] = {
                "time": round(res["median_s"] / floor, 4),
                "peak_rss": round(res["peak_rss_mib"] / results["floor"]["peak_rss_mib"], 4),
            }
    cfg = _config(args)
    out = {
        "benchmark": "floor",
        "world_size": args.nproc,
        "model": vars(cfg),
        "parameters": cfg.num_params,
        "micro_batch_per_rank": args.micro_batch,
        "steps_timed": args.steps,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "sides": {s: {k: v for k, v in results[s].items() if k != "side"} for s in runnable},
        "to_floor": to_floor,
    }
    if args.baseline:
        out["baseline"] = os.path.abspath(args.baseline)
        out["losses_identical"] = {
            s: results.get(s, {}).get("losses_rank0")
            == results.get(f"base_{s}", {}).get("losses_rank0")
            for s in wanted
            if s in ZS
        }
    return emit(out, args.out)


if __name__ == "__main__":
    a = _args()
    if a.side is not None:
        run_side(a)
    else:
        main(a)
