"""``zerostack plan``: every feasible layout of a model on a machine, ranked; the best as a
ds_config and the ``torchrun`` line that runs it."""

from __future__ import annotations

import json
import sys

from ..estimate import EstimateError, describe
from ..estimate.command import MODEL_KEYS, add_model_arguments
from .hardware import FABRICS, GB, PlanError, calibrate, profile
from .search import as_json, ds_config, render, search, torchrun_command


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="rank every feasible layout of a model on a machine by predicted step time",
        description="Enumerate tensor x pipeline x data parallelism, ZeRO stage, micro-batch, "
        "recompute and offload for a GPT-style model on a machine; drop what cannot exist or "
        "does not fit (saying why), rank the rest by predicted step time, and write the best as "
        "a ds_config that zerostack.initialize accepts unchanged.",
    )
    m = p.add_argument_group("the model")
    add_model_arguments(m)
    m.add_argument("--batch", type=int, required=True, help="global batch, in sequences")
    m.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="bf16")
    h = p.add_argument_group("the machine")
    h.add_argument("--hardware", default="a100-80gb", help="a bundled nominal profile")
    h.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine (and one of the model's layers) instead",
    )
    h.add_argument("--gpus", type=int, help="devices in all")
    h.add_argument("--gpus-per-node", type=int)
    h.add_argument("--gpu-memory", type=float, help="GB per device")
    h.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device")
    h.add_argument("--intra-bw", type=float, help="GB/s per device inside a node")
    h.add_argument("--inter-bw", type=float, help="GB/s per device between nodes")
    h.add_argument(
        "--fabric",
        choices=list(FABRICS),
        help="the network between nodes, in place of the profile's (its line rate per device)",
    )
    p.add_argument("--no-offload", action="store_true", help="do not consider optimizer offload")
    p.add_argument("--top", type=int, default=10, help="layouts to show")
    p.add_argument("--out", help="write the best layout's ds_config here")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _hardware(args, model):
    scale = {
        "gpus_per_node": args.gpus_per_node,
        "memory_bytes": args.gpu_memory * GB if args.gpu_memory else None,
        "peak_flops": args.peak_tflops * 1e12 if args.peak_tflops else None,
        "intra_bw": args.intra_bw * GB if args.intra_bw else None,
        "inter_bw": args.inter_bw * GB if args.inter_bw else None,
    }
    if args.fabric and args.inter_bw:
        raise PlanError("--fabric, --inter-bw: both set the bandwidth between nodes; give one")
    if args.calibrate:
        if args.fabric:
            raise PlanError("--fabric: --calibrate measures this machine's own links")
        hw = calibrate(gpus=args.gpus, model=model)
        changes = {k: v for k, v in scale.items() if v is not None}
        return hw.scaled(**changes) if changes else hw
    return profile(args.hardware, gpus=args.gpus, fabric=args.fabric, **scale)


def run(args) -> int:
    try:
        if args.hf_config is None and all(getattr(args, n) is None for n in MODEL_KEYS):
            raise PlanError("the model: give --layers ... --seq or --hf-config")
        _, model = describe(
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            vocab=args.vocab,
            seq=args.seq,
            hf_config=args.hf_config,
        )
        if model is None:
            raise PlanError(
                "the model: give --layers/--hidden/--heads/--vocab/--seq or --hf-config"
            )
        hw = _hardware(args, model)
        plan = search(model, hw, args.batch, precision=args.precision, offload=not args.no_offload)
    except (PlanError, EstimateError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if args.out:
        with open(args.out, "w") as f:
            json.dump(ds_config(plan.best, args.batch), f, indent=2)
    if args.json:
        print(as_json(plan, hw, args.batch, args.top))
        return 0
    print(render(plan, hw, args.top))
    if args.out:
        print(
            f"best layout written to {args.out}; run it with:\n  {torchrun_command(hw, args.out)}"
        )
    return 0
