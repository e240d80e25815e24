"""ZeRO++ quantized weights (qwZ) and gradients (qgZ) against plain stage 3: bytes on the wire,
step time, and the demo's loss curve.

    python benchmarks/zeropp.py                    # the demo's GPT and run, 300 steps, 2 ranks
    python benchmarks/zeropp.py --steps 40 --bf16  # quicker; bf16 gathers (qwZ halves them)
    python benchmarks/zeropp.py --sides stage3,stage3_qgz,stage3_qgz4 --seeds 0,1,2

Each side is the demo's training run (``zerostack train``'s model, corpus, AdamW, warmup-cosine
schedule and clipping, from the same command-line defaults) at ZeRO stage 3 with every parameter
gathered each pass (``stage3_param_persistence_threshold`` 0, or the demo's small model would
keep them all resident): plain, ``zero_quantized_weights``, ``zero_quantized_gradients`` (int8,
and int4 as ``stage3_qgz4``), both, and (with ``--nproc`` 4 or more)
``zero_hpz_partition_size`` nproc / 2, each in its own torchrun launch. The bytes are counted
where zerostack hands its tensors to torch.distributed (not from zerostack's CommLog), per
optimizer step: the parameter all-gathers (over dp, and hpZ's within subgroups apart), and the
gradient reduce-scatter or (qgZ) all-to-all. Prints one JSON object: per
side the median step time, the bytes per step, the loss every 10 steps, the mean of the last 50
and the demo's validation loss at the end; per quantized side the ratios to plain (bytes, time)
and the relative differences of those two losses.
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

from zerostack.cli import DEFAULTS, _build_config, _parser
from zerostack.demo.corpus import corpus_datasets
from zerostack.demo.train import _evaluate
from zerostack.models import GPT, GPTConfig

SIDES = ("stage3", "stage3_qwz", "stage3_qgz", "stage3_qgz4", "stage3_qwz_qgz", "stage3_hpz")
"""stage3_qgz4: qgZ with ``zero_quantized_gradients_bits: 4``; stage3_hpz runs at 4+ ranks."""


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per side")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (bf16 gathers)")
    p.add_argument(
        "--seeds",
        default="0",
        help="comma-separated seeds (weights and data order); the losses are their means",
    )
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # one child's
    p.add_argument("--sides", default=",".join(SIDES), help="comma list, stage3 among them")
    p.add_argument("--out", help="also write the JSON object to this file")
    p.add_argument("--side-timeout", type=float, default=3600)
    p.add_argument("--side", help=argparse.SUPPRESS)  # set by the parent for one child launch
    return p.parse_args(argv)


def _config(args, weights: bool, grads: bool, hpz: int = 1, bits: int = 8) -> dict:
    """The config ``zerostack train --zero-stage 3 [--bf16]`` builds, plus the ZeRO++ keys."""
    argv = ["train", "--zero-stage", "3", "--steps", str(args.steps)]
    cfg = _build_config(_parser().parse_args(argv + (["--bf16"] if args.bf16 else [])))
    zero = cfg.setdefault("zero_optimization", {})
    zero.update(
        stage3_param_persistence_threshold=0,
        zero_quantized_weights=weights,
        zero_quantized_gradients=grads,
        zero_hpz_partition_size=hpz,
    )
    if bits != 8:
        zero["zero_quantized_gradients_bits"] = bits
    cfg["steps_per_print"] = 10**9
    cfg["seed"] = args.seed
    return cfg


def run_side(args) -> None:
    zerostack.init_distributed("gloo")
    import zerostack.comm.grid as grid

    moved = {"all_gather": 0, "all_gather_hpz": 0, "reduce_scatter": 0, "all_to_all": 0}

    def counting(op: str, fn):
        def call(output, input, **kw):  # the bytes torch.distributed is given to move
            subgroup = dist.get_world_size(kw.get("group")) < dist.get_world_size()
            key = op + ("_hpz" if subgroup else "")  # hpZ's gathers within subgroups
            moved[key] += (output if op == "all_gather" else input).nbytes
            return fn(output, input, **kw)

        return call

    grid._all_gather = counting("all_gather", grid._all_gather)
    grid._reduce_scatter = counting("reduce_scatter", grid._reduce_scatter)
    dist.all_to_all_single = counting("all_to_all", dist.all_to_all_single)
    torch.manual_seed(args.seed)
    model = GPT(
        GPTConfig(
            block_size=DEFAULTS["block_size"],
            n_layer=DEFAULTS["n_layer"],
            n_head=DEFAULTS["n_head"],
            d_model=DEFAULTS["d_model"],
        )
    )
    train_set, val_set = corpus_datasets(DEFAULTS["block_size"])
    hpz = dist.get_world_size() // 2 if "_hpz" in args.side else 1
    bits = 4 if args.side.endswith("_qgz4") else 8
    config = _config(args, "_qwz" in args.side, "_qgz" in args.side, hpz, bits)
    engine, *_ = zerostack.initialize(model=model, training_data=train_set, config=config)
    losses, times, step_bytes = [], [], []
    for _ in range(args.steps):
        moved.update({k: 0 for k in moved})
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(engine.train_batch().item())
        times.append(time.perf_counter() - t0)
        step_bytes.append(dict(moved))
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    val_loss = _evaluate(engine, val_set, DEFAULTS["block_size"], batches=32)
    if engine.global_rank == 0:
        result = {
            "side": args.side,
            "parameters": sum(p.ds_numel for p in engine.module.parameters()),
            "median_s": round(statistics.median(t.tolist()[2:] or t.tolist()), 5),
            "bytes_per_step": {
                k: max(b[k] for b in step_bytes) for k in moved if any(b[k] for b in step_bytes)
            },
            "loss_every_10": [round(x, 4) for x in losses[::10]],
            "final_loss": round(statistics.fmean(losses[-50:]), 5),  # the last 50 steps'
            "val_loss": round(val_loss, 5),  # the demo's held-out bytes, 32 micro-batches a rank
        }
        print(json.dumps(result), flush=True)
    engine.destroy()
    zerostack.shutdown()


def _over_seeds(runs: list[dict], seeds: list[int]) -> dict:
    """One side over its seeds: the first seed's bytes, the median step time, the losses'
    means (and each seed's)."""
    if any("error" in r for r in runs):
        return next(r for r in runs if "error" in r)
    out = dict(runs[0])
    if len(runs) > 1:
        out["median_s"] = round(statistics.median(r["median_s"] for r in runs), 5)
        for key in ("final_loss", "val_loss"):
            out[f"{key}_by_seed"] = [r[key] for r in runs]
            out[key] = round(statistics.fmean(r[key] for r in runs), 5)
        out["seeds"] = seeds
    return out


def main(args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.nproc)))
    sides, seeds = {}, [int(x) for x in args.seeds.split(",")]
    wanted = args.sides.split(",")
    if "stage3" not in wanted or not set(wanted) <= set(SIDES):
        raise SystemExit(f"--sides: a comma list of {', '.join(SIDES)}, stage3 among them")
    for side in [s for s in SIDES if s in wanted and (s != "stage3_hpz" or args.nproc >= 4)]:
        runs = []
        for seed in seeds:
            argv = [*sys.argv[1:], "--side", side, "--seed", str(seed)]
            runs.append(
                torchrun(os.path.abspath(__file__), args.nproc, argv, env, args.side_timeout)
            )
            print(f"{side}, seed {seed}: {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
        sides[side] = _over_seeds(runs, seeds)
    plain, ratios = sides["stage3"], {}
    for side in list(sides)[1:]:
        got = sides[side]
        if "median_s" not in got or "median_s" not in plain:
            continue
        mine, base = got["bytes_per_step"], plain["bytes_per_step"]
        grads = mine.get("all_to_all") or mine["reduce_scatter"]
        ratios[f"{side}/stage3"] = {
            "parameter_bytes_over_dp": round(base["all_gather"] / mine["all_gather"], 3),
            "gradient_bytes": round(base["reduce_scatter"] / grads, 3),
            "time": round(got["median_s"] / plain["median_s"], 3),
            "final_loss_rel_diff": round(
                abs(got["final_loss"] - plain["final_loss"]) / plain["final_loss"], 5
            ),
            "val_loss_rel_diff": round(
                abs(got["val_loss"] - plain["val_loss"]) / plain["val_loss"], 5
            ),
        }
    if len(seeds) > 1 and "final_loss_by_seed" in plain:
        by_seed = plain["final_loss_by_seed"]
        # how far plain stage 3's own runs lie apart: the noise the loss differences sit in
        ratios["stage3_seed_spread"] = round((max(by_seed) - min(by_seed)) / plain["final_loss"], 5)
    out = {
        "benchmark": "zeropp",
        "seeds": seeds,
        "world_size": args.nproc,
        "steps": args.steps,
        "dtype": "bf16" if args.bf16 else "fp32",
        "model": {k: DEFAULTS[k] for k in ("n_layer", "d_model", "n_head", "block_size")},
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
