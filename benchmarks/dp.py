"""zerostack's data-parallel engine vs torch DistributedDataParallel, same model, same invocation.

    python benchmarks/dp.py                  # 2 ranks on CPU (re-launches itself under torchrun)
    python benchmarks/dp.py --nproc 4 --d-model 256 --steps 30

Both sides train the reference GPT with fused AdamW, gradient clipping at 1.0 and the same gradient
bucket size, on the same batches. Timed blocks alternate between the two so that machine noise hits
both alike. Prints one JSON object: median seconds per step for each, and engine / DDP.
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
import torch.distributed as dist


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--blocks", type=int, default=4, help="alternating timed blocks per side")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--bucket-mb", type=float, default=1.0, help="gradient bucket size, both sides")
    return p.parse_args(argv)


def _batches(args, rank, n):
    g = torch.Generator().manual_seed(rank)
    shape = (args.micro_batch, args.block_size)
    return [(torch.randint(0, 256, shape, generator=g),) * 2 for _ in range(n)]


def _time_steps(step_fn, batches) -> list[float]:
    out = []
    for x, y in batches:
        t0 = time.perf_counter()
        step_fn(x, y)
        out.append(time.perf_counter() - t0)
    return out


def main(args) -> dict:
    import zerostack
    from zerostack.models import GPT, GPTConfig

    zerostack.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, d_model=args.d_model)
    bucket_elems = int(args.bucket_mb * 2**20 / 4)

    torch.manual_seed(0)
    ddp_model = torch.nn.parallel.DistributedDataParallel(
        GPT(cfg), bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True
    )
    ddp_opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-4, fused=True)

    def ddp_step(x, y):
        loss = ddp_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
        ddp_opt.step()
        ddp_opt.zero_grad(set_to_none=False)

    torch.manual_seed(0)
    engine, *_ = zerostack.initialize(
        model=GPT(cfg),
        config={
            "train_micro_batch_size_per_gpu": args.micro_batch,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 0, "reduce_bucket_size": bucket_elems},
        },
    )

    def engine_step(x, y):
        engine.backward(engine(x, y))
        engine.step()

    sides = {"ddp": ddp_step, "zerostack": engine_step}
    times: dict[str, list[float]] = {k: [] for k in sides}
    for fn in sides.values():
        _time_steps(fn, _batches(args, rank, args.warmup))
    per_block = max(1, args.steps // args.blocks)
    for b in range(args.blocks):
        order = list(sides) if b % 2 == 0 else list(reversed(sides))
        for name in order:
            dist.barrier()
            times[name] += _time_steps(sides[name], _batches(args, rank + 100 * b, per_block))
    # A step is as slow as its slowest rank.
    med = {}
    for name, ts in times.items():
        t = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        med[name] = statistics.median(t.tolist())
    result = {
        "benchmark": "dp",
        "world_size": world,
        "parameters": sum(p.numel() for p in engine.module.parameters()),
        "tokens_per_step": args.micro_batch * args.block_size * world,
        "bucket_elements": bucket_elems,
        "steps_timed": len(times["ddp"]),
        "ddp_median_s": round(med["ddp"], 5),
        "zerostack_median_s": round(med["zerostack"], 5),
        "ratio_zerostack_over_ddp": round(med["zerostack"] / med["ddp"], 4),
        "torch": torch.__version__,
        "threads_per_rank": torch.get_num_threads(),
    }
    if rank == 0:
        print(json.dumps(result), flush=True)
    zerostack.shutdown()  # barrier first: no rank tears gloo down under a running peer
    return result


if __name__ == "__main__":
    a = _args()
    if "RANK" not in os.environ and a.nproc > 1:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // a.nproc)))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc_per_node={a.nproc}", __file__, *sys.argv[1:]]
        sys.exit(subprocess.call(cmd, env=env))
    main(a)
