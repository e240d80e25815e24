"""A dry run: the real engine built and stepped as one rank of a large world, in one process.

torch's ``fake`` process group answers every collective at once and moves nothing; the model is
built on the meta device (shapes and dtypes, no storage), and the engine, built and run inside
:func:`zerostack.topology.on_meta`, keeps all its own tensors there too. So zerostack's own code
partitions, slices, buckets and issues its collectives for rank ``rank`` of ``world`` exactly as
it would on the cluster, at any model size, in a few seconds and a few hundred MB of host memory.

What one step reports, for comparison with the arithmetic of ``zerostack estimate`` and
``zerostack plan``: the rank's model-state bytes by kind (``engine.memory_breakdown()``, the
census of the tensors it holds), every collective the step issued, by kind, axis and bytes (the
CommLog, which records what was asked of the process group), and the activation bytes the first
micro-batch's forward keeps for backward (a census of what autograd saves: each storage once,
parameters apart), for one transformer block and for the whole forward.

Attention and dropout are counted as a GPU's kernels keep them, whatever this machine's torch
would do with meta tensors (:class:`_AsOnGPU`): ``scaled_dot_product_attention`` without a mask
keeps what FlashAttention keeps, its query, key, value, output (laid out (batch, sequence,
heads, head size), so the output projection reads it without a copy) and the fp32 log-sum-exp
per head and token; dropout keeps a 1-byte mask.

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
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from .estimate.command import MODEL_KEYS, add_model_arguments
from .pipeline.module import PipelineModule
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
    activations: dict[str, int] = field(default_factory=dict)  # "layer", "forward": bytes
    flash: bool = True  # every attention was counted as FlashAttention keeps it
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
            self._activation_line(),
            "one step's collectives:",
        ]
        for (op, axis), (n, b) in self.collectives.items():
            lines.append(f"  {op:>15} over {axis:<3} {n:>6} calls {b / GB:12.3f} GB")
        return "\n".join(lines)

    def _activation_line(self) -> str:
        from .plan.hardware import GB

        if not self.activations:
            return "activations: not counted for a pipeline yet"
        a = self.activations
        block = f"{a['layer']:,}" if "layer" in a else "(no repeated blocks found)"
        how = (
            "attention as FlashAttention keeps it"
            if self.flash
            else "attention as torch ran it on meta tensors: a mask was given"
        )
        return (
            f"activations kept for backward (one micro-batch): one block {block}, the whole "
            f"forward {a['forward'] / GB:.3f} GB ({how})"
        )

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
            "activations": self.activations,
            "flash": self.flash,
            "seconds": self.seconds,
            "peak_rss_bytes": self.peak_rss_bytes,
        }


def add_parser(sub) -> None:
    p = sub.add_parser(
        "dryrun",
        help="build and step the real engine as one rank of a large world, without the world",
        description="Build zerostack's engine for one rank of --world ranks in this process "
        "(torch's fake process group, the model on the meta device) and run one optimizer "
        "step: the rank's model-state bytes, the activations its forward keeps for backward "
        "(as a GPU's FlashAttention would) and every collective the step issues, by kind, "
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


class _FlashAttention(torch.autograd.Function):
    """Attention as FlashAttention keeps it for backward, in shapes only (meta tensors): the
    query, key and value, the output (its storage laid out (batch, sequence, heads, head size),
    as the CUDA kernel writes it) and the fp32 log-sum-exp per head and token."""

    @staticmethod
    def forward(ctx, q, k, v):
        b, heads, s, _ = q.shape
        out = q.new_empty(b, s, heads, v.shape[-1]).transpose(1, 2)
        lse = q.new_empty(b, heads, s, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _AsOnGPU:
    """For the dry run's length, two functions of ``torch.nn.functional`` keep for backward
    what a GPU's kernels keep, not what this machine's torch would for meta tensors:

    * ``scaled_dot_product_attention`` on 4-d meta tensors without a mask (causal or not,
      grouped-query or not) is :class:`_FlashAttention` (torch's math path would keep the s x s
      scores); with a mask it is torch's (which keeps them, as it would on a GPU too) and
      ``flash`` turns False;
    * ``dropout`` in training keeps a 1-byte mask (``torch.native_dropout``, the fused kernel a
      GPU runs), not a noise tensor in the compute dtype.

    The module attributes are replaced, not a torch function mode: modes are per thread, and
    autograd may run a recomputed forward (activation checkpointing) on its own."""

    def __init__(self) -> None:
        self.flash = True
        self.real = F.scaled_dot_product_attention, F.dropout

    def attention(self, query, key, value, attn_mask=None, *args, **kwargs):
        if attn_mask is None and query.is_meta and query.dim() == 4:
            return _FlashAttention.apply(query, key, value)
        self.flash = False
        return self.real[0](query, key, value, attn_mask, *args, **kwargs)

    def dropout(self, input, p=0.5, training=True, inplace=False):
        if input.is_meta and training and 0 < p < 1 and not inplace:
            return torch.native_dropout(input, p, True)[0]
        return self.real[1](input, p, training, inplace)

    def __enter__(self) -> _AsOnGPU:
        F.scaled_dot_product_attention, F.dropout = self.attention, self.dropout
        return self

    def __exit__(self, *_) -> None:
        F.scaled_dot_product_attention, F.dropout = self.real


class _Census:
    """The storages autograd saves for backward during the model's first forward, each counted
    once, parameters (and the full weights stage 3 gathers into them), integer tensors and
    scalars apart, as ``zerostack estimate`` counts activations (dropout's boolean masks
    count): in all, and in spans cut where each repeated block (of the longest
    ``nn.ModuleList`` of one class) returns, so a block's span holds what it saves and what is
    saved on the way into it (a checkpoint keeping the block's input, before the block runs)."""

    def __init__(self, model: nn.Module | None) -> None:
        self.recording = False
        self.whole: dict[int, int] = {}
        self.spans: list[dict[int, int]] = []
        self.handles = []
        if model is None:  # a pipeline: its forward runs chunk by chunk (not counted yet)
            return
        self.handles += [
            model.register_forward_pre_hook(self._start),
            model.register_forward_hook(self._stop),
        ]
        lists = [
            m
            for m in model.modules()
            if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1
        ]
        for block in max(lists, key=len, default=[]):
            self.handles.append(block.register_forward_hook(self._cut))

    def _start(self, *_) -> None:
        if not self.spans:  # the first forward only
            self.recording = True
            self.spans.append({})

    def _stop(self, *_) -> None:
        self.recording = False

    def _cut(self, *_) -> None:
        if self.recording:
            self.spans.append({})

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base  # a weight is saved as a view (transposed)
        weight = isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)
        # token ids and targets (integers) and the loss's normalizer (a scalar); masks count
        bookkeeping = t.dim() == 0 or not (t.is_floating_point() or t.dtype == torch.bool)
        if self.recording and not weight and not bookkeeping:
            storage = t.untyped_storage()
            self.whole.setdefault(storage._cdata, storage.nbytes())
            self.spans[-1].setdefault(storage._cdata, storage.nbytes())
        return t

    def figures(self) -> dict[str, int]:
        """``forward``: bytes in all; ``layer``: what the second block's span keeps that the
        first's did not (so what every block shares, as rotary tables, is not counted)."""
        for h in self.handles:
            h.remove()
        if not self.handles:
            return {}
        out = {"forward": sum(self.whole.values())}
        if len(self.spans) > 2:  # two blocks' spans and the rest
            first, second = self.spans[:2]
            out["layer"] = sum(n for key, n in second.items() if key not in first)
        return out


def _tally(records) -> dict[tuple[str, str], tuple[int, int]]:
    count: Counter = Counter()
    size: Counter = Counter()
    for r in records:
        count[r.op, r.axis] += 1
        size[r.op, r.axis] += r.bytes
    return {key: (count[key], size[key]) for key in sorted(count)}


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


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
    micro-batch of ``seq`` tokens through gradient accumulation's boundary; a
    :class:`~zerostack.pipeline.PipelineModule`, one ``train_batch``, ``step`` called once), and
    tear the group down. The config's ``watchdog`` is switched off (its heartbeats need a real
    store). ``build`` runs after the group exists, so it may build a topology (a pipeline's).
    A pipeline's activations are not counted yet (``activations`` is empty)."""
    from .compat.deepspeed import native_initialize  # zerostack.initialize
    from .topology import on_meta

    t0 = time.perf_counter()
    _fake_world(rank, world)
    try:
        cfg = {**config, "watchdog": {"enabled": False}}
        with on_meta():
            with torch.device("meta"):
                model = build()
            engine, *_ = native_initialize(model=model, config=cfg)
            topo = engine.topology
            setup = len(engine.comm.log.records)
            micro, gas = (
                engine.train_micro_batch_size_per_gpu(),
                engine.gradient_accumulation_steps(),
            )
            pipeline = isinstance(engine.module, PipelineModule)
            census = _Census(None if pipeline else engine.module)
            with _AsOnGPU() as kernels, saved_tensors_hooks(census.pack, _unpack):
                if step is not None:
                    for _ in range(1 if pipeline else gas):
                        step(engine)
                elif pipeline:  # one train_batch runs the accumulation's micro-batches
                    x = torch.zeros(micro, seq, dtype=torch.long, device="meta")
                    engine.train_batch(iter([(x, x)] * gas))
                else:
                    for _ in range(gas):
                        default_step(engine, seq, micro)
            records = engine.comm.log.records
            out = DryRun(
                world=world,
                rank=rank,
                grid={"dp": topo.dp, "tp": topo.tp, "pp": topo.pp},
                stage=engine.zero_optimization_stage(),
                model_states=engine.memory_breakdown(),
                collectives=_tally(records[setup:]),
                setup=_tally(records[:setup]),
                activations=census.figures(),
                flash=kernels.flash,
            )
            engine.destroy()
    finally:
        dist.destroy_process_group()
    out.seconds = time.perf_counter() - t0
    out.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out
