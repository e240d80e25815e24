"""Every layout of a model on a machine: enumerate, drop the infeasible with the reason, rank.

The search space is the grid (tp x pp x dp = gpus), the ZeRO stage, the micro-batch, recompute
(none / selective / full) and optimizer offload. Rules, each a named reason when it drops a
family of layouts:

* tp divides the heads and stays inside a node (its all-reduces are on the critical path);
* pp divides the layers or is a power of two up to them (the busiest stage of an uneven split
  paces the step); under a pipeline zerostack runs ZeRO stage 0 or 1 (stages 2-3 are not
  searched there);
* dp divides the global batch and the micro-batch divides each rank's share;
* the predicted bytes per rank fit ``memory_fraction`` of the device (the rest is the allocator's
  and the framework's).

The feasible layouts are ranked by predicted step time (:func:`~.cost.predict`).
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field

from ..estimate import Transformer
from .cost import Candidate, Prediction, Software, predict
from .hardware import GB, Hardware, PlanError

RECOMPUTE = ("none", "selective", "full")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _pipeline_sizes(layers: int, devices: int) -> list[int]:
    """Pipeline sizes to try: every one that divides the ``devices`` left beside tp, up to one
    layer a stage (where the layers do not divide, an uneven split, priced by its busiest
    stage, as the engine's partition cuts it: 70 layers on 12 stages of 384 GPUs)."""
    return [pp for pp in _divisors(devices) if pp <= layers]


def _powers_of_two(limit: int) -> list[int]:
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out


@dataclass
class Plan:
    """Ranked feasible layouts, the families dropped (reason -> how many), the search time.
    A family is a grid shape (tp x pp): dropped when it cannot exist or none of its layouts
    (stage, micro-batch, recompute, offload) fits."""

    ranked: list[Prediction]
    dropped: dict[str, int] = field(default_factory=dict)
    considered: int = 0
    seconds: float = 0.0

    @property
    def best(self) -> Prediction:
        return self.ranked[0]


def search(
    m: Transformer,
    hw: Hardware,
    batch: int,
    *,
    precision: str = "bf16",
    memory_fraction: float = 0.9,
    offload: bool = True,
    software: Software | None = None,
    stages: tuple[int, ...] = (0, 1, 2, 3),
    recompute: tuple[str, ...] = RECOMPUTE,
    model_parallel: bool = True,
) -> Plan:
    """Every layout of ``m`` on ``hw.gpus`` devices for a global batch of ``batch`` sequences:
    ``software`` as implemented, ZeRO ``stages`` and ``recompute`` kinds among those given
    (what another system can run, when a plan is held to its published runs);
    ``model_parallel=False``: data parallelism alone (tp = pp = 1)."""
    t0 = time.perf_counter()
    software = software or Software()
    if batch < 1:
        raise PlanError(f"--batch: {batch} is not a positive number of sequences")
    dropped: Counter[str] = Counter()
    ranked: list[Prediction] = []
    considered = 0
    budget = memory_fraction * hw.memory_bytes
    smallest: dict[tuple[int, int], float] = {}  # (tp, pp) -> its smallest layout's bytes
    fits: set[tuple[int, int]] = set()
    for tp in _powers_of_two(hw.gpus if model_parallel else 1):
        if m.heads % tp:
            dropped[f"tp {tp}: does not divide {m.heads} heads"] += 1
            continue
        if tp > hw.gpus_per_node:
            dropped[f"tp {tp}: spans nodes ({hw.gpus_per_node} devices per node)"] += 1
            continue
        for pp in _pipeline_sizes(m.layers, hw.gpus // tp) if model_parallel else (1,):
            if hw.gpus % (tp * pp):
                continue  # not a grid of this many devices: not a layout at all
            dp = hw.gpus // (tp * pp)
            if batch % dp:
                dropped[f"dp {dp}: does not divide the batch of {batch}"] += 1
                continue
            per_rank = batch // dp
            allowed = [z for z in stages if pp == 1 or z <= software.pipeline_zero]
            for mb in _powers_of_two(per_rank):
                if per_rank % mb:
                    continue
                gas = per_rank // mb
                for stage, chunks in itertools.product(allowed, _chunks(m, pp, gas)):
                    wheres = ("none", "cpu") if offload and stage > 0 else ("none",)
                    for where, kind in itertools.product(wheres, recompute):
                        considered += 1
                        c = Candidate(
                            dp, tp, pp, stage, mb, gas, kind, where, precision, chunks, software
                        )
                        p = predict(m, batch, c, hw)
                        key = (tp, pp)
                        smallest[key] = min(smallest.get(key, p.memory_bytes), p.memory_bytes)
                        if p.memory_bytes <= budget:
                            fits.add(key)
                            ranked.append(p)
    for (tp, pp), least in smallest.items():
        if (tp, pp) not in fits:
            reason = f"tp {tp} x pp {pp}: its smallest layout needs {least / GB:.1f} GB per device"
            dropped[f"{reason} (> {budget / GB:.0f} GB usable)"] += 1
    if not ranked:
        reasons = "; ".join(f"{r} ({n})" for r, n in dropped.most_common(3))
        raise PlanError(f"no layout fits {hw.gpus} x {hw.name}: {reasons}")
    ranked.sort(key=lambda p: p.step_s)
    return Plan(ranked, dict(dropped), considered, time.perf_counter() - t0)


def _chunks(m: Transformer, pp: int, gas: int) -> tuple[int, ...]:
    """1F1B (one chunk per rank) and, where the micro-batches are a multiple of the stages and
    the layers divide evenly, interleaved with each chunk count up to 8 that divides a stage's
    layers (the engine's ``virtual_stages``; Megatron requires the same), the embedding and the
    output layer counted as layers where the split counts them (``ends_as_layers``)."""
    units = m.layers + (2 if m.ends_as_layers else 0)
    if pp == 1 or gas % pp or units % pp:
        return (1,)
    return (1, *(k for k in range(2, 9) if (units // pp) % k == 0))


def ds_config(p: Prediction, batch: int) -> dict:
    """The best layout as a ds_config that ``zerostack.initialize`` accepts unchanged."""
    c = p.candidate
    zero: dict = {"stage": c.stage}
    if c.offload != "none":
        zero["offload_optimizer"] = {"device": c.offload, "pin_memory": True}
    cfg: dict = {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": c.micro_batch,
        "gradient_accumulation_steps": c.gas,
        "zero_optimization": zero,
        c.precision: {"enabled": True},
    }
    if c.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": c.tp}
    if c.pp > 1:
        cfg["pipeline"] = {"stages": c.pp}
        if c.chunks > 1:
            cfg["pipeline"].update(schedule="interleaved", virtual_stages=c.chunks)
        if c.recompute == "full":
            cfg["pipeline"]["activation_checkpoint_interval"] = 1
    if c.recompute != "none":
        cfg["activation_checkpointing"] = {"partition_activations": c.tp > 1}
    return cfg


def torchrun_command(hw: Hardware, config_path: str) -> str:
    nodes = max(1, hw.gpus // hw.gpus_per_node)
    per_node = min(hw.gpus, hw.gpus_per_node)
    return (
        f"torchrun --nnodes {nodes} --nproc-per-node {per_node} "
        f"your_train.py --deepspeed_config {config_path}"
    )


def render(plan: Plan, hw: Hardware, top: int = 10) -> str:
    """The ranking (best first) and the dropped families."""
    lines = [
        f"{plan.considered} layouts considered on {hw.gpus} x {hw.name}"
        f"{' (nominal profile)' if hw.nominal else ' (calibrated)'} in {plan.seconds:.2f} s; "
        f"{len(plan.ranked)} fit",
        f"{'rank':>4} {'dp':>5} {'tp':>3} {'pp':>4} {'v':>2} {'zero':>4} {'mb':>3} {'gas':>5} "
        f"{'recompute':>9} {'offload':>7} | {'step s':>8} {'MFU':>6} {'GB/rank':>8}",
    ]
    for i, p in enumerate(plan.ranked[:top]):
        c = p.candidate
        lines.append(
            f"{i + 1:>4} {c.dp:>5} {c.tp:>3} {c.pp:>4} {c.chunks:>2} {c.stage:>4} "
            f"{c.micro_batch:>3} {c.gas:>5} {c.recompute:>9} {c.offload:>7} | {p.step_s:8.3f} "
            f"{p.mfu:6.1%} "
            f"{p.memory_bytes / GB:8.1f}"
        )
    if plan.dropped:
        lines.append("dropped:")
        for reason in sorted(plan.dropped, key=_natural):
            lines.append(f"  {reason}")
    return "\n".join(lines)


def _natural(text: str) -> list:
    """Sort key: numbers in ``text`` compare as numbers ("tp 2" before "tp 16")."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def as_json(plan: Plan, hw: Hardware, batch: int, top: int = 10) -> str:
    return json.dumps(
        {
            "hardware": {k: v for k, v in vars(hw).items()},
            "considered": plan.considered,
            "feasible": len(plan.ranked),
            "seconds": plan.seconds,
            "ranked": [p.as_dict() for p in plan.ranked[:top]],
            "dropped": plan.dropped,
            "ds_config": ds_config(plan.best, batch),
        }
    )
