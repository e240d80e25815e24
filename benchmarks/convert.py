"""``zerostack convert``'s speed and memory on a checkpoint bigger than 4 GB.

    python benchmarks/convert.py                     # 36 x 10M-element params: 4.3 GB of states
    python benchmarks/convert.py --params 4 --numel 1000000 --out convert.json   # quick

A zerostack checkpoint is made first (fp32 masters and two Adam moments per parameter, values
drawn from a seeded generator, written by the converter's own zerostack writer from a synthetic
reader), then converted to each format in a fresh process: ``hf`` (safetensors, 2 GB shards),
``zerostack`` (a re-pack), ``deepspeed`` (8 ranks at ZeRO-3) and ``dcp``. Per target: GB
written, seconds, GB/s, and the process's peak RSS (``getrusage``) beside its RSS when the
conversion began (then, not the imports' peak), against the bound the converter promises: one
parameter's fp32 state (master and moments) plus one output file held in memory (none for
``hf``, ``zerostack`` and ``dcp``, which stream; a rank's file for ``deepspeed``). Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

try:
    import zerostack  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch

TARGETS = {"hf": {"max_shard_size": "2GB"}, "zerostack": {},
           "deepspeed": {"world": 8, "stage": 3}, "dcp": {}}  # fmt: skip
KINDS = ("exp_avg", "exp_avg_sq")


class _Synthetic:
    """A reader of a checkpoint that exists only as a seed: ``n`` parameters of ``numel``
    elements, each value drawn when asked for."""

    def __init__(self, n: int, numel: int) -> None:
        self.numel, self.buffers = numel, {}
        names = [f"layers.{i}.weight" for i in range(n)]
        self.manifest = {
            "params": {name: [numel] for name in names},
            "aliases": {},
            "frozen": [],
            "excluded": [],
            "layout": {"world_size": 1, "dp": 1, "tp": 1, "zero_stage": 3, "precision": "fp32"},
            "counters": {"global_steps": 1, "global_samples": 8, "micro_steps": 1,
                         "skipped_steps": 0},  # fmt: skip
            "loss_scaler": {"cur_scale": 1.0},
            "data_sampler": None,
            "lr_scheduler": None,
            "optimizer_groups": [{"hyper": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                            "weight_decay": 0.0}, "step": 1.0,
                                  "params": names}],  # fmt: skip
            "client_state": {},
            "client_tensors": None,
        }

    def kinds(self) -> list[str]:
        return list(KINDS)

    def full(self, name: str, kind: str = "master") -> torch.Tensor:
        seed = int(name.split(".")[1]) * 3 + ["master", *KINDS].index(kind)
        return torch.randn(self.numel, generator=torch.Generator().manual_seed(seed))


def _rss_mb() -> float:
    """The process's peak RSS so far (MiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _current_mb() -> float:
    """The process's RSS now (MiB): the bound counts from here, so a peak left by the imports
    is held against the conversion (conservative)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _child(args) -> None:
    from zerostack.checkpoint.convert import convert

    before = _current_mb()
    report = convert(args.src, args.dst, args.to, **json.loads(args.options))
    print(json.dumps({"gb": report.bytes / 1e9, "seconds": report.seconds,
                      "gb_per_s": report.gb_per_s, "peak_rss_mb": _rss_mb(),
                      "rss_before_mb": before}))  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=36)
    p.add_argument("--numel", type=int, default=10_000_000)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    p.add_argument("--out", help="also write the JSON object to this file")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--to", help=argparse.SUPPRESS)
    p.add_argument("--src", help=argparse.SUPPRESS)
    p.add_argument("--dst", help=argparse.SUPPRESS)
    p.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    from zerostack.checkpoint.convert import _to_zerostack

    base = tempfile.mkdtemp(prefix="zs-convert-", dir=args.dir)
    try:
        reader = _Synthetic(args.params, args.numel)
        t0 = time.monotonic()
        made = _to_zerostack(os.path.join(base, "global_step1"), reader, os.path.join(base, "src"),
                             progress=False)  # fmt: skip
        states = args.params * args.numel * 4 * (1 + len(KINDS))
        one_param = args.numel * 4 * (1 + len(KINDS))
        result = {
            "command": "python benchmarks/convert.py " + " ".join(sys.argv[1:] if argv is None
                                                                  else argv),  # fmt: skip
            "states_gb": states / 1e9,
            "source": {"gb": made.bytes / 1e9, "seconds": time.monotonic() - t0},
            "one_parameter_state_mb": one_param / 2**20,
            "targets": {},
        }
        for to, options in TARGETS.items():
            dst = os.path.join(base, to)
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--to", to,
                   "--src", os.path.join(base, "src"), "--dst", dst,
                   "--options", json.dumps(options)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            if done.returncode or not lines:
                result["targets"][to] = {"error": done.stderr[-2000:]}
                continue
            got = json.loads(lines[-1])
            held = one_param + (states / options["world"] if to == "deepspeed" else 0)
            got["bound_mb"] = got["rss_before_mb"] + held / 2**20
            got["within_bound"] = got["peak_rss_mb"] <= got["bound_mb"]
            result["targets"][to] = got
            shutil.rmtree(dst, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
