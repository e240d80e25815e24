"""Ulysses sequence parallelism: the longest sequence whose activations fit a fixed budget per
rank, and tokens per second, at sp 1, 2 and 4.

    python benchmarks/ulysses.py                      # budget 32 MiB per rank, batch 1
    python benchmarks/ulysses.py --budget-mib 64 --sps 1,2

Each sp is its own torchrun launch of sp ranks (dp 1): the reference GPT (d_model 64, 4 heads,
2 layers) with its attention exchanged over the sp ranks. The activation bytes are a census of
what autograd saves for backward on each rank (``saved_tensors_hooks``, parameters and scalars
left out), not zerostack's own accounting; the longest sequence is found by doubling and then
bisection over multiples of 64 x sp. Tokens per second: the median of 5 training steps (SGD,
ZeRO stage 0) at ``--seq`` tokens, the whole job's tokens over the step time. On a machine with
fewer cores than ranks, the ranks share the cores: the speed column says what the exchange
costs there, not what separate devices would give.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

try:
    import zerostack
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    import zerostack
from _bench import emit, torchrun  # benchmarks/_bench.py

from zerostack.models import GPT, GPTConfig
from zerostack.sequence import shard_sequence

LONGEST = 1 << 17  # the position table's length: no probe goes past it


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sps", default="1,2,4", help="sp sizes, one launch each")
    p.add_argument("--budget-mib", type=float, default=32.0, help="activation bytes per rank")
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence for the speed")
    p.add_argument("--out", help="also write the JSON object to this file")
    p.add_argument("--side-timeout", type=float, default=1800)
    p.add_argument("--side", type=int, help=argparse.SUPPRESS)  # the sp of one child launch
    return p.parse_args(argv)


def _model(topo) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=LONGEST, n_layer=2, n_head=4, d_model=64, bias=False)
    return GPT(cfg, topology=topo)


def _saved_bytes(model: GPT, topo, batch: int, seq: int) -> int:
    """Bytes autograd keeps for backward on this rank for one forward at ``seq`` tokens."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total = 0

    def pack(t):
        nonlocal total
        if t.untyped_storage().data_ptr() not in params and t.numel() > 1:
            total += t.numel() * t.element_size()
        return t

    x = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seq))
    x = shard_sequence(x, topo)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, x)
    del loss
    return total


def _longest(model: GPT, topo, batch: int, budget: int) -> tuple[int, int]:
    """(the longest sequence whose saved bytes fit ``budget``, its bytes); every rank probes
    the same lengths, so their all-to-alls pair up."""
    unit = 64 * topo.sp
    lo, hi = 0, unit
    while hi <= LONGEST and _saved_bytes(model, topo, batch, hi) <= budget:
        lo, hi = hi, hi * 2
    hi = min(hi, LONGEST + unit)
    while hi - lo > unit:
        mid = (lo + hi) // 2 // unit * unit
        if _saved_bytes(model, topo, batch, mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo, _saved_bytes(model, topo, batch, lo) if lo else 0


def _child(args) -> None:
    import json

    sp = args.side
    zerostack.init_distributed()
    topo = zerostack.Topology.build(sp=sp)
    budget = int(args.budget_mib * 2**20)
    model = _model(topo)
    longest, fit_bytes = _longest(model, topo, args.batch, budget)
    per_token = _saved_bytes(model, topo, args.batch, args.seq) / (args.batch * args.seq)
    engine, *_ = zerostack.initialize(
        model=model,
        topology=topo,
        config={
            "train_micro_batch_size_per_gpu": args.batch,
            "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 0},
            "steps_per_print": 10**9,
        },
    )
    g = torch.Generator().manual_seed(0)
    first = engine.comm.log.count  # the probes' exchanges are not the steps'
    times = []
    for _ in range(6):
        x = torch.randint(0, 256, (args.batch, args.seq), generator=g)
        x, y = shard_sequence((x, x), topo)
        t0 = time.perf_counter()
        engine.backward(engine(x, y))
        engine.step()
        times.append(time.perf_counter() - t0)
    step = statistics.median(times[1:])  # the first step warms the allocator
    log = engine.comm.log.since(first)
    a2a = sum(r.bytes for r in log if r.op == "all_to_all") / len(times)
    # 2 layers, 4 exchanges each way of batch * seq * d_model / sp fp32 values
    formula = 2 * 8 * args.batch * args.seq * 64 // sp * 4 if sp > 1 else 0
    result = {
        "sp": sp,
        "longest_sequence": longest,
        "its_activation_bytes_per_rank": fit_bytes,
        "activation_bytes_per_token_per_rank": per_token,
        "step_seconds": step,
        "tokens_per_second": args.batch * args.seq / step,
        "all_to_all_bytes_per_step_per_rank": a2a,
        "all_to_all_formula": formula,
    }
    engine.destroy()
    if topo.global_rank == 0:
        print(json.dumps(result), flush=True)
    zerostack.shutdown()


def main(args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = sys.argv[1:]
    sides = {}
    for sp in (int(s) for s in args.sps.split(",")):
        sides[sp] = torchrun(
            os.path.abspath(__file__), sp, [*argv, "--side", str(sp)], env, args.side_timeout
        )
        print(f"sp {sp}: {sides[sp]}", file=sys.stderr, flush=True)
    base = sides.get(1, {})
    for sp, side in sides.items():
        if sp != 1 and "error" not in side and "error" not in base:
            side["longest_vs_sp1"] = side["longest_sequence"] / base["longest_sequence"]
            side["tokens_per_second_vs_sp1"] = side["tokens_per_second"] / base["tokens_per_second"]
    out = {
        "budget_mib_per_rank": args.budget_mib,
        "batch": args.batch,
        "speed_at_tokens": args.seq,
        "cores": os.cpu_count(),
        "sides": {str(sp): side for sp, side in sides.items()},
    }
    return emit(out, args.out)


if __name__ == "__main__":
    a = _args()
    if a.side is not None:
        _child(a)
    else:
        main(a)
