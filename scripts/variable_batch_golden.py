"""DeepSpeed 0.19.8's variable batch size and LR (data_efficiency's dynamic batching) on fixed
inputs, recorded as golden figures for tests/test_variable_batch.py (zerostack's own code is
:mod:`zerostack.data.variable_batch`).

    DS_ACCELERATOR=cpu .peers/bin/python scripts/variable_batch_golden.py \
        --write tests/golden/variable_batch.json

It imports only DeepSpeed's module (not zerostack) and records, with their inputs:

* ``batch_by_seqlens``: the micro-batches' (batch id, sample ids), the batch sizes and the batch
  max seqlens, for each picking order (random with two seeds), min/max batch sizes, micro-batches
  of one size, samples longer than ``max_tokens``, ``dataset_filter_ids``; or the exception's
  type where DeepSpeed refuses the input.
* ``scale_lr`` over a grid of batch sizes and methods.
* ``VariableBatchSizeLR`` over torch SGD (two param groups): constant LR (the optimizer passed),
  LambdaLR, StepLR and MultiplicativeLR bases; each group's LR after construction, after each
  of 8 steps, after a ``step(0)`` reset and two more steps, and ``get_last_lr()`` beside it.
* ``dataloader_for_variable_batch_size`` on 2 replicas, padded to the batch's max seqlen and
  collated by a user function, and ``get_dataloader_and_lr_scheduler_for_variable_batch_size``
  end to end: what each rank's loader yields, and the LRs; once more with the arguments
  DeepSpeed's engine entry point passes for a 2-rank engine (``ENGINE``).
"""

from __future__ import annotations

import argparse
import json
import random

import torch

_RNG = random.Random(0)
SEQLENS = [_RNG.randrange(1, 21) for _ in range(48)]
"""The sample lengths most cases pack (1 to 20 tokens)."""

BATCH_CASES = {
    "dataloader": dict(max_tokens=30, effective_batch_size=2),
    "dataloader_eb3": dict(max_tokens=24, effective_batch_size=3),
    "seqlen": dict(max_tokens=30, sequence_picking_order="seqlen", effective_batch_size=2),
    "random_seed7": dict(
        max_tokens=30, sequence_picking_order="random", seed=7, effective_batch_size=2
    ),
    "random_seed42": dict(
        max_tokens=30, sequence_picking_order="random", seed=42, effective_batch_size=2
    ),
    "min_max": dict(max_tokens=40, min_batch_size=2, max_batch_size=3, effective_batch_size=2),
    "min_stops_early": dict(
        max_tokens=30, min_batch_size=3, sequence_picking_order="seqlen", effective_batch_size=1
    ),
    "min_too_big": dict(max_tokens=22, min_batch_size=3, effective_batch_size=1),
    "same_size": dict(
        max_tokens=30,
        sequence_picking_order="seqlen",
        effective_batch_size=4,
        required_microbatches_of_same_size=True,
    ),
    "same_size_random": dict(
        max_tokens=26,
        sequence_picking_order="random",
        seed=3,
        effective_batch_size=3,
        required_microbatches_of_same_size=True,
    ),
    "too_long": dict(max_tokens=15, effective_batch_size=2),
    "too_long_seqlen": dict(max_tokens=12, sequence_picking_order="seqlen", effective_batch_size=2),
    "filter_ids": dict(
        max_tokens=25,
        effective_batch_size=2,
        sequence_ids_per_mb=[i for i, s in enumerate(SEQLENS) if 5 <= s <= 15],
    ),
    "filter_ids_random": dict(
        max_tokens=25,
        sequence_picking_order="random",
        seed=11,
        effective_batch_size=2,
        sequence_ids_per_mb=list(range(40, 0, -3)),
    ),
    "not_enough": dict(max_tokens=30, effective_batch_size=40),
    "all_too_long": dict(max_tokens=0, effective_batch_size=1),
}

SCALE_CASES = [
    (base, bs, base_lr, method)
    for method in ("linear", "sqrt", None, "none", "None")
    for base, bs, base_lr in ((4, 4, 1), (4, 7, 0.1), (16, 3, 1e-3), (3, 10, 0.3), (5, 13, 0.01))
]

LR_BATCH_SIZES = [5, 3, 8, 2, 6]  # cycled over: 8 steps wrap around
LR_CASES = {
    "constant_linear": (None, "linear"),
    "lambda_sqrt": ("lambda", "sqrt"),
    "step_linear": ("step", "linear"),
    "step_none": ("step", "none"),
    "multiplicative_sqrt": ("multiplicative", "sqrt"),
}

LOADER = dict(
    max_tokens=24,
    effective_batch_size=8,
    required_microbatches_of_same_size=True,
    sequence_picking_order="seqlen",
)
"""Micro-batches for the loader cases: 2 replicas x 2 micro-batches x 2 accumulation steps."""


def sample(i: int) -> list[int]:
    """Sample ``i`` of the loader cases' dataset: its id repeated over its length."""
    return [i] * SEQLENS[i]


def pad(s: list[int], size: int) -> list[int]:
    return s + [-1] * (size - len(s))


def collate(batch: list[list[int]]) -> dict:
    return {"n": len(batch), "rows": batch}


def sgd() -> torch.optim.SGD:
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    return torch.optim.SGD([{"params": [params[0]]}, {"params": [params[1]], "lr": 0.05}], lr=0.1)


def base_scheduler(kind, opt):
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.9**e)
    if kind == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    if kind == "multiplicative":  # steps from the rate it finds, step(0) too
        return torch.optim.lr_scheduler.MultiplicativeLR(opt, lambda e: 0.8)
    return opt


def lrs(opt) -> list[float]:
    return [g["lr"] for g in opt.param_groups]


def run_scheduler(vb, kind, method) -> dict:
    """The LRs a VariableBatchSizeLR sets: after construction, 8 steps, step(0), 2 steps."""
    opt = sgd()
    sched = vb.lr_scheduler_for_variable_batch_size(
        base_batch_size=4,
        batch_sizes=LR_BATCH_SIZES,
        dataloader=None,
        lr_scheduler_or_optimizer=base_scheduler(kind, opt),
        lr_scaling_method=method,
    )
    out = {"lrs": [lrs(opt)], "last_lr": [list(sched.get_last_lr())], "last_epoch": []}
    for epoch in [None] * 8 + [0, None, None]:
        opt.step()
        sched.step(epoch)
        out["lrs"].append(lrs(opt))
        out["last_lr"].append(list(sched.get_last_lr()))
        out["last_epoch"].append(sched.last_epoch)
    return out


def batches(loader) -> list:
    return [b for b in loader]


def run_loader(vb) -> dict:
    ids, sizes, maxlens = vb.batch_by_seqlens(SEQLENS, **LOADER)
    dataset = [sample(i) for i in range(len(SEQLENS))]
    out = {}
    for rank in (0, 1):
        loader, io_kwargs = vb.dataloader_for_variable_batch_size(
            dataset,
            ids,
            maxlens,
            dataloader_rank=rank,
            dataloader_batch_size=2,
            dataloader_num_replicas=2,
            dataloader_collate_fn=collate,
            dataloader_num_workers=0,
            required_microbatches_of_same_seqlen=True,
            sample_padding_fn=pad,
        )
        plain, _ = vb.dataloader_for_variable_batch_size(
            dataset,
            ids,
            maxlens,
            dataloader_rank=rank,
            dataloader_batch_size=2,
            dataloader_num_replicas=2,
            dataloader_num_workers=0,
        )
        out[rank] = {
            "padded": batches(loader),
            "plain": batches(plain),
            "io_kwargs": sorted(io_kwargs),
            "io_batch_size": io_kwargs["batch_size"],
            "io_workers": io_kwargs["num_local_io_workers"],
        }
    return out


def run_end_to_end(vb) -> dict:
    """get_dataloader_and_lr_scheduler_for_variable_batch_size with the example's arguments."""
    dataset = [sample(i) for i in range(len(SEQLENS))]
    out = {}
    for rank in (0, 1):
        opt = sgd()
        loader, sched, io_kwargs = vb.get_dataloader_and_lr_scheduler_for_variable_batch_size(
            dataset,
            SEQLENS,
            max_tokens=20,
            effective_batch_size=4,
            dataset_filter_ids=list(range(2, 46)),
            lr_scaling_method="sqrt",
            min_batch_size=1,
            max_batch_size=3,
            sequence_picking_order="random",
            dataloader_batch_size=1,
            dataloader_rank=rank,
            dataloader_num_replicas=2,
            dataloader_collate_fn=collate,
            lr_scheduler_or_optimizer=opt,
            required_microbatches_of_same_seqlen=True,
            sample_padding_fn=pad,
            seed=5,
        )
        seen, lr_steps = batches(loader), [lrs(opt)]
        for _ in range(5):
            sched.step()
            lr_steps.append(lrs(opt))
        out[rank] = {
            "batches": seen,
            "lrs": lr_steps,
            "batch_sizes": list(sched.batch_sizes),
            "io_workers": io_kwargs["num_local_io_workers"],
        }
    return out


ENGINE = dict(
    max_tokens=20,
    effective_batch_size=8,
    lr_scaling_method="sqrt",
    min_batch_size=1,
    max_batch_size=4,
    sequence_picking_order="random",
    dataloader_batch_size=2,
    dataloader_num_replicas=2,
    dataloader_num_workers=0,
    dataloader_pin_memory=False,
    required_microbatches_of_same_size=False,
    required_microbatches_of_same_seqlen=False,
    seed=7,
)
"""What get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed passes for an engine
without a pipeline, train_batch_size 8, micro-batch 2, 2 data-parallel ranks, an SGD optimizer
and no scheduler, and data_efficiency {seed: 7, data_sampling: {num_workers: 0,
dynamic_batching: {enabled, max_tokens: 20, lr_scaling_method: sqrt, max_batch_size: 4,
sequence_picking_order: random}}}."""


def run_engine_case(vb) -> dict:
    """What each rank's loader yields and the LR (group 0) after each of 6 scheduler steps."""
    dataset = [sample(i) for i in range(len(SEQLENS))]
    out = {}
    for rank in (0, 1):
        opt = sgd()
        loader, sched, _ = vb.get_dataloader_and_lr_scheduler_for_variable_batch_size(
            dataset,
            SEQLENS,
            dataloader_rank=rank,
            dataloader_collate_fn=collate,
            lr_scheduler_or_optimizer=opt,
            sample_padding_fn=pad,
            **ENGINE,
        )
        lr_steps = [opt.param_groups[0]["lr"]]
        for _ in range(6):
            sched.step()
            lr_steps.append(opt.param_groups[0]["lr"])
        out[rank] = {"batches": batches(loader), "lrs": lr_steps}
    return out


def jsonable(x):
    """Numbers as Python ints/floats, tuples as lists (DeepSpeed hands out numpy ints)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if hasattr(x, "item"):
        return x.item()
    return x


def run_batch_case(vb, kwargs: dict) -> dict:
    try:
        ids, sizes, maxlens = vb.batch_by_seqlens(SEQLENS, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the refusal is what is recorded
        return {"kwargs": kwargs, "error": type(exc).__name__}
    return {
        "kwargs": kwargs,
        "microbatch_ids": ids,
        "batch_sizes": sizes,
        "batch_max_seqlens": maxlens,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", required=True)
    args = parser.parse_args(argv)
    import deepspeed
    from deepspeed.runtime.data_pipeline.data_sampling import variable_batch_size_and_lr as vb

    record = {
        "command": "DS_ACCELERATOR=cpu .peers/bin/python scripts/variable_batch_golden.py "
        f"--write {args.write}",
        "versions": {"deepspeed": deepspeed.__version__, "torch": torch.__version__},
        "seqlens": SEQLENS,
        "batch_by_seqlens": {name: run_batch_case(vb, kw) for name, kw in BATCH_CASES.items()},
        "scale_lr": [[*case, vb.scale_lr(*case)] for case in SCALE_CASES],
        "lr_batch_sizes": LR_BATCH_SIZES,
        "scheduler": {
            name: {"base": kind, "method": method, **run_scheduler(vb, kind, method)}
            for name, (kind, method) in LR_CASES.items()
        },
        "loader": {"kwargs": LOADER, **run_loader(vb)},
        "end_to_end": run_end_to_end(vb),
        "engine": {"kwargs": ENGINE, **run_engine_case(vb)},
    }
    with open(args.write, "w") as f:
        f.write(json.dumps(jsonable(record)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
