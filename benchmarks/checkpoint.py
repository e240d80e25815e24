"""Checkpoint save and load, zerostack vs torch.distributed.checkpoint, on the same state.

    python benchmarks/checkpoint.py                   # ~50M GPT, dp=2, ZeRO stages 1 and 3
    python benchmarks/checkpoint.py --d-model 256 --n-layer 4 --out ckpt.json

Each stage runs in one torchrun launch of 2 ranks: a few training steps, then (repeated, best of
``--repeats``) ``engine.save_checkpoint`` / ``engine.load_checkpoint`` and ``dcp.save`` /
``dcp.load`` of exactly the tensors zerostack writes (each rank's master and Adam slices, under
rank-unique keys so that every rank writes its own, as zerostack does). Prints JSON: seconds per
save and load (slowest rank), bytes written per rank, the tensors' own bytes, and the ratios.

    python benchmarks/checkpoint.py --stall           # the step-time stall of a save, ZeRO 2

``--stall``: training steps of the same GPT at ZeRO stage 2 (dp 2), one of which ends with a
save: ``save_checkpoint`` (synchronous), ``save_checkpoint(async_save=True)``, and
``torch.distributed.checkpoint.async_save`` of the same tensors (its own gloo group, as its
documentation asks). Per mode: the seconds the save call blocks the training loop, and the
stall: the extra seconds of the steps from the save to the write's end over as many plain steps
(median of ``--repeats``; slowest rank each step), and the ratios to the synchronous save.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

try:
    import zerostack
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    import zerostack
from _bench import emit, torchrun  # benchmarks/_bench.py

from zerostack.models import GPT, GPTConfig


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=16)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--stages", default="1,3")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    p.add_argument("--out", help="also write the JSON object to this file")
    p.add_argument("--bench-stage", type=int, help=argparse.SUPPRESS)
    p.add_argument("--stall", action="store_true", help="measure the step-time stall of a save")
    p.add_argument("--bench-stall", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _folder_bytes(path: str, prefix: str = "") -> int:
    return sum(
        os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.startswith(prefix)
    )


def run_stage(args) -> None:
    zerostack.init_distributed("gloo")
    rank = dist.get_rank()
    cfg = GPTConfig(block_size=64, n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head)
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": args.bench_stage},
    }
    engine, *_ = zerostack.initialize(model=GPT(cfg), config=config)
    for i in range(2):
        t = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(i + 10 * rank))
        engine.backward(engine(t[:, :-1], t[:, 1:]))
        engine.step()
    root = args.dir
    zs_dir, dcp_dir = os.path.join(root, "zerostack"), os.path.join(root, "dcp")
    # the same tensors for DCP: this rank's master and moment slices
    state = {}
    for p, lo, hi, master, a, b in engine.zero.owned_slices():
        if hi > lo and engine.zero.owns_replica:
            state[f"rank{rank}/master/{lo}/{id(p)}"] = master.detach().reshape(-1)[a:b].clone()
            for k, v in engine.optimizer.state[master].items():
                if torch.is_tensor(v) and v.dim() > 0:
                    state[f"rank{rank}/{k}/{lo}/{id(p)}"] = v.reshape(-1)[a:b].clone()
    tensor_bytes = sum(t.nbytes for t in state.values())
    times = {"zerostack_save": [], "zerostack_load": [], "dcp_save": [], "dcp_load": []}
    for _ in range(args.repeats):
        for name, fn in (
            ("zerostack_save", lambda: engine.save_checkpoint(zs_dir, tag="bench")),
            ("zerostack_load", lambda: engine.load_checkpoint(zs_dir, tag="bench")),
            ("dcp_save", lambda: dcp.save(state, checkpoint_id=dcp_dir)),
            ("dcp_load", lambda: dcp.load(state, checkpoint_id=dcp_dir)),
        ):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(_slowest(time.perf_counter() - t0))
    zs_bytes = os.path.getsize(os.path.join(zs_dir, "bench", f"rank{rank:05d}.safetensors"))
    dcp_bytes = _folder_bytes(dcp_dir, f"__{rank}_")
    per_rank = torch.tensor([zs_bytes, dcp_bytes, tensor_bytes], dtype=torch.int64)
    every = [torch.zeros_like(per_rank) for _ in range(dist.get_world_size())]
    dist.all_gather(every, per_rank)
    if rank == 0:
        best = {k: round(min(v), 4) for k, v in times.items()}
        print(
            json.dumps(
                {
                    "stage": args.bench_stage,
                    "parameters": cfg.num_params,
                    "seconds": best,
                    "bytes_per_rank": [
                        {"zerostack": int(e[0]), "dcp": int(e[1]), "tensors": int(e[2])}
                        for e in every
                    ],
                    "zerostack_bytes_over_tensors": [
                        round(int(e[0]) / int(e[2]), 4) for e in every
                    ],
                    "save_time_vs_dcp": round(best["zerostack_save"] / best["dcp_save"], 3),
                    "load_time_vs_dcp": round(best["zerostack_load"] / best["dcp_load"], 3),
                }
            ),
            flush=True,
        )
    zerostack.shutdown()


def _step(engine, rank: int, i: int) -> None:
    t = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(i + 10 * rank))
    engine.backward(engine(t[:, :-1], t[:, 1:]))
    engine.step()


def run_stall(args) -> None:
    """One launch: the stall of each save mode (see the module's description)."""
    from statistics import median

    zerostack.init_distributed("gloo")
    rank = dist.get_rank()
    cfg = GPTConfig(block_size=64, n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head)
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**6,
    }
    engine, *_ = zerostack.initialize(model=GPT(cfg), config=config)
    ckpt_group = dist.new_group(backend="gloo")  # DCP's background coordination, not training's
    state = {}  # the same tensors for DCP: this rank's master and moment slices, live
    for p, lo, hi, master, a, b in engine.zero.owned_slices():
        if hi > lo:
            state[f"rank{rank}/master/{lo}/{id(p)}"] = master.detach().reshape(-1)[a:b]
            for k, v in engine.optimizer.state[master].items():
                if torch.is_tensor(v) and v.dim() > 0:
                    state[f"rank{rank}/{k}/{lo}/{id(p)}"] = v.reshape(-1)[a:b]
    i = 0

    def timed_step(save=None) -> tuple[float, float]:
        nonlocal i
        dist.barrier()
        t0 = time.perf_counter()
        _step(engine, rank, i)
        t1 = time.perf_counter()
        out = save() if save is not None else None
        t2 = time.perf_counter()
        i += 1
        return _slowest(t2 - t0), _slowest(t2 - t1), out

    for _ in range(2):  # warm-up
        timed_step()
    plain = median(timed_step()[0] for _ in range(3))
    modes = {
        "sync": (lambda: engine.save_checkpoint(os.path.join(args.dir, "sync"), tag="s"), None),
        "async": (
            lambda: engine.save_checkpoint(os.path.join(args.dir, "async"), async_save=True),
            lambda _: not engine.checkpoints._saver.pending,
        ),
        "dcp_async": (
            lambda: dcp.async_save(
                state, checkpoint_id=os.path.join(args.dir, "dcp"), process_group=ckpt_group
            ),
            lambda fut: fut.done(),
        ),
    }
    results = {}
    for name, (save, done) in modes.items():
        blocked, stall, steps = [], [], []
        for _ in range(args.repeats):
            total, call, handle = timed_step(save)
            n = 1
            while done is not None and not _all_done(done(handle)) and n < 50:
                total += timed_step()[0]
                n += 1
            if name == "async":
                engine.wait_for_checkpoint()
            elif name == "dcp_async":
                handle.result()
            blocked.append(call)
            stall.append(total - n * plain)
            steps.append(n)
        results[name] = {
            "save_call_s": round(median(blocked), 3),
            "stall_s": round(median(stall), 3),
            "steps_until_written": int(median(steps)),
        }
    if rank == 0:
        sync = results["sync"]["stall_s"]
        out = {
            "mode": "stall",
            "zero_stage": 2,
            "parameters": cfg.num_params,
            "plain_step_s": round(plain, 3),
            "saves": results,
            "stall_vs_sync": {
                k: round(v["stall_s"] / sync, 3) if sync > 0 else None for k, v in results.items()
            },
        }
        print(json.dumps(out), flush=True)
    engine.destroy()
    zerostack.shutdown()


def _all_done(mine: bool) -> bool:
    """Whether the write is done on every rank (so every rank runs the same steps)."""
    t = torch.tensor([0 if mine else 1])
    dist.all_reduce(t)
    return int(t) == 0


def main_stall(args) -> dict:
    root = args.dir or tempfile.mkdtemp(prefix="zs-ckpt-stall-")
    try:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        argv = [*sys.argv[1:], "--dir", root, "--bench-stall"]
        res = torchrun(os.path.abspath(__file__), 2, argv, env, 1800)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    out = {"benchmark": "checkpoint_stall", "world_size": 2, "torch": torch.__version__, **res}
    return emit(out, args.out)


def main(args) -> dict:
    root = args.dir or tempfile.mkdtemp(prefix="zs-ckpt-bench-")
    results = []
    try:
        for stage in [int(s) for s in args.stages.split(",")]:
            env = dict(os.environ, OMP_NUM_THREADS="1")
            argv = [*sys.argv[1:], "--dir", root, "--bench-stage", str(stage)]
            res = torchrun(os.path.abspath(__file__), 2, argv, env, 1800)
            if "error" in res:
                res = {"stage": stage, **res}
            results.append(res)
            print(json.dumps(res), file=sys.stderr)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    out = {"benchmark": "checkpoint", "world_size": 2, "torch": torch.__version__, "runs": results}
    return emit(out, args.out)


if __name__ == "__main__":
    a = _args()
    if a.bench_stall:
        run_stall(a)
    elif a.stall:
        main_stall(a)
    elif a.bench_stage is not None:
        run_stage(a)
    else:
        main(a)
