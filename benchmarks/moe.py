"""Mixture of experts at ep 1, 2 and 4 (the same 8 experts in all), beside the same GPT with a
dense MLP of equal active flops (top-1: each token through one MLP): tokens per second, bytes
per rank, bytes exchanged.

    python benchmarks/moe.py                 # 4 ranks a side, ZeRO stage 1
    python benchmarks/moe.py --steps 20 --nproc 4
    python benchmarks/moe.py --stages 2,3    # ep 2 (dp 2 x ep 2) at ZeRO-2 against ZeRO-3

Each side is its own torchrun launch of ``--nproc`` ranks: dense (dp 4), MoE at ep 1 (dp 4),
ep 2 (dp 2 x ep 2) and ep 4 (dp 1 x ep 4). Every rank trains on its own micro-batch, so every
side moves the same tokens a step. Bytes per rank are a census of the module's parameter
storages on the rank (shared and expert apart), not zerostack's accounting; the all-to-all bytes
are counted where zerostack hands them to torch.distributed. With more ranks than cores the
ranks share them: the times say what the exchange and the gating cost here, not what separate
devices would give.
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

from zerostack.models import GPT, GPTConfig
from zerostack.moe import is_moe_param

EXPERTS = 8
SIDES = ("dense", "moe_ep1", "moe_ep2", "moe_ep4")


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=12, help="timed steps per side (after 2)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--out", help="also write the JSON object to this file")
    p.add_argument("--side-timeout", type=float, default=1800)
    p.add_argument(
        "--stages",
        help="instead of the sides above, MoE at ep 2 at each of these ZeRO stages (e.g. 2,3)",
    )
    p.add_argument("--side", help=argparse.SUPPRESS)  # set by the parent for one child launch
    return p.parse_args(argv)


def _stage(side: str) -> int:
    """A side ``moe_ep2@3`` runs at ZeRO stage 3; one without ``@`` at stage 1."""
    return int(side.split("@")[1]) if "@" in side else 1


def _model_config(side: str, block: int) -> GPTConfig:
    side = side.split("@")[0]
    base = dict(vocab_size=256, block_size=block, n_layer=2, n_head=4, d_model=64, bias=False)
    if side == "dense":
        return GPTConfig(**base)
    ep = int(side.removeprefix("moe_ep"))
    return GPTConfig(
        **base,
        moe_every=1,
        num_experts=EXPERTS,
        moe_k=1,
        moe_capacity_factor=1.25,
        moe_ep_size=ep,
    )


def run_side(args) -> None:
    zerostack.init_distributed("gloo")
    handed = {"all_to_all": 0}
    real = dist.all_to_all_single

    def counting(output, input, *a, **kw):
        handed["all_to_all"] += input.nbytes
        return real(output, input, *a, **kw)

    dist.all_to_all_single = counting
    torch.manual_seed(0)
    cfg = _model_config(args.side, args.block_size)
    model = GPT(cfg)
    engine, *_ = zerostack.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": args.micro_batch,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": _stage(args.side)},
            "steps_per_print": 10**9,
        },
    )
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    times, exchanged = [], []
    for _ in range(args.steps + 2):
        x = torch.randint(0, 256, (args.micro_batch, args.block_size + 1), generator=g)
        handed["all_to_all"] = 0
        dist.barrier()
        t0 = time.perf_counter()
        engine.backward(engine(x[:, :-1], x[:, 1:]))
        engine.step()
        times.append(time.perf_counter() - t0)
        exchanged.append(handed["all_to_all"])
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
    params = list(engine.module.parameters())
    expert = sum(p.numel() * p.element_size() for p in params if is_moe_param(p))
    shared = sum(p.numel() * p.element_size() for p in params if not is_moe_param(p))
    step = statistics.median(t.tolist()[2:])
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0])
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    peak_rss = float(rss)
    tokens = args.micro_batch * args.block_size * dist.get_world_size()
    if rank == 0:
        result = {
            "side": args.side,
            "ep": engine.topology.ep,
            "dp": engine.topology.dp,
            "parameters": cfg.num_params,
            "step_seconds": round(step, 5),
            "tokens_per_second": round(tokens / step, 1),
            "expert_parameter_bytes_per_rank": expert,
            "shared_parameter_bytes_per_rank": shared,
            # the library's own count (parameters, gradients, masters, optimizer state)
            "model_state_bytes_per_rank": sum(engine.memory_breakdown().values()),
            # the process's own peak (the kernel's count, not the library's), largest rank
            "peak_rss_mib": round(peak_rss / 2**20, 1),
            "all_to_all_bytes_per_step_per_rank": max(exchanged[2:]),
        }
        print(json.dumps(result), flush=True)
    engine.destroy()
    zerostack.shutdown()


def main(args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    sides = {}
    wanted = SIDES
    if args.stages:
        wanted = tuple(f"moe_ep2@{s}" for s in args.stages.split(","))
    for side in wanted:
        if side.startswith("moe_ep") and args.nproc % int(side.split("@")[0][len("moe_ep") :]):
            continue
        argv = [*sys.argv[1:], "--side", side]
        sides[side] = torchrun(os.path.abspath(__file__), args.nproc, argv, env, args.side_timeout)
        print(f"{side}: {json.dumps(sides[side])}", file=sys.stderr, flush=True)
    base_side = "dense" if not args.stages else wanted[0]
    dense = sides[base_side]
    ratios = {}
    for side, got in sides.items():
        if side == base_side or "error" in got or "error" in dense:
            continue
        ratios[f"{side}/{base_side}"] = {
            "tokens_per_second": round(got["tokens_per_second"] / dense["tokens_per_second"], 3),
            "model_state_bytes_per_rank": round(
                got["model_state_bytes_per_rank"] / dense["model_state_bytes_per_rank"], 3
            ),
            "peak_rss": round(got["peak_rss_mib"] / dense["peak_rss_mib"], 3),
        }
    out = {
        "benchmark": "moe",
        "world_size": args.nproc,
        "experts": EXPERTS,
        "tokens_per_step": args.micro_batch * args.block_size * args.nproc,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "sides": sides,
        "ratios": ratios,
    }
    return emit(out, args.out)


if __name__ == "__main__":
    a = _args()
    if a.side is not None:
        run_side(a)
    else:
        main(a)
