"""16-bit master weights and optimizer states against fp32 masters: peak memory on one model and
the demo's loss curve, in one invocation.

    python benchmarks/sixteen_bit_masters.py                 # memory at ZeRO 1-3, the curve at 2
    python benchmarks/sixteen_bit_masters.py --steps 100     # a shorter curve
    python benchmarks/sixteen_bit_masters.py --part memory --stages 3

Sides, each in its own torchrun launch (so each process's peak is its own): ``fp32_masters``
(the bf16 block: bf16 weights, fp32 masters, fp32 moments) and ``bf16_masters``
(``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``: the masters are the bf16
weights, bf16 gradient pieces and moments), both AdamW.

- memory: a GPT of ``--mem-layers`` x ``--mem-width`` (about 100M parameters by default), built
  in bf16 (an fp32 model being cast would set the bf16 side's peak: 4 bytes a parameter for a
  moment), three optimizer steps on one short sequence; the process's peak resident set
  (``ru_maxrss``) and that peak above the resident set before the model was built (what the run
  made: weights, gradients, masters, moments and activations), and the ratios of the sides.
- curve: the demo's training run (``zerostack train``'s model, corpus, AdamW, warmup-cosine
  schedule and clipping, from the same command-line defaults) for ``--steps``; the loss every 10
  steps, the mean of the last 50 and the relative difference of the two sides' means (the goal:
  within 2%).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys

import torch

try:
    import zerostack
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    import zerostack
from _bench import emit, torchrun  # benchmarks/_bench.py

from zerostack.cli import DEFAULTS, _build_config, _parser
from zerostack.demo.corpus import corpus_datasets
from zerostack.models import GPT, GPTConfig

SIDES = ("fp32_masters", "bf16_masters")


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("both", "memory", "curve"), default="both")
    p.add_argument("--stages", default="1,2,3", help="the memory part's ZeRO stages")
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3), help="the curve's")
    p.add_argument("--steps", type=int, default=300, help="the curve's optimizer steps")
    p.add_argument("--mem-layers", type=int, default=8)
    p.add_argument("--mem-width", type=int, default=1024)
    p.add_argument("--out", help="also write the JSON object to this file")
    p.add_argument("--side-timeout", type=float, default=3600)
    p.add_argument("--side", help=argparse.SUPPRESS)  # set by the parent for one child launch
    p.add_argument("--what", help=argparse.SUPPRESS)  # memory or curve, for one child
    return p.parse_args(argv)


def _config(args, side: str) -> dict:
    """The config ``zerostack train --zero-stage S --bf16`` builds; the bf16 masters side adds
    the two keys."""
    argv = ["train", "--zero-stage", str(args.stage), "--steps", str(args.steps), "--bf16"]
    cfg = _build_config(_parser().parse_args(argv))
    if side == "bf16_masters":
        cfg["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    cfg["steps_per_print"] = 10**9
    cfg.setdefault("zero_optimization", {})["stage3_param_persistence_threshold"] = 0
    return cfg


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def run_memory(args) -> dict:
    before = _rss_kib()
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=64, n_layer=args.mem_layers, n_head=8, d_model=args.mem_width)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16, as a bf16 checkpoint loads
    model = GPT(cfg)
    torch.set_default_dtype(torch.float32)
    config = _config(args, args.side)
    config["train_micro_batch_size_per_gpu"] = 1
    engine, *_ = zerostack.initialize(model=model, config=config)
    x = torch.randint(0, cfg.vocab_size, (1, 64))
    for _ in range(3):
        engine.backward(engine(x, x))
        engine.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    out = {
        "parameters": sum(p.numel() for p in model.parameters())
        if args.stage < 3
        else sum(p.ds_numel for p in model.parameters()),
        "peak_rss_mib": round(peak / 1024, 1),
        "before_model_mib": round(before / 1024, 1),
        "peak_above_start_mib": round((peak - before) / 1024, 1),
        "engine_bytes_mib": {
            k: round(v / 2**20, 1) for k, v in engine.memory_breakdown().items() if v
        },
    }
    engine.destroy()
    return out


def run_curve(args) -> dict:
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            block_size=DEFAULTS["block_size"],
            n_layer=DEFAULTS["n_layer"],
            n_head=DEFAULTS["n_head"],
            d_model=DEFAULTS["d_model"],
        )
    )
    train_set, _ = corpus_datasets(DEFAULTS["block_size"])
    config = _config(args, args.side)
    engine, *_ = zerostack.initialize(model=model, training_data=train_set, config=config)
    losses = [engine.train_batch().item() for _ in range(args.steps)]
    engine.destroy()
    return {
        "loss_every_10": [round(x, 4) for x in losses[::10]],
        "final_loss": round(statistics.fmean(losses[-50:]), 5),  # the last 50 steps'
    }


def run_side(args) -> None:
    zerostack.init_distributed("gloo")
    result = run_memory(args) if args.what == "memory" else run_curve(args)
    print(json.dumps({"side": args.side, **result}), flush=True)
    zerostack.shutdown()


def main(args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 1))
    parts = ("memory", "curve") if args.part == "both" else (args.part,)
    out: dict = {"benchmark": "sixteen_bit_masters", "nproc": 1}
    runs = [("memory", int(st)) for st in args.stages.split(",")] * ("memory" in parts)
    runs += [("curve", args.stage)] * ("curve" in parts)
    for what, stage in runs:
        sides = {}
        for side in SIDES:
            argv = [*sys.argv[1:], "--side", side, "--what", what, "--stage", str(stage)]
            sides[side] = torchrun(os.path.abspath(__file__), 1, argv, env, args.side_timeout)
            print(f"{what} {side}: {json.dumps(sides[side])}", file=sys.stderr, flush=True)
        base, ours = sides["fp32_masters"], sides["bf16_masters"]
        if what == "memory" and "peak_rss_mib" in base and "peak_rss_mib" in ours:
            sides["ratios"] = {
                "peak_rss": round(ours["peak_rss_mib"] / base["peak_rss_mib"], 3),
                "peak_above_start": round(
                    ours["peak_above_start_mib"] / base["peak_above_start_mib"], 3
                ),
            }
        if what == "curve" and "final_loss" in base and "final_loss" in ours:
            diff = abs(ours["final_loss"] - base["final_loss"]) / base["final_loss"]
            sides["final_loss_rel_diff"] = round(diff, 5)
        out[f"{what}_zero{stage}"] = sides
    return emit(out, args.out)


if __name__ == "__main__":
    a = _args()
    if a.side:
        run_side(a)
    else:
        main(a)
