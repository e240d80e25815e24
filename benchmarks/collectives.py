"""The backend's collectives on one gradient bucket: which reduction is fastest here.

    python benchmarks/collectives.py                      # 2 gloo ranks, 4M fp32 elements
    python benchmarks/collectives.py --nproc 4 --numel 1000000 --rounds 20

ZeRO stages 1-3 reduce-scatter each gradient bucket and all-gather parameters. Over gloo,
torch's reduce-scatter of a bucket takes longer than an all-reduce of the same bucket, which
moves twice the bytes; zerostack's (``zerostack_reduce_scatter``: an all-to-all and a sum, see
``zerostack.comm.grid``) moves the reduce-scatter's bytes; its all-gather
(``zerostack_all_gather``) posts every send and receive in one batch. Every op runs on the same
buffers, interleaved round by round after a barrier; the median over ``--rounds`` (the first two
left out, the slowest rank's) is printed per op, with each op's time over the all-reduce's, as
one JSON object.
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
from _bench import emit, torchrun  # benchmarks/_bench.py

try:
    from zerostack.comm.grid import _all_gather_peers, _reduce_scatter_rows
except ImportError:  # run from a checkout without installing: use its source
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    from zerostack.comm.grid import _all_gather_peers, _reduce_scatter_rows
from zerostack.core import scratch

# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names still work, deprecated)
_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--numel", type=int, default=4_000_000, help="fp32 elements per bucket")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--out", default=None, help="also write the JSON object to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def worker(args) -> None:
    dist.init_process_group(args.backend)
    world = dist.get_world_size()
    numel = args.numel // world * world
    full, out = torch.randn(numel), torch.empty(numel)
    piece = torch.empty(numel // world)
    pool = scratch.Pool()
    ops = {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter_tensor": lambda: _RS(piece, full),
        "reduce_scatter_list": lambda: dist.reduce_scatter(piece, list(full.chunk(world))),
        "zerostack_reduce_scatter": lambda: _reduce_scatter_rows(
            piece, full, op=dist.ReduceOp.SUM, group=dist.group.WORLD, async_op=False
        ),
        # as stages 1-2 run it: the received rows from a pool, not a fresh buffer each time
        "zerostack_reduce_scatter_pooled": lambda: _reduce_scatter_rows(
            piece, full, op=dist.ReduceOp.SUM, group=dist.group.WORLD, async_op=False, pool=pool
        ),
        "all_gather_tensor": lambda: _AG(out, piece),
        "all_gather_list": lambda: dist.all_gather(list(out.chunk(world)), piece),
        "zerostack_all_gather": lambda: _all_gather_peers(
            out, piece, group=dist.group.WORLD, async_op=False
        ),
    }
    times: dict[str, list[float]] = {k: [] for k in ops}
    for _ in range(args.rounds):
        for name, op in ops.items():
            dist.barrier()
            t0 = time.perf_counter()
            op()
            times[name].append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(v[2:]) for v in times.values()], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # an op is as slow as its slowest rank
    if dist.get_rank() == 0:
        med = dict(zip(ops, t.tolist(), strict=True))
        result = {
            "benchmark": "collectives",
            "backend": args.backend,
            "world_size": world,
            "numel": numel,
            "rounds": args.rounds,
            "torch": torch.__version__,
            "median_ms": {k: round(v * 1000, 3) for k, v in med.items()},
            "over_all_reduce": {k: round(v / med["all_reduce"], 3) for k, v in med.items()},
        }
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


def main(args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = torchrun(os.path.abspath(__file__), args.nproc, [*sys.argv[1:], "--worker"], env, 600)
    return emit(res, args.out)


if __name__ == "__main__":
    a = _args()
    if a.worker:
        worker(a)
    else:
        main(a)
