"""DeepSpeed 0.19.8's OneCycle and LRRangeTest schedules, step by step, recorded as golden figures
for tests/test_lr_schedules.py.

    DS_ACCELERATOR=cpu .peers/bin/python scripts/lr_schedules_golden.py \
        --write tests/golden/lr_schedules.json

Each case: an optimizer of two param groups, the schedule built from DeepSpeed's class with the
case's arguments, then 14 steps; each group's lr and betas (None without) after construction
and after every step.
"""

from __future__ import annotations

import argparse
import sys

import torch
from _golden import emit

STEPS = 14
CASES = {
    "onecycle_adamw_decay": ("OneCycle", "AdamW", {
        "cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 5,
        "cycle_second_step_size": 3, "decay_lr_rate": 0.5, "decay_step_size": 2,
        "cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": 0.1}),
    "onecycle_stairs_sgd": ("OneCycle", "SGD", {
        "cycle_min_lr": 0.002, "cycle_max_lr": 0.02, "cycle_first_step_size": 6,
        "cycle_second_step_size": 4, "cycle_first_stair_count": 2,
        "cycle_second_stair_count": 3}),
    "onecycle_per_group_no_momentum": ("OneCycle", "AdamW", {
        "cycle_min_lr": [0.01, 0.02], "cycle_max_lr": [0.05, 0.08], "cycle_first_step_size": 4,
        "cycle_momentum": False, "decay_lr_rate": 1.0, "decay_step_size": 3}),
    "lr_range_test": ("LRRangeTest", "AdamW", {
        "lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 3,
        "lr_range_test_step_rate": 2.0}),
    "lr_range_test_staircase": ("LRRangeTest", "SGD", {
        "lr_range_test_min_lr": [0.001, 0.004], "lr_range_test_step_size": 4,
        "lr_range_test_step_rate": 0.5, "lr_range_test_staircase": True}),
}  # fmt: skip


def optimizer(kind: str) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    groups = [{"params": [params[0]]}, {"params": [params[1]]}]
    return torch.optim.AdamW(groups, lr=0.5) if kind == "AdamW" else torch.optim.SGD(groups, lr=0.5)


def trace(classes: dict, name: str) -> list:
    """Each group's (lr, betas) after construction and after each step."""
    kind, opt_kind, params = CASES[name]
    opt = optimizer(opt_kind)
    sched = classes[kind](opt, **params)

    def now():
        return [[g["lr"], list(g["betas"]) if "betas" in g else None] for g in opt.param_groups]

    out = [now()]
    for _ in range(STEPS):
        opt.step()
        sched.step()
        out.append(now())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", help="write the JSON here (default: print it)")
    args = ap.parse_args(argv)
    import deepspeed
    from deepspeed.runtime import lr_schedules

    classes = {"OneCycle": lr_schedules.OneCycle, "LRRangeTest": lr_schedules.LRRangeTest}
    out = {"command": " ".join(["DS_ACCELERATOR=cpu .peers/bin/python", *sys.argv]),
           "deepspeed": deepspeed.__version__,
           "cases": {name: trace(classes, name) for name in CASES}}  # fmt: skip
    return emit(out, args.write)


if __name__ == "__main__":
    raise SystemExit(main())
