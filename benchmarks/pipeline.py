"""Pipeline schedules measured: per-stage busy and idle time against the bubble formula.

    python benchmarks/pipeline.py                     # pp = 2 and 4, m = 8, every schedule, CPU
    python benchmarks/pipeline.py --d-model 256 --out pipeline.json
    python benchmarks/pipeline.py --stages 1,2,3      # pp 2 x dp 2, 1F1B, at each ZeRO stage

With ``--stages``, each stage runs pp 2 x dp 2 (4 ranks) under 1F1B: the batch time, the bytes of
model states per rank (the library's count) and each rank's peak RSS (the kernel's), against the
first stage listed.

Each (pp, schedule) runs in its own torchrun launch of pp ranks, plus a pp=1 baseline. The
executor times forward/backward (busy), point-to-point waits and the optimizer step on every rank;
idle = batch time - step time - busy. The measured bubble (mean idle / (batch - step) over stages)
is printed beside the formula with equal forward/backward costs: (p-1)/(m+p-1) for GPipe and 1F1B,
(p-1)/(v*m+p-1) for interleaved 1F1B with v chunks per rank. The step time is compared with pp=1
on the same global batch. On a CPU machine with fewer cores than ranks the ranks share cores, so
the bubble shows as idle time only when pp <= cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
from _bench import emit, torchrun  # benchmarks/_bench.py

from zerostack.models import GPTConfig
from zerostack.models.gpt_pipe import GPTLoss, gpt_layers
from zerostack.pipeline import PipelineModule

RUNS = [(1, "1f1b")] + [(p, s) for p in (2, 4) for s in ("gpipe", "1f1b", "interleaved")]


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="timed batches per run")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--out", help="also write the JSON object to this file")
    p.add_argument("--stages", help="pp 2 x dp 2 at each of these ZeRO stages (e.g. 1,2,3)")
    p.add_argument("--bench-run", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _cfg(args) -> GPTConfig:
    return GPTConfig(
        block_size=args.block_size, n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head
    )


def run_one(args) -> None:
    pp, schedule, stage, world = args.bench_run.split(":")
    pp, stage = int(pp), int(stage)
    chunks = 2 if schedule == "interleaved" else 1
    zerostack.init_distributed("gloo")
    topo = zerostack.Topology.build(pp=pp)
    torch.manual_seed(0)
    model = PipelineModule(
        gpt_layers(_cfg(args)),
        topology=topo,
        loss_fn=GPTLoss(),
        partition_method="type:Block",
        virtual_stages=chunks,
    )
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.micro_batches,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "pipeline": {"schedule": schedule, "virtual_stages": chunks},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = zerostack.initialize(model=model, config=config)

    def data(i):
        g = torch.Generator().manual_seed(i)
        for _ in range(args.micro_batches):
            t = torch.randint(0, 256, (args.micro_batch, args.block_size + 1), generator=g)
            yield t[:, :-1], t[:, 1:]

    rows = []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_batch(data(i))
        wall = time.perf_counter() - t0
        if i >= args.warmup:
            rows.append({**engine.runner.executor.stats, "wall_s": wall})
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    mine = torch.tensor(
        [med["compute_s"], med["comm_s"], med["step_s"], med["total_s"]], dtype=torch.float64
    )
    every = [torch.zeros_like(mine) for _ in range(pp)]
    dist.all_gather(every, mine, group=topo.group("pp"))
    # per rank: the model states the library counts, and the process's peak RSS (the kernel's)
    held = torch.tensor(
        [
            float(sum(engine.memory_breakdown().values())),
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0,
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        stages = []
        for s, t in enumerate(every):
            compute, comm, step, total = t.tolist()
            stages.append(
                {
                    "stage": s,
                    "busy_s": round(compute, 5),
                    "p2p_wait_s": round(comm, 5),
                    "idle_s": round(total - step - compute, 5),
                    "step_s": round(step, 5),
                    "batch_s": round(total, 5),
                }
            )
        bubble = statistics.mean(st["idle_s"] / (st["batch_s"] - st["step_s"]) for st in stages)
        m, v = args.micro_batches, chunks
        formula = (pp - 1) / (v * m + pp - 1)
        print(
            json.dumps(
                {
                    "pp": pp,
                    "dp": topo.dp,
                    "zero_stage": stage,
                    "model_state_bytes_per_rank": int(held[0]),
                    "peak_rss_mib": round(float(held[1]) / 2**20, 1),
                    "schedule": schedule,
                    "chunks": chunks,
                    "batch_s": round(statistics.median(r["wall_s"] for r in rows), 5),
                    "bubble_measured": round(bubble, 4),
                    "bubble_formula": round(formula, 4),
                    "stages": stages,
                }
            ),
            flush=True,
        )
    zerostack.shutdown()


def main(args) -> dict:
    results = []
    runs = [(pp, schedule, 1, pp) for pp, schedule in RUNS]
    if args.stages:
        runs = [(2, "1f1b", int(s), 4) for s in args.stages.split(",")]
    for pp, schedule, stage, world in runs:
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)))
        argv = [*sys.argv[1:], "--bench-run", f"{pp}:{schedule}:{stage}:{world}"]
        res = torchrun(os.path.abspath(__file__), world, argv, env, 1800)
        if "error" in res:
            res = {"pp": pp, "schedule": schedule, **res}
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "stages"}), file=sys.stderr)
    if args.stages:  # against the first stage listed
        base = results[0] if "batch_s" in results[0] else None
        for r in results if base else []:
            if "batch_s" in r:
                r["vs_first_stage"] = {
                    k: round(r[k] / base[k], 3)
                    for k in ("batch_s", "model_state_bytes_per_rank", "peak_rss_mib")
                }
    base = next((r for r in results if r["pp"] == 1 and "batch_s" in r), None)
    if base:
        for r in results:
            if "batch_s" in r:
                r["batch_time_vs_pp1"] = round(r["batch_s"] / base["batch_s"], 3)
    cfg = _cfg(args)
    out = {
        "benchmark": "pipeline",
        "model": vars(cfg),
        "parameters": cfg.num_params,
        "micro_batches": args.micro_batches,
        "micro_batch": args.micro_batch,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "runs": results,
    }
    return emit(out, args.out)


if __name__ == "__main__":
    a = _args()
    if a.bench_run is not None:
        run_one(a)
    else:
        main(a)
