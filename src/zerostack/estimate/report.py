"""One layout's estimate (model states, activations, buffers) and the ``zerostack estimate``
command's model description and table."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass

from torch import nn

from ..zero.stage3.coordinator import PREFETCH_UNITS
from .activations import Transformer, stage_activation_bytes
from .memory import (
    GIB,
    OPTIMIZER_STATE_BYTES,
    PRECISION_BYTES,
    EstimateError,
    Layout,
    _ceil_div,
    model_states,
    zero_paper_bytes,
)


@dataclass(frozen=True)
class Workload:
    """What one optimizer step runs: micro-batch, accumulation, recompute."""

    micro_batch: int = 1
    gas: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    flash: bool = True  # torch's scaled_dot_product_attention keeps no s x s scores
    fused_mlp: bool = False  # a gated MLP's activation as one kernel (Megatron's SwiGLU)
    distribute_saved: bool = False  # full recompute's kept inputs split over tp (Megatron's
    # --distribute-saved-activations)
    in_flight: float = 0.0  # micro-batches the first pipeline stage holds (0: 1F1B's min(pp, gas))
    reduce_bucket: int = 500_000_000  # zero_optimization.reduce_bucket_size (elements)
    prefetch_bucket: int | None = None  # stage3_prefetch_bucket_size (None: 2 largest modules)
    persistence_threshold: int = 100_000  # stage3_param_persistence_threshold (elements)


def _buffers(params: int, largest: int, layout: Layout, work: Workload) -> int:
    """Transient communication buffers at their peak, compute dtype, beyond the one bucket
    stages 1-2 keep between steps (``model_states``' ``scratch``, which is the bucket stage 2
    stages its gradients in): stage 3 holds a module's gathered weights, the prefetched ones and
    a reduce bucket."""
    c = PRECISION_BYTES[layout.precision]
    if layout.stage == 3:
        ahead = work.prefetch_bucket
        if ahead is None:
            ahead = PREFETCH_UNITS * largest
        return c * (largest + min(ahead, params) + min(work.reduce_bucket, params))
    return 0


def estimate(
    params: int | None = None,
    layout: Layout | None = None,
    *,
    model: Transformer | None = None,
    work: Workload | None = None,
    largest_layer: int | None = None,
    frozen: int = 0,
    experts: int = 0,
) -> dict:
    """Per-rank bytes for one layout: model states (zerostack's layout and the ZeRO paper's),
    activations of the busiest pipeline stage (given a :class:`Transformer`; with Ulysses,
    ``layout.sp``, each rank's shard of the sequence), transient buffers.

    ``params``: trainable parameters of the whole model (default: ``model.params``), split evenly
    over tp x pp (a transformer's embedding and layers split nearly so). ``experts``: how many
    of them are a MoE model's experts, which are split over ``layout.ep`` x pp and held whole
    on every tp rank (zerostack replicates experts over tp), their state cut over dp while the
    rest is cut over dp x ep."""
    layout = layout or Layout()
    work = work or Workload()
    if params is None:
        if model is None:
            raise EstimateError("params: give a parameter count or a model description")
        params = model.params
    if params <= 0:
        raise EstimateError(f"params: {params} is not a positive count")
    if not 0 <= experts <= params:
        raise EstimateError(f"experts: {experts} is not a count within params {params}")
    if experts and model is not None:
        raise EstimateError("experts: give them with a parameter count (a description has none)")
    if layout.ep > 1 and not experts:
        raise EstimateError(f"ep: {layout.ep} ranks split the experts; how many parameters are?")
    mp = layout.tp * layout.pp
    own_experts = _ceil_div(int(experts), layout.ep * layout.pp)
    local, sizes, persistent = _ceil_div(int(params - experts), mp) + own_experts, None, 0
    if model is not None and params == model.params:  # the tensors this rank holds, exactly
        stages = [model.rank_tensors(layout.tp, layout.pp, s) for s in range(layout.pp)]
        sizes = max(stages, key=sum)  # the pipeline stage holding the most
        local = sum(sizes)
        if layout.stage == 3:
            persistent = sum(n for n in sizes if n < work.persistence_threshold)
    largest = largest_layer if largest_layer is not None else _largest(model, local, layout)
    states = model_states(
        local,
        layout,
        frozen=_ceil_div(frozen, mp),
        sizes=sizes,
        persistent=persistent,
        bucket=work.reduce_bucket,
        experts=own_experts,
    )
    out = {
        "layout": {**asdict(layout), "world": layout.world},
        "params": int(params),
        "params_per_model_parallel_rank": local,
        "experts_per_rank": own_experts,
        "model_states": states.as_dict(),
        "model_states_bytes_per_rank": states.device,
        "zero_paper_bytes_per_rank": zero_paper_bytes(
            local, layout.dp, layout.stage, k=4 + OPTIMIZER_STATE_BYTES[layout.optimizer]
        ),
        "buffer_bytes_per_rank": _buffers(local, largest, layout, work),
    }
    if model is not None:
        in_flight = work.in_flight or min(layout.pp, work.gas)  # 1F1B: pp on the first stage
        out["activation_bytes_per_rank"] = stage_activation_bytes(
            _sequence_shard(model, layout.sp),
            work.micro_batch,
            tp=layout.tp,
            pp=layout.pp,
            stage=0,  # the first stage holds the most micro-batches
            in_flight=in_flight,
            sequence_parallel=work.sequence_parallel,
            recompute=work.recompute,
            dtype_bytes=PRECISION_BYTES[layout.precision],
            flash=work.flash,
            fused_mlp=work.fused_mlp,
            distribute_saved=work.distribute_saved,
        )
        out["workload"] = asdict(work)
    out["total_bytes_per_rank"] = (
        out["model_states_bytes_per_rank"]
        + out["buffer_bytes_per_rank"]
        + out.get("activation_bytes_per_rank", 0)
    )
    return out


def _sequence_shard(model: Transformer, sp: int) -> Transformer:
    """What one of ``sp`` Ulysses ranks holds activations for: ``seq / sp`` positions of every
    layer (attention holds all of them for ``heads / sp`` heads: the same bytes)."""
    if sp == 1:
        return model
    if model.seq % sp or model.heads % sp:
        raise EstimateError(
            f"sp: {sp} Ulysses ranks split neither seq {model.seq} nor heads {model.heads} evenly"
        )
    return dataclasses.replace(model, seq=model.seq // sp)


def _largest(model: Transformer | None, local: int, layout: Layout) -> int:
    """The largest module's parameters on one rank (stage 3 gathers one at a time)."""
    if model is None:
        return 0
    h = model.hidden
    return max(model.vocab * h, 2 * h * model.ffn_hidden + 4 * h * h) // layout.tp


def count_parameters(module: nn.Module) -> tuple[int, int, int]:
    """``(trainable, frozen, largest module's own)`` parameter counts, shared ones once."""
    seen: dict[int, nn.Parameter] = {}
    for p in module.parameters():
        seen.setdefault(id(p), p)
    trained = sum(p.numel() for p in seen.values() if p.requires_grad)
    frozen = sum(p.numel() for p in seen.values() if not p.requires_grad)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules())
    return trained, frozen, largest


def describe(
    *,
    params: float | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    vocab: int | None = None,
    seq: int | None = None,
    hf_config: str | None = None,
    dropout: bool = False,
) -> tuple[int | None, Transformer | None]:
    """The model from the command line: a parameter count, a GPT-style description, or a
    Hugging Face ``config.json`` (``seq`` overrides its length)."""
    shape = [layers, hidden, heads, vocab, seq]
    if hf_config is not None:
        try:
            with open(hf_config) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise EstimateError(f"--hf-config: {hf_config}: {exc}") from None
        model = Transformer.from_hf_config(config, seq)
        return (int(params) if params else None), _with_dropout(model, dropout)
    if any(v is not None for v in shape):
        names = ("layers", "hidden", "heads", "vocab", "seq")
        missing = [n for n, v in zip(names, shape, strict=True) if v is None]
        if missing:
            raise EstimateError(f"--{missing[0]}: needed with a model description")
        model = Transformer(layers, hidden, heads, vocab, seq, dropout=dropout)
        return (int(params) if params else None), model
    if params is None:
        raise EstimateError("--params: give it, a model description (--layers ...) or --hf-config")
    return int(params), None


def _with_dropout(model: Transformer, dropout: bool) -> Transformer:
    return dataclasses.replace(model, dropout=dropout)


def layouts_for(
    world: int, tp: int, pp: int, stages: list[int], ep: int = 1, **options
) -> list[Layout]:
    """One layout per stage for ``world`` ranks split as dp x ep x tp x pp."""
    if world % (tp * pp * ep):
        split = f"tp {tp} x pp {pp}" + (f" x ep {ep}" if ep > 1 else "")
        raise EstimateError(f"--world: {world} ranks cannot be split as {split}")
    dp = world // (tp * pp * ep)
    return [Layout(dp=dp, tp=tp, pp=pp, ep=ep, stage=s, **options) for s in stages]


def render(results: list[dict]) -> str:
    """A table, one row per layout, in GiB (ep and sp columns where a layout has them)."""
    extra = [a for a in ("ep", "sp") if any(r["layout"][a] > 1 for r in results)]
    head = f"{'stage':>5} {'dp':>5} {'tp':>3} {'pp':>3}" + "".join(f" {a:>3}" for a in extra)
    head += f" | {'states':>9} {'(paper)':>9} {'activ.':>9} {'buffers':>9} {'total':>9}"
    head += f" | {'host':>9}"
    lines = [head, "-" * len(head)]
    for r in results:
        lay = r["layout"]
        host = sum(r["model_states"]["host"].values())
        act = r.get("activation_bytes_per_rank")
        cells = [
            r["model_states_bytes_per_rank"],
            r["zero_paper_bytes_per_rank"],
            act,
            r["buffer_bytes_per_rank"],
            r["total_bytes_per_rank"],
        ]
        text = " ".join(f"{'-' if v is None else f'{v / GIB:8.2f}G':>9}" for v in cells)
        grid = f"{lay['stage']:>5} {lay['dp']:>5} {lay['tp']:>3} {lay['pp']:>3}"
        grid += "".join(f" {lay[a]:>3}" for a in extra)
        lines.append(f"{grid} | {text} | {host / GIB:8.2f}G")
    lines.append(
        "states: parameters, gradients, fp32 masters and optimizer state as zerostack holds them "
        "(paper: the ZeRO paper's accounting, 16-bit gradients); activations of the busiest "
        "pipeline stage (Korthikanti et al.); GiB per rank."
    )
    return "\n".join(lines)
