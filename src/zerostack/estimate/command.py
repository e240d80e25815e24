"""``zerostack estimate``: the command line of :mod:`zerostack.estimate`."""

from __future__ import annotations

import json
import sys

from zerostack import estimate as est

MODEL_KEYS = ("layers", "hidden", "heads", "vocab", "seq")


def add_model_arguments(group) -> None:
    """A GPT-style description (``--layers ... --seq``) or a Hugging Face ``--hf-config``."""
    for name in MODEL_KEYS:
        group.add_argument(f"--{name}", type=int)
    group.add_argument("--hf-config", help="a Hugging Face config.json (--seq overrides it)")


def add_parser(sub) -> None:
    e = sub.add_parser(
        "estimate",
        help="bytes per rank of a layout: model states, activations, buffers",
        description="Per-rank memory of a training layout, before running it: parameters, "
        "gradients, fp32 masters and optimizer state as zerostack holds them (and the ZeRO "
        "paper's accounting), activations (Korthikanti et al.) and transient buffers. Give the "
        "model as --params, as a GPT-style description or as a Hugging Face config.json.",
    )
    m = e.add_argument_group("the model")
    m.add_argument("--params", type=float, help="trainable parameters, e.g. 7.5e9")
    m.add_argument(
        "--expert-params", type=float, default=0, help="of them, a MoE model's experts (all)"
    )
    add_model_arguments(m)
    m.add_argument("--dropout", action="store_true", help="count dropout masks")
    g = e.add_argument_group("the layout")
    g.add_argument("--world", type=int, default=1, help="ranks in all")
    g.add_argument("--tp", type=int, default=1)
    g.add_argument("--pp", type=int, default=1)
    g.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (MoE ep_size)")
    g.add_argument("--sp", type=int, default=1, help="Ulysses ranks (sequence_parallel_size)")
    g.add_argument("--stage", choices=["0", "1", "2", "3", "all"], default="all")
    g.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp16")
    g.add_argument(
        "--optimizer", default="adam", help="adam, adamw, lamb, adagrad, lion, momentum, sgd"
    )
    g.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"], default="none")
    g.add_argument("--offload-param", choices=["none", "cpu", "nvme"], default="none")
    w = e.add_argument_group("the step")
    w.add_argument("--micro-batch", type=int, default=1)
    w.add_argument("--gas", type=int, default=1, help="gradient accumulation steps")
    w.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    w.add_argument("--sequence-parallel", action="store_true")
    e.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    try:
        params, model = est.describe(
            params=args.params,
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            vocab=args.vocab,
            seq=args.seq,
            hf_config=args.hf_config,
            dropout=args.dropout,
        )
        stages = [0, 1, 2, 3] if args.stage == "all" else [int(args.stage)]
        if args.stage == "all":  # only the stages that can offload what is asked
            lowest = 3 if args.offload_param != "none" else 1
            if args.offload_optimizer != "none" or args.offload_param != "none":
                stages = [s for s in stages if s >= lowest]
        layouts = est.layouts_for(
            args.world,
            args.tp,
            args.pp,
            stages,
            ep=args.ep,
            sp=args.sp,
            precision=args.precision,
            optimizer=args.optimizer,
            offload_optimizer=args.offload_optimizer,
            offload_param=args.offload_param,
        )
        work = est.Workload(
            micro_batch=args.micro_batch,
            gas=args.gas,
            recompute=args.recompute,
            sequence_parallel=args.sequence_parallel,
        )
        experts = int(args.expert_params)
        results = [
            est.estimate(params, lay, model=model, work=work, experts=experts) for lay in layouts
        ]
    except est.EstimateError as exc:
        print(f"EstimateError: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"stages": {str(r["layout"]["stage"]): r for r in results}}))
    else:
        print(est.render(results))
    return 0
