"""Where a step's memory goes, phase by phase: zerostack's stage 3 (or any stage) against FSDP2.

    python benchmarks/memory_timeline.py                              # ~19M GPT, 2 ranks
    python benchmarks/memory_timeline.py --d-model 1024 --n-layer 8   # 101M
    MALLOC_MMAP_THRESHOLD_=4194304 python benchmarks/memory_timeline.py ...  # a fixed allocator

Each side runs in its own torchrun launch (peak RSS is per process). Every rank trains the same
GPT on the same batches as ``benchmarks/zero.py`` and, after each phase (building the model,
wrapping it, each step's forward, backward and optimizer step), reads figures the library does
not produce itself:

- ``rss`` / ``hwm``: the kernel's resident set after the phase and its peak during it
  (``/proc/self/status``; the peak is reset between phases through ``/proc/self/clear_refs``);
- ``live`` / ``live_peak``: bytes glibc's malloc has handed out and not had back
  (``mallinfo2``: ``uordblks + hblkhd``), after the phase and, sampled every 2 ms by a thread,
  at most during it;
- ``held``: bytes malloc holds from the system (``arena + hblkhd``): ``held - live`` is freed
  memory the allocator keeps, which is where RSS and live bytes part;
- ``mmapped``: the part of ``live`` in chunks of their own (``hblkhd``), which go back to the
  system when freed.

Buffers zerostack maps itself (``core/scratch.py``: stage 3's large transients) are not malloc's,
so ``live`` and ``held`` leave them out; RSS counts them.

Prints one JSON object: per side the phases (rank 0's, MiB) and the peaks over ranks, and the
ratios of the first side's peaks to the second's. Linux with glibc only.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zero as zb  # benchmarks/zero.py: the same model, batches and configs
from _bench import emit, torchrun

import zerostack
from zerostack.models import GPT

MiB = 2**20


_MALLINFO2_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS.split()]


class Probe:
    """The figures after each phase, and the live-byte peak during it."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL("libc.so.6")
        self._libc.mallinfo2.restype = _MallInfo2
        self.rows: list[dict] = []
        self._peak = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._sample, daemon=True).start()

    def _live(self) -> tuple[int, _MallInfo2]:
        m = self._libc.mallinfo2()
        return m.uordblks + m.hblkhd, m

    def _sample(self) -> None:
        while True:
            live, _ = self._live()
            with self._lock:
                self._peak = max(self._peak, live)
            time.sleep(0.002)

    def mark(self, phase: str) -> None:
        status = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    status[key] = int(value.split()[0]) * 1024
        live, m = self._live()
        with self._lock:
            peak, self._peak = max(self._peak, live), 0
        self.rows.append(
            {
                "phase": phase,
                "rss": status["VmRSS"] / MiB,
                "hwm": status["VmHWM"] / MiB,
                "live": live / MiB,
                "live_peak": peak / MiB,
                "held": (m.arena + m.hblkhd) / MiB,
                "mmapped": m.hblkhd / MiB,
            }
        )
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the next phase's VmHWM starts from the RSS now


def _wrap(side: str, args, model: torch.nn.Module):
    """(forward, backward, step) for the side."""
    if side == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=False)

        return model, lambda loss: loss.backward(), step
    stage = int(side.split("_stage")[1][0])
    engine, *_ = zerostack.initialize(model=model, config=zb._ds_config(args, stage))
    return engine, engine.backward, engine.step


def run_side(args) -> None:
    zerostack.init_distributed("gloo")
    rank = dist.get_rank()
    probe = Probe()
    torch.manual_seed(0)
    model = GPT(zb._config(args))
    probe.mark("built")
    forward, backward, step = _wrap(args.side, args, model)
    probe.mark("wrapped")
    for i in range(args.steps):
        loss = forward(*zb._batch(args, rank, i))
        probe.mark(f"{i} forward")
        backward(loss)
        del loss
        probe.mark(f"{i} backward")
        step()
        probe.mark(f"{i} step")
    peaks = torch.tensor([max(r[k] for r in probe.rows) for k in ("hwm", "live_peak", "held")])
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    if rank == 0:
        rows = [
            {k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()}
            for r in probe.rows
        ]
        keys = ("hwm", "live_peak", "held")
        peak = dict(zip(keys, (round(v, 1) for v in peaks.tolist()), strict=True))
        print(json.dumps({"side": args.side, "peak": peak, "phases": rows}), flush=True)
    zerostack.shutdown()


def main(args) -> dict:
    sides = [s for s in args.sides.split(",") if s]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.nproc)))
    results = {}
    for side in sides:
        res = torchrun(
            os.path.abspath(__file__),
            args.nproc,
            [*sys.argv[1:], "--side", side],
            env,
            args.side_timeout,
        )
        print(f"{side}: {json.dumps(res.get('peak', res))}", file=sys.stderr, flush=True)
        results[side] = res
    out = {
        "benchmark": "memory_timeline",
        "world_size": args.nproc,
        "parameters": zb._config(args).num_params,
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "sides": {s: {k: v for k, v in r.items() if k != "side"} for s, r in results.items()},
    }
    a, b = (results.get(s, {}).get("peak") for s in sides[:2]) if len(sides) >= 2 else (None, None)
    if a and b:
        out["ratios"] = {f"{sides[0]}/{sides[1]}": {k: round(a[k] / b[k], 4) for k in a}}
    return emit(out, args.out)


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument(
        "--sides",
        default="zerostack_stage3,fsdp2",
        help="comma list; the ratio is the first's peaks over the second's",
    )
    p.add_argument("--out", help="also write the JSON object to this file")
    p.add_argument("--side-timeout", type=float, default=1800, help="seconds per side launch")
    p.add_argument("--side", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.zero_extra = {}
    return args


if __name__ == "__main__":
    a = _args()
    if a.side is not None:
        run_side(a)
    else:
        main(a)
