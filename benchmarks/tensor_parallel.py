"""Tensor vs data parallelism for the reference GPT: speed, bytes moved, bytes held per rank.

    python benchmarks/tensor_parallel.py                  # ~3.2M-parameter GPT on CPU, a few min
    python benchmarks/tensor_parallel.py --d-model 512 --sides dp2,tp2 --out tp.json

Sides (each its own torchrun launch, so peak RSS is per side):

* ``dp2``: 2 ranks, data parallel (ZeRO stage 0), micro batch ``m`` per rank;
* ``tp2`` / ``tp2_sp``: 2 ranks, tensor parallel (with sequence parallelism), micro batch ``2m``:
  the same tokens per step as ``dp2``;
* ``tp1`` / ``tp4``: 1 and 4 tensor-parallel ranks at micro batch ``2m`` (the memory curve).

Per side: median seconds per step (slowest rank), tokens/s, bytes moved per step by rank 0 per
collective and axis (from the CommLog: the full buffer of each call), the bytes a ring algorithm
sends per rank for those calls, and per rank the bytes of parameters and the peak bytes of
activations saved for backward (counted by saved-tensor hooks, one count per storage).
Ratios: ``tp2/dp2`` time and wire bytes; ``tpN/tp1`` parameter and activation bytes.
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
from _bench import emit, torchrun  # benchmarks/_bench.py

from zerostack.models import GPT, GPTConfig

SIDES = {
    "dp2": (2, 1, False),
    "tp2": (2, 2, False),
    "tp2_sp": (2, 2, True),
    "tp1": (1, 1, False),
    "tp4": (4, 4, False),
}


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=4, help="per rank at dp2 (2x at tp)")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--out", help="also write the JSON object to this file")
    p.add_argument("--side", help=argparse.SUPPRESS)
    return p.parse_args(argv)


class SavedBytes:
    """Bytes of tensors autograd saves for backward, per storage, and the peak over a step."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.peak = 0

    def pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        self.live.setdefault(st.data_ptr(), st.nbytes())
        self.peak = max(self.peak, sum(self.live.values()))
        return t

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def reset(self) -> None:
        self.live.clear()


def run_side(args) -> None:
    world, tp, sp = SIDES[args.side]
    zerostack.init_distributed("gloo")
    topo = zerostack.Topology.build(tp=tp)
    cfg = GPTConfig(
        block_size=args.block_size, n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head
    )
    torch.manual_seed(0)
    model = GPT(cfg, topology=topo if tp > 1 else None, sequence_parallel=sp)
    micro = args.micro_batch * 2 // topo.dp  # the same tokens per step on every side
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 0},
    }
    engine, *_ = zerostack.initialize(model=model, topology=topo, config=config)
    saved = SavedBytes()

    def step(i: int) -> None:
        g = torch.Generator().manual_seed(10_000 * topo.dp_rank + i)
        t = torch.randint(0, 256, (micro, args.block_size + 1), generator=g)
        saved.reset()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            loss = engine(t[:, :-1], t[:, 1:])
        engine.backward(loss)
        engine.step()

    for i in range(args.warmup):
        step(i)
    times = []
    for i in range(args.warmup, args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    median = statistics.median(t.tolist())
    last = engine.global_steps - 1
    moved = {k: int(v["bytes"]) for k, v in engine.comm.log.step_summary(last).items()}
    # What a ring algorithm sends per rank: all-reduce 2(n-1)/n of the buffer, reduce-scatter and
    # all-gather (n-1)/n each (the CommLog counts the full buffer for all three).
    wire = 0.0
    for r in engine.comm.log.for_step(last):
        n = topo.size(r.axis)
        wire += r.bytes * (n - 1) / n * (2 if r.op == "all_reduce" else 1)
    mem = torch.tensor([sum(p.nbytes for p in model.parameters()), saved.peak])
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    tokens = micro * args.block_size * topo.dp
    if dist.get_rank() == 0:
        print(
            json.dumps(
                {
                    "side": args.side,
                    "world": world,
                    "tp": tp,
                    "dp": topo.dp,
                    "sequence_parallel": sp,
                    "micro_batch": micro,
                    "tokens_per_step": tokens,
                    "median_s": round(median, 5),
                    "tokens_per_s": round(tokens / median, 1),
                    "bytes_moved_per_step": moved,
                    "bytes_moved_total": sum(moved.values()),
                    "wire_bytes_per_rank": int(wire),
                    "param_bytes_per_rank": int(mem[0]),
                    "activation_bytes_per_rank": int(mem[1]),
                }
            ),
            flush=True,
        )
    zerostack.shutdown()


def _launch(side: str, argv: list[str]) -> dict:
    world = SIDES[side][0]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)))
    res = torchrun(os.path.abspath(__file__), world, [*argv, "--side", side], env, 1800)
    return res if "error" not in res else {"side": side, **res}


def main(args) -> dict:
    wanted = [s for s in args.sides.split(",") if s]
    if set(wanted) - set(SIDES):
        sys.exit(f"--sides: unknown {sorted(set(wanted) - set(SIDES))}; choose from {list(SIDES)}")
    argv = sys.argv[1:]
    results = {}
    for side in wanted:
        results[side] = _launch(side, argv)
        print(f"{side}: {json.dumps(results[side])}", file=sys.stderr, flush=True)
    ratios = {}
    dp2 = results.get("dp2", {})
    for side in ("tp2", "tp2_sp"):
        r = results.get(side, {})
        if "median_s" in r and "median_s" in dp2:
            ratios[f"{side}/dp2"] = {
                "time": round(r["median_s"] / dp2["median_s"], 3),
                "wire_bytes": round(
                    r["wire_bytes_per_rank"] / max(1, dp2["wire_bytes_per_rank"]), 3
                ),
            }
    tp1 = results.get("tp1", {})
    for side in ("tp2", "tp2_sp", "tp4"):
        r = results.get(side, {})
        if "param_bytes_per_rank" in r and "param_bytes_per_rank" in tp1:
            ratios[f"{side}/tp1"] = {
                k: round(r[f"{k}_bytes_per_rank"] / tp1[f"{k}_bytes_per_rank"], 3)
                for k in ("param", "activation")
            }
    cfg = GPTConfig(
        block_size=args.block_size, n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head
    )
    out = {
        "benchmark": "tensor_parallel",
        "model": vars(cfg),
        "parameters": cfg.num_params,
        "torch": torch.__version__,
        "steps_timed": args.steps,
        "sides": {s: {k: v for k, v in results[s].items() if k != "side"} for s in wanted},
        "ratios": ratios,
    }
    return emit(out, args.out)


if __name__ == "__main__":
    a = _args()
    if a.side is not None:
        run_side(a)
    else:
        main(a)
