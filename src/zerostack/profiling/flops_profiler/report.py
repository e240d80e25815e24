"""The printed profile, shaped like DeepSpeed's: a summary, the top modules per depth, the tree.

The tree is the model's ``repr`` with each module's figures in front of its own ``extra_repr``::

    GPT(
      118.53 K = 100% Params, 7.86 MMACs = 100% MACs, 6.01 ms = 100% latency, 2.62 GFLOPS
      (wte): InitEmbedding(16.38 K = 13.82% Params, 0 MACs = 0% MACs, ..., 256, 64)
      ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from .units import (
    PRECISION,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

if TYPE_CHECKING:
    from .profiler import FlopsProfiler

RULE = "-" * 78
_ROW = "{:<70}  {:<8}"


def _pct(part: float, whole: float) -> str:
    return f"{round(100 * part / whole, PRECISION) if whole else 0:g}%"


def _engine_sizes(engine: Any) -> dict[str, Any]:
    """World, data-parallel, model-parallel (tp) sizes and micro batch of a zerostack or
    DeepSpeed engine."""
    topology = getattr(engine, "topology", None)
    mp = getattr(engine, "mp_world_size", None) or getattr(topology, "tp", None) or 1
    world = getattr(engine, "world_size", None) or 1
    micro = getattr(engine, "train_micro_batch_size_per_gpu", None)
    return {
        "world size: ": world,
        "data parallel size: ": getattr(engine, "dp_world_size", None) or world // mp,
        "model parallel size: ": mp,
        "batch size per GPU: ": micro() if callable(micro) else micro,
    }


def summary(prof: FlopsProfiler, profile_step: int) -> list[str]:
    flops, macs = prof.get_total_flops(), prof.get_total_macs()
    params, latency = prof.get_total_params(), prof.get_total_duration()
    engine = prof.ds_engine
    sizes = _engine_sizes(engine) if engine is not None else {}
    mp = sizes.get("model parallel size: ", 1)
    lines = [
        "",
        "-------------------------- zerostack Flops Profiler --------------------------",
        f"Profile Summary at step {profile_step}:",
        "Notations: params (parameters), MACs (multiply-accumulates = flops / 2; only matrix",
        "products are counted), flops (floating-point operations), FLOPS (flops per second),",
        "fwd latency (wall time of the model's forward, device synchronised at each module).",
        "",
    ]
    lines += [_ROW.format(k, str(v)) for k, v in sizes.items()]
    rows = [
        ("params per GPU: ", params_to_string(params)),
        ("params of model = params per GPU * mp_size: ", params_to_string(params * mp)),
        ("fwd MACs per GPU: ", macs_to_string(macs)),
        ("fwd flops per GPU: ", number_to_string(flops)),
        ("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(flops * mp)),
        ("fwd latency: ", duration_to_string(latency)),
        (
            "fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ",
            flops_to_string(flops / latency if latency else 0),
        ),
    ]
    if engine is not None:
        factor = 3 + prof.recompute_fwd_factor
        rows.append(
            (
                f"fwd+bwd flops per GPU per step = {factor:g} * fwd flops per GPU: ",
                number_to_string(prof.get_step_flops()),
            )
        )
    return lines + [_ROW.format(k, v) for k, v in rows]


def _figures(prof: FlopsProfiler, module: nn.Module, totals: tuple[int, int, float]) -> str:
    params, flops, duration = (
        prof.profile_of(module).params,
        prof.flops_of(module),
        prof.duration_of(module),
    )
    macs = flops // 2
    all_params, all_macs, all_duration = totals
    return ", ".join(
        [
            f"{params_to_string(params)} = {_pct(params, all_params)} Params",
            f"{macs_to_string(macs)} = {_pct(macs, all_macs)} MACs",
            f"{duration_to_string(duration)} = {_pct(duration, all_duration)} latency",
            flops_to_string(round(flops / duration, PRECISION) if duration else 0),
        ]
    )


def module_tree(prof: FlopsProfiler) -> list[str]:
    totals = (prof.get_total_params(), prof.get_total_macs(), prof.get_total_duration())
    out: list[str] = []

    def walk(module: nn.Module, name: str, indent: str) -> None:
        desc = ", ".join(s for s in (_figures(prof, module, totals), module.extra_repr()) if s)
        head = f"{indent}({name}): " if name else indent
        head += f"{type(module).__name__}("
        children = list(module.named_children())
        if not children:
            out.append(f"{head}{desc})")
            return
        out.extend([head, f"{indent}  {desc}"])
        for child_name, child in children:
            walk(child, child_name, indent + "  ")
        out.append(f"{indent})")

    walk(prof.model, "", "")
    return out


def _by_depth(prof: FlopsProfiler) -> list[dict[str, list[float]]]:
    """Per depth, per module type: [MACs, params, latency] summed over its modules there."""
    levels: list[dict[str, list[float]]] = []

    def walk(module: nn.Module, depth: int) -> None:
        if depth == len(levels):
            levels.append({})
        sums = levels[depth].setdefault(type(module).__name__, [0, 0, 0.0])
        sums[0] += prof.flops_of(module) // 2
        sums[1] += prof.profile_of(module).params
        sums[2] += prof.duration_of(module)
        for child in module.children():
            walk(child, depth + 1)

    walk(prof.model, 0)
    return levels


def _top(sums: dict[str, list[float]], i: int, fmt, k: int) -> dict[str, str]:
    ranked = sorted(sums.items(), key=lambda kv: kv[1][i], reverse=True)[:k]
    return {name: fmt(v[i]) for name, v in ranked}


def aggregated_profile(prof: FlopsProfiler, module_depth: int, top_modules: int) -> str:
    levels = _by_depth(prof)
    last = len(levels) - 1 if module_depth < 0 else min(module_depth, len(levels) - 1)
    k = top_modules
    lines = [f"Top {k} modules in terms of params, MACs or fwd latency at different model depths:"]
    for depth, sums in enumerate(levels[: last + 1]):
        lines += [
            f"depth {depth}:",
            f"    params      - {_top(sums, 1, params_to_string, k)}",
            f"    MACs        - {_top(sums, 0, macs_to_string, k)}",
            f"    fwd latency - {_top(sums, 2, duration_to_string, k)}",
        ]
    return "\n".join(lines)


def model_profile(
    prof: FlopsProfiler, *, profile_step: int, module_depth: int, top_modules: int, detailed: bool
) -> str:
    lines = summary(prof, profile_step)
    lines += ["", "----------------------------- Aggregated Profile per GPU " + "-" * 21]
    lines.append(aggregated_profile(prof, module_depth, top_modules))
    if detailed:
        lines += [
            "",
            "------------------------------ Detailed Profile per GPU " + "-" * 22,
            "Each module: params, % of total params, MACs, % of total MACs, fwd latency,",
            "% of total fwd latency, fwd FLOPS; then its own description. A parent's figures",
            "include its children's and any work it does itself (e.g. the loss).",
            "",
        ]
        lines += module_tree(prof)
    lines.append(RULE)
    return "\n".join(lines)
