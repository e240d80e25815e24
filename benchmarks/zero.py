"""zerostack's ZeRO stages vs torch DDP, torch FSDP2 and DeepSpeed: step time and peak memory.

    python benchmarks/zero.py                          # reference ~19M GPT, 2 ranks on CPU
    python benchmarks/zero.py --d-model 128 --n-layer 2 --steps 4 --sides ddp,zerostack_stage1
    . .peers/bin/activate && python benchmarks/zero.py --repeats 3 --out zero.json  # + DeepSpeed
    git worktree add /tmp/base HEAD~3 && python benchmarks/zero.py --baseline /tmp/base  # a change

Peak RSS is per process, so every side runs in its own torchrun launch: this (parent) process
loops over the sides, re-launching itself with ``--side NAME``, and reads one JSON line from
rank 0. Rounds visit the sides in alternating order so machine noise hits all alike; per side the
round with the lowest median is kept. DeepSpeed sides run when ``import deepspeed`` works in this
interpreter (see shared/PEERS.md). Prints one JSON object: per side the median seconds per step
(slowest rank per step), peak RSS (MiB, max over ranks) and for zerostack engine.memory_breakdown().

``--baseline DIR`` (another checkout of zerostack, e.g. a ``git worktree`` of the commit before a
refactor) adds a ``base_`` side for each zerostack side, run with ``DIR/src`` first on the path,
in the same rounds: the ratios then say whether the change made a stage slower, and
``memory_breakdown_identical`` whether it changed what a rank holds.
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
except ImportError:  # e.g. the DeepSpeed peers venv: use this checkout's source
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    import zerostack
from _bench import best_of_rounds, emit, slowest_rank, torchrun  # benchmarks/_bench.py

from zerostack.models import GPT, GPTConfig

ZS = [f"zerostack_stage{s}" for s in range(4)] + ["zerostack_stage3_split"]
DS = [f"deepspeed_stage{s}" for s in range(4)]
SIDES = ["ddp", "fsdp2", *ZS, *DS]
# (numerator, denominator) pairs reported when both sides ran.
RATIOS = [("zerostack_stage3", "fsdp2"), ("zerostack_stage3_split", "fsdp2")]
RATIOS += [(f"zerostack_stage{s}", "ddp") for s in (1, 2, 0)]
RATIOS += [(f"zerostack_stage{s}", f"deepspeed_stage{s}") for s in range(4)]


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="rounds over all sides")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--sides", default=",".join(SIDES), help="comma list, a subset of the default")
    p.add_argument("--out", help="also write the JSON object to this file")
    p.add_argument("--side-timeout", type=float, default=1800, help="seconds per side launch")
    p.add_argument(
        "--zero",
        default="{}",
        help="extra zero_optimization keys (JSON) for the zerostack and DeepSpeed sides, e.g. "
        "'{\"reduce_bucket_size\": 4000000}'",
    )
    p.add_argument("--baseline", help="a zerostack checkout to compare with, side by side")
    p.add_argument("--side", help=argparse.SUPPRESS)  # set by the parent for one child launch
    args = p.parse_args(argv)
    args.zero_extra = json.loads(args.zero)
    return args


def _config(args) -> GPTConfig:
    return GPTConfig(
        block_size=args.block_size, n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head
    )


def _batch(args, rank: int, step: int):
    # Seeded by (rank, step) alone, so every side trains on exactly the same tokens.
    g = torch.Generator().manual_seed(10_000 * rank + step)
    t = torch.randint(0, 256, (args.micro_batch, args.block_size + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()  # next-token targets


def _ds_config(args, stage: int, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage, **zero, **args.zero_extra},
    }


def _build(side: str, args, model: torch.nn.Module):
    """The side's step function and, for zerostack, its engine; None if the side is skipped."""
    if side == "ddp" or side == "fsdp2":
        if side == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def torch_step(x, y):
            model(x, y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=False)

        return torch_step, None
    stage = int(side.split("_stage")[1][0])
    split = {"stage3_param_persistence_threshold": 0} if side.endswith("_split") else {}
    if side.startswith("deepspeed"):
        import deepspeed

        cfg = _ds_config(args, stage, **split)
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
    else:
        engine, *_ = zerostack.initialize(model=model, config=_ds_config(args, stage, **split))

    def engine_step(x, y):
        engine.backward(engine(x, y))
        engine.step()

    return engine_step, engine if side.startswith("zerostack") else None


def run_side(args) -> None:
    """One side on this rank (under torchrun): warm up, time, print one JSON line on rank 0."""
    side = args.side
    if side.startswith("deepspeed"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        zerostack.init_distributed("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(_config(args))
    result: dict = {"side": side}
    try:
        step, engine = _build(side, args, model)
    except Exception as e:  # FSDP2 may not support CPU/gloo: record it rather than crash
        if side != "fsdp2":
            raise
        step, result["skipped"] = None, f"{type(e).__name__}: {e}".splitlines()[0]
    if step is not None:
        for i in range(args.warmup):
            step(*_batch(args, rank, i))
        times = []
        for i in range(args.warmup, args.warmup + args.steps):
            dist.barrier()  # each step starts together, so the max over ranks is its real cost
            t0 = time.perf_counter()
            step(*_batch(args, rank, i))
            times.append(time.perf_counter() - t0)
        times, result["peak_rss_mib"] = slowest_rank(times)
        result["median_s"] = round(statistics.median(times), 5)
        result["threads_per_rank"] = torch.get_num_threads()
        if engine is not None:
            result["memory_breakdown"] = engine.memory_breakdown()
    if rank == 0:
        print(json.dumps(result), flush=True)
    zerostack.shutdown()  # barrier first: no rank tears gloo down under a running peer


def _launch(args, side: str, env: dict) -> dict:
    """Run one side in a fresh pair of processes; an error is recorded, never raised."""
    argv = [*sys.argv[1:], "--side", side]
    res = torchrun(os.path.abspath(__file__), args.nproc, argv, env, args.side_timeout)
    return res if "error" not in res else {"side": side, **res}


def main(args) -> dict:
    wanted = [s for s in args.sides.split(",") if s]
    unknown = sorted(set(wanted) - set(SIDES))
    if unknown:
        sys.exit(f"--sides: unknown {unknown}; choose from {SIDES}")
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.nproc)))
    env.setdefault("DS_ACCELERATOR", "cpu")  # else DeepSpeed looks for CUDA and fails
    results: dict[str, dict] = {}
    ds_skip = None
    if any(s in DS for s in wanted):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        try:
            import deepspeed  # noqa: F401
        except Exception as e:
            ds_skip = f"not importable: {type(e).__name__}: {e}".splitlines()[0]
    runnable = [s for s in wanted if not (s in DS and ds_skip)]
    results.update({s: {"side": s, "skipped": ds_skip} for s in wanted if s not in runnable})
    envs = {s: env for s in runnable}
    if args.baseline:  # the same zerostack sides, from the other checkout's source
        src = os.path.join(os.path.abspath(args.baseline), "src")
        if not os.path.isdir(os.path.join(src, "zerostack")):
            sys.exit(f"--baseline: {args.baseline!r} has no src/zerostack")
        path = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        base = {f"base_{s}": dict(env, PYTHONPATH=path) for s in runnable if s in ZS}
        envs.update(base)
        runnable += list(base)
        wanted += list(base)
    results.update(
        best_of_rounds(
            runnable, args.repeats, lambda s: _launch(args, s.removeprefix("base_"), envs[s])
        )
    )
    ratios, same_memory = {}, {}
    pairs = RATIOS + [(s.removeprefix("base_"), s) for s in results if s.startswith("base_")]
    for s in results:
        if s.startswith("base_") and "memory_breakdown" in results[s]:
            now = results.get(s.removeprefix("base_"), {}).get("memory_breakdown")
            same_memory[s.removeprefix("base_")] = now == results[s]["memory_breakdown"]
    for a, b in pairs:
        ra, rb = results.get(a, {}), results.get(b, {})
        if "median_s" in ra and "median_s" in rb:
            ratios[f"{a}/{b}"] = {
                "time": round(ra["median_s"] / rb["median_s"], 4),
                "peak_rss": round(ra["peak_rss_mib"] / rb["peak_rss_mib"], 4),
            }
    cfg = _config(args)
    threads = {r["threads_per_rank"] for r in results.values() if "threads_per_rank" in r}
    out = {
        "benchmark": "zero",
        "world_size": args.nproc,
        "model": vars(cfg),
        "parameters": cfg.num_params,
        "micro_batch": args.micro_batch,
        "tokens_per_step": args.micro_batch * args.block_size * args.nproc,
        "steps_timed": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "threads_per_rank": threads.pop() if len(threads) == 1 else sorted(threads),
        "sides": {s: {k: v for k, v in results[s].items() if k != "side"} for s in wanted},
        "ratios": ratios,
    }
    if args.baseline:
        out["baseline"] = os.path.abspath(args.baseline)
        out["memory_breakdown_identical"] = same_memory
    return emit(out, args.out)


if __name__ == "__main__":
    a = _args()
    if a.side is not None:
        run_side(a)
    else:
        main(a)
