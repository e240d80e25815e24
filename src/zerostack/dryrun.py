"""A dry run: the real engine built and stepped as one rank of a large world, in one process.

torch's ``fake`` process group answers every collective at once and moves nothing; the model is
built on the meta device (shapes and dtypes, no storage), and the engine, built and run inside
:func:`zerostack.topology.on_meta`, keeps all its own tensors there too. So zerostack's own code
partitions, slices, buckets and issues its collectives for rank ``rank`` of ``world`` exactly as
it would on the cluster, at any model size, in a few seconds and a few hundred MB of host memory.

What one step reports, for comparison with the arithmetic of ``zerostack estimate`` and
``zerostack plan``: the rank's model-state bytes by kind (``engine.memory_breakdown()``, the
census of the tensors it holds), and every collective the step issued, by kind, axis and bytes
(the CommLog, which records what was asked of the process group).

Values are not computed: a dry run says how much and how many, never what (the loss is a meta
tensor; the gradient norm reads as 0, so nothing is clipped and no step is skipped).
"""

from __future__ import annotations

import resource
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .estimate.command import MODEL_KEYS, add_model_arguments
from .plan.hardware import PlanError


@dataclass
class DryRun:
    """One rank's figures: its grid, the bytes it holds by kind, one step's collectives by
    ``(op, axis)`` (count and bytes; set-up broadcasts apart), time and peak host memory."""

    world: int
    rank: int
    grid: dict[str, int]
    stage: int
    model_states: dict[str, int]
    collectives: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    setup: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    seconds: float = 0.0
    peak_rss_bytes: int = 0

    def render(self) -> str:
        """The figures as lines: the grid, the model-state bytes, one step's collectives."""
        from .plan.hardware import GB

        grid = " x ".join(f"{k} {v}" for k, v in self.grid.items())
        lines = [
            f"rank {self.rank} of {self.world} ({grid}, ZeRO stage {self.stage}): built and "
            f"stepped in "
            f"{self.seconds:.1f} s, peak host memory {self.peak_rss_bytes / GB:.2f} GB",
            "model states (bytes): "
            + ", ".join(f"{k} {v:,}" for k, v in self.model_states.items())
            + f"; total {sum(self.model_states.values()) / GB:.3f} GB",
            "one step's collectives:",
        ]
        for (op, axis), (n, b) in self.collectives.items():
            lines.append(f"  {op:>15} over {axis:<3} {n:>6} calls {b / GB:12.3f} GB")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        def flat(d):
            return {f"{op}/{axis}": {"count": n, "bytes": b} for (op, axis), (n, b) in d.items()}

        return {
            "world": self.world,
            "rank": self.rank,
            "grid": self.grid,
            "stage": self.stage,
            "model_states": self.model_states,
            "collectives": flat(self.collectives),
            "setup": flat(self.setup),
            "seconds": self.seconds,
            "peak_rss_bytes": self.peak_rss_bytes,
        }


def add_parser(sub) -> None:
    p = sub.add_parser(
        "dryrun",
        help="build and step the real engine as one rank of a large world, without the world",
        description="Build zerostack's engine for one rank of --world ranks in this process "
        "(torch's fake process group, the model on the meta device) and run one optimizer "
        "step: the rank's model-state bytes and every collective the step issues, by kind, "
        "axis and bytes. No data and no devices: a 70B model at 1,024 ranks takes seconds.",
    )
    p.add_argument("config", help="the ds_config (JSON) to initialize with")
    p.add_argument("--world", type=int, required=True, help="ranks in all")
    p.add_argument("--rank", type=int, default=0, help="the rank to build (default 0)")
    add_model_arguments(p.add_argument_group("the model (zerostack's GPT, or --hf-config)"))
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    """``zerostack dryrun``: exit 2 with one line on bad input."""
    import json
    import sys

    try:
        with open(args.config) as f:
            config = json.load(f)
        build, seq = _model_of(args)
        result = dry_run(build, config, world=args.world, rank=args.rank, seq=seq)
    except (OSError, json.JSONDecodeError, PlanError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_dict()) if args.json else result.render())
    return 0


def _model_of(args):
    """A builder of the model the command line names, and its sequence length."""
    if args.hf_config:
        import json

        from transformers import AutoConfig, AutoModelForCausalLM

        with open(args.hf_config) as f:
            raw = json.load(f)
        config = AutoConfig.for_model(**raw)
        seq = args.seq or raw.get("max_position_embeddings")
        if not seq:
            raise PlanError("--seq: the config names no max_position_embeddings; give one")
        return (lambda: AutoModelForCausalLM.from_config(config)), seq
    shape = {n: getattr(args, n) for n in MODEL_KEYS}
    missing = [n for n, v in shape.items() if v is None]
    if missing:
        raise PlanError(f"--{missing[0]}: needed for the reference GPT (or give --hf-config)")
    from .models import GPT, GPTConfig

    cfg = GPTConfig(
        vocab_size=shape["vocab"],
        block_size=shape["seq"],
        n_layer=shape["layers"],
        n_head=shape["heads"],
        d_model=shape["hidden"],
    )
    return (lambda: GPT(cfg)), shape["seq"]


def _fake_world(rank: int, world: int) -> None:
    if not 0 <= rank < world:
        raise PlanError(f"--rank: {rank} is not in 0..{world - 1}")
    if dist.is_initialized():
        raise PlanError("dry run: a process group is already initialised in this process")
    try:  # registers the "fake" backend with torch.distributed
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as exc:  # pragma: no cover - every torch this library supports has it
        raise PlanError(f"dry run: this torch has no fake process group ({exc})") from exc
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def _tally(records) -> dict[tuple[str, str], tuple[int, int]]:
    count: Counter = Counter()
    size: Counter = Counter()
    for r in records:
        count[r.op, r.axis] += 1
        size[r.op, r.axis] += r.bytes
    return {key: (count[key], size[key]) for key in sorted(count)}


def default_step(engine, seq: int, micro_batch: int) -> None:
    """Forward, backward and step on one micro-batch of token ids: a Hugging Face causal LM
    (``input_ids`` and ``labels``, its ``loss``) or zerostack's GPT (``engine(x, y)``)."""
    x = torch.zeros(micro_batch, seq, dtype=torch.long, device="meta")
    if hasattr(engine.module, "config") and hasattr(engine.module.config, "model_type"):
        loss = engine(input_ids=x, labels=x).loss
    else:
        loss = engine(x, x)
    engine.backward(loss)
    engine.step()


def dry_run(
    build: Callable[[], nn.Module],
    config: dict,
    *,
    world: int,
    rank: int = 0,
    seq: int,
    step: Callable | None = None,
) -> DryRun:
    """Build ``build()`` on the meta device, ``zerostack.initialize`` it with ``config`` as rank
    ``rank`` of ``world`` under the fake process group, run ``step(engine)`` (default: one
    micro-batch of ``seq`` tokens through gradient accumulation's boundary), and tear the group
    down. The config's ``watchdog`` is switched off (its heartbeats need a real store)."""
    from .compat.deepspeed import native_initialize  # zerostack.initialize
    from .topology import on_meta

    t0 = time.perf_counter()
    _fake_world(rank, world)
    try:
        with torch.device("meta"):
            model = build()
        cfg = {**config, "watchdog": {"enabled": False}}
        with on_meta():
            engine, *_ = native_initialize(model=model, config=cfg)
            topo = engine.topology
            setup = len(engine.comm.log.records)
            micro = engine.train_micro_batch_size_per_gpu()
            for _ in range(engine.gradient_accumulation_steps()):
                if step is None:
                    default_step(engine, seq, micro)
                else:
                    step(engine)
            records = engine.comm.log.records
            out = DryRun(
                world=world,
                rank=rank,
                grid={"dp": topo.dp, "tp": topo.tp, "pp": topo.pp},
                stage=engine.zero_optimization_stage(),
                model_states=engine.memory_breakdown(),
                collectives=_tally(records[setup:]),
                setup=_tally(records[:setup]),
            )
            engine.destroy()
    finally:
        dist.destroy_process_group()
    out.seconds = time.perf_counter() - t0
    out.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out
