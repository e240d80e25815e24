"""The composition matrix: every combination of the grid's axes, ZeRO stage, precision and
offload that fits in 4 ranks, either trained against single-process training or refused.

A combination (:class:`Combo`) is a layout of the grid (pp, dp, ep, tp, and the sequence-parallel
sp inside dp: ``pp * dp * ep * tp`` ranks; of sp, ``ring`` ring-attention ranks, the rest
Ulysses'), Megatron's sequence parallelism (under tp), the pipeline's
schedule (1F1B, interleaved over 2 chunks), the ZeRO stage, fp32 or bf16, and the optimizer
offloaded to the CPU or not. The model is the reference GPT (4 blocks, 4 heads, d 32); at ep > 1
every second block is a mixture of 4 experts. Each combination either runs 3 plain-SGD steps
(no clipping, 2 micro-batches a step, ``max(2, pp)`` under a pipeline) and matches one process
training on the whole batch, or is refused with a ``ConfigError`` before any work whose one line
names two of the combination's settings. Nothing else is an outcome: an exception of another
kind, a mismatch or a hang fails the test.

Each rank compares its own parameters with the reference and sends back figures, not tensors
(``stats``): per parameter and step the relative difference, and the squared error of the
update and the update's squared norm (bf16 is judged on the update of all parameters together,
as tests/test_mixed_precision.py says why).

Used by tests/test_matrix.py and scripts/matrix_table.py (which writes docs/reference/matrix.md
from the same run).
"""

from __future__ import annotations

import functools
import itertools
import pickle
import re
from dataclasses import dataclass, replace
from datetime import timedelta

import torch

import zerostack
from zerostack import ConfigError, Topology
from zerostack.models import GPT, GPTConfig

from tests.support.models import batch
from tests.support.parity import step_masters

WORLD = 4
STEPS = 3
B = 8  # sequences per micro-step, over all data-parallel replicas
LR = 0.5
E = 4  # experts per MoE block at ep > 1
CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=4, d_model=32, bias=False)
MOE = replace(CFG, moe_every=2, num_experts=E, moe_min_capacity=1, moe_capacity_factor=4.0)
TOL = {"fp32": 1e-5, "bf16": 8 * 2.0**-8}  # bf16: test_mixed_precision's 8 u


@dataclass(frozen=True)
class Combo:
    pp: int
    dp: int
    ep: int
    tp: int
    sp: int  # Ulysses, inside dp
    megatron_sp: bool
    schedule: str  # "" without a pipeline
    stage: int
    precision: str  # "fp32" | "bf16"
    offload: str  # "none" | "cpu"
    ring: int = 1  # ring-attention ranks among the sp ranks (ring_parallel_size)

    @property
    def layout(self) -> str:
        """The grid and its variant, e.g. ``pp 2 · dp 2 · interleaved``."""
        parts = [f"{k} {v}" for k, v in self.axes().items() if v > 1] or ["dp 1"]
        if self.megatron_sp:
            parts.append("Megatron SP")
        if self.schedule:
            parts.append(self.schedule)
        return " · ".join(parts)

    def axes(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "sp": self.sp, "ring": self.ring, "ep": self.ep,
                "tp": self.tp}  # fmt: skip

    @property
    def gas(self) -> int:
        return max(2, self.pp)

    @property
    def replicas(self) -> int:
        return self.dp * self.ep // self.sp

    def __str__(self) -> str:
        extra = [f"stage {self.stage}", self.precision]
        if self.offload != "none":
            extra.append(f"offload {self.offload}")
        return f"{self.layout}, {', '.join(extra)}"

    def settings(self) -> dict[str, re.Pattern]:
        """The settings this combination chooses (its ZeRO stage, and what it changes from plain
        fp32 data parallelism), each with the words a refusal naming it would use."""
        named = {}
        words = {
            "pp": r"pipeline|\bpp\b",
            "tp": r"tensor_parallel|tensor parallelism|\btp\b",
            "sp": r"sequence_parallel_size|Ulysses|\bsp\b",
            "ring": r"ring_parallel_size|\bring\b",
            "ep": r"ep_size|expert|MoE|moe_every|\bep\b",
        }
        for axis, value in self.axes().items():
            if axis != "dp" and value > 1:
                named[axis] = words[axis]
        if self.megatron_sp:
            named["megatron_sp"] = r"\bsequence_parallel\b(?!_size)|Megatron"
        if self.schedule == "interleaved":
            named["schedule"] = r"pipeline\.schedule|interleaved|virtual_stages"
        named["stage"] = r"zero_optimization\.stage|stage \d|stage is \d"
        if self.precision == "bf16":
            named["bf16"] = r"\bbf16\b"
        if self.offload != "none":
            named["offload"] = r"offload_optimizer|offload_param|offload"
        return {k: re.compile(v) for k, v in named.items()}


def layouts(world: int = WORLD) -> list[tuple[int, int, int, int, int, int]]:
    """(pp, dp, ep, tp, sp, ring) with pp * dp * ep * tp = world, sp dividing dp and ring
    dividing sp."""
    sizes = [n for n in range(1, world + 1) if world % n == 0]
    out = []
    for pp, ep, tp in itertools.product(sizes, sizes, sizes):
        if world % (pp * ep * tp):
            continue
        dp = world // (pp * ep * tp)
        out.extend((pp, dp, ep, tp, sp, ring) for sp in sizes if dp % sp == 0
                   for ring in sizes if sp % ring == 0)  # fmt: skip
    return out


def combos(world: int = WORLD) -> list[Combo]:
    out = []
    for pp, dp, ep, tp, sp, ring in layouts(world):
        for megatron_sp, schedule in itertools.product(
            [False, True] if tp > 1 else [False],
            ["1f1b", "interleaved"] if pp > 1 else [""],
        ):
            for stage, precision, offload in itertools.product(
                range(4), ["fp32", "bf16"], ["none", "cpu"]
            ):
                out.append(Combo(pp, dp, ep, tp, sp, megatron_sp, schedule, stage, precision,
                                 offload, ring))  # fmt: skip
    return out


# ------------------------------------------------------------------------------ the reference


def _distinct_experts(model: GPT, first: int = 0) -> None:
    """Expert ``first + l`` (the model's local expert l) made to differ from the others (they
    start as copies of one MLP, which would hide a token sent to the wrong expert)."""
    with torch.no_grad():
        for block in model.blocks:
            if not hasattr(block.mlp, "deepspeed_moe"):
                continue
            for i, expert in enumerate(block.mlp.deepspeed_moe.experts.deepspeed_experts):
                g = torch.Generator().manual_seed(100 + first + i)
                for p in expert.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.02)


def _base_model(moe: bool) -> GPT:
    torch.manual_seed(0)
    model = GPT(MOE if moe else CFG)
    if moe:
        _distinct_experts(model)
    return model


def key(combo: Combo) -> tuple:
    """What the reference depends on: a MoE model's gates see one rank's tokens at a time
    (DeepSpeed's per-rank capacity and auxiliary loss), so its reference runs each replica's
    micro-batch apart, and under Ulysses or Megatron's sequence parallelism each sequence
    shard's tokens through the gates apart (a ring's shards are zigzag pieces)."""
    moe = combo.ep > 1
    shards = combo.sp * (combo.tp if combo.megatron_sp else 1)  # each routes its own tokens
    ring = combo.ring if moe else 1
    return (moe, combo.replicas if moe else 1, shards if moe else 1, combo.gas, combo.precision,
            ring)  # fmt: skip


def _by_shards(moe: torch.nn.Module, n: int, ring: int) -> None:
    """``moe`` made to run on each of ``n`` sequence shards apart (as n sequence-parallel ranks
    run it, ``ring`` of them ring groups): the outputs joined, the auxiliary loss their mean
    (the engine averages the ranks' gradients). Its parameters keep their names."""
    from zerostack.sequence import sequence_piece, sequence_unpiece

    whole = moe.forward

    def forward(x):
        outs = [whole(sequence_piece(x, 1, i, n, ring)) for i in range(n)]
        return sequence_unpiece([o[0] for o in outs], 1, ring), sum(o[1] for o in outs) / n, None

    moe.forward = forward


@functools.cache
def reference(moe: bool, replicas: int, shards: int, gas: int, precision: str, ring: int = 1):
    """One process: per step, (parameters after it, gradient norm). The loss is the mean over
    the step's micro-batches and, for MoE, over each replica's part of one; bf16 computes and
    accumulates gradients in bf16 and steps fp32 masters (tests/parity.mixed_reference)."""
    model = _base_model(moe)
    if shards > 1:
        for block in model.blocks:
            if hasattr(block.mlp, "deepspeed_moe"):
                _by_shards(block.mlp, shards, ring)
    names = [n for n, _ in model.named_parameters()]
    masters = [p.detach().clone() for p in model.parameters()]
    if precision == "bf16":
        model.to(torch.bfloat16)
    shadow = [torch.nn.Parameter(m) for m in masters]
    opt = torch.optim.SGD(shadow, lr=LR, momentum=0.0)
    per = B // replicas
    out = []
    for step in range(STEPS):
        x, y = batch(step, B * gas, CFG.block_size)
        for m in range(gas):
            for r in range(replicas):
                lo = m * B + r * per
                loss = model(x[lo : lo + per], y[lo : lo + per])
                (loss.float() / (gas * replicas)).backward()
        out.append(
            step_masters(model, shadow, names, opt, [p.grad.float() for p in model.parameters()])
        )
    return out


# ---------------------------------------------------------------------------- one combination


def config(combo: Combo, micro: int) -> dict:
    zero = {
        "stage": combo.stage,
        "reduce_bucket_size": 5000,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 3000,
    }
    if combo.offload != "none":
        zero.update(offload_optimizer={"device": combo.offload}, sub_group_size=5000)
        if combo.stage == 3:
            zero["offload_param"] = {"device": combo.offload}
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": combo.gas,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.0}},
        "zero_optimization": zero,
    }
    if combo.sp > 1:
        cfg["sequence_parallel_size"] = combo.sp
    if combo.ring > 1:
        cfg["ring_parallel_size"] = combo.ring
    if combo.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if combo.pp > 1:
        chunks = 2 if combo.schedule == "interleaved" else 1
        cfg["pipeline"] = {"schedule": combo.schedule, "virtual_stages": chunks}
    return cfg


def _model(combo: Combo, topo: Topology):
    """The model as a user of this layout builds it; returns (model, name map to the plain
    GPT's names)."""
    moe = combo.ep > 1
    if combo.pp == 1:
        if moe:  # this rank's experts are experts ep_rank * e_local + l of the reference
            torch.manual_seed(0)
            model = GPT(replace(MOE, moe_ep_size=combo.ep))
            _distinct_experts(model, first=topo.rank("ep") * (E // combo.ep))
        else:
            model = _base_model(False)  # the plain weights, before any split
        if combo.tp > 1 or combo.sp > 1:
            model.parallelize(topo, sequence_parallel=combo.megatron_sp)
        return model, _expert_names(combo, topo)
    from zerostack.models.gpt_pipe import GPTLoss, gpt_layers, load_plain_state, plain_name
    from zerostack.pipeline import PipelineModule

    cfg = replace(MOE, moe_ep_size=combo.ep) if moe else CFG
    chunks = 2 if combo.schedule == "interleaved" else 1
    model = PipelineModule(
        gpt_layers(cfg, topology=topo, sequence_parallel=combo.megatron_sp),
        topology=topo,
        loss_fn=GPTLoss(topo),
        partition_method="type:Block",
        virtual_stages=chunks,
    )
    load_plain_state(model, _base_model(moe).state_dict(), cfg)
    experts = _expert_names(combo, topo)
    return model, lambda name: experts(plain_name(name, cfg))


def _expert_names(combo: Combo, topo: Topology):
    if combo.ep == 1:
        return lambda name: name
    first = topo.rank("ep") * (E // combo.ep)

    def rename(name: str) -> str:
        found = re.match(r"(.*deepspeed_experts\.)(\d+)(\..*)", name)
        return f"{found[1]}{first + int(found[2])}{found[3]}" if found else name

    return rename


def _topology(combo: Combo, cache: dict) -> Topology:
    """One grid per layout, built once (a refusal is remembered and raised again)."""
    shape = (combo.pp, combo.dp, combo.ep, combo.tp, combo.sp, combo.ring)
    if shape not in cache:
        try:
            cache[shape] = Topology.build(
                pp=combo.pp, tp=combo.tp, sp=combo.sp, ep=combo.ep, ring=combo.ring,
                timeout=timedelta(seconds=60),
            )
        except ConfigError as exc:
            cache[shape] = exc
    if isinstance(cache[shape], Exception):
        raise cache[shape]
    return cache[shape]


def _micro_batches(combo: Combo, topo: Topology, step: int):
    from zerostack.sequence import shard_sequence

    per = B // combo.replicas
    x, y = batch(step, B * combo.gas, CFG.block_size)
    for m in range(combo.gas):
        lo = m * B + topo.data_parallel_rank * per
        yield shard_sequence((x[lo : lo + per], y[lo : lo + per]), topo)


def train(combo: Combo, refs: dict, cache: dict):
    """("refused", the error's line) or ("ok", per step: ({name: (relative difference, squared
    error of the update, squared norm of the reference's update)}, gradient norm))."""
    try:
        topo = _topology(combo, cache)
        model, name_of = _model(combo, topo)
        engine, *_ = zerostack.initialize(
            model=model, topology=topo, config=config(combo, B // combo.replicas)
        )
    except ConfigError as exc:
        return "refused", str(exc)
    except Exception as exc:  # noqa: BLE001 - the third outcome, reported with the others
        return "error", f"{type(exc).__name__}: {exc}"
    ref = refs[key(combo)]
    before = {n: p.detach() for n, p in _base_model(combo.ep > 1).named_parameters()}
    ref_before = before
    out = []
    for step in range(STEPS):
        if combo.pp > 1:
            engine.train_batch(_micro_batches(combo, topo, step))
        else:
            for x, y in _micro_batches(combo, topo, step):
                engine.backward(engine(x, y))
                engine.step()
        state = {name_of(k): v.detach().float() for k, v in engine.full_state_dict().items()}
        ref_state = ref[step][0]
        stats = {}
        for name, value in state.items():
            want = ref_state[name]
            diff = float((value - want).norm() / want.norm().clamp_min(1e-12))
            update, ref_update = value - before[name], want - ref_before[name]
            error, size = float((update - ref_update).norm()), float(ref_update.norm())
            stats[name] = (diff, error**2, size**2)
        out.append((stats, engine.get_global_grad_norm()))
        before, ref_before = state, {k: ref_state[k] for k in state}
    engine.destroy()
    return "ok", out


def run_all(rank: int, world: int, combos: list[Combo], refs: bytes) -> list:
    """Every combination in turn on this rank; ``refs``: the references, pickled (as tensors
    they would travel as shared-memory handles, one file descriptor each)."""
    refs, cache = pickle.loads(refs), {}
    return [train(combo, refs, cache) for combo in combos]


# ------------------------------------------------------------------------------- the verdict


def judge(combo: Combo, per_rank: list, ref) -> tuple[str, str]:
    """("works", "") when every rank trained and matched ``ref``; ("refused", the line) when
    every rank refused alike with one line naming two of the combination's settings;
    ("other", why) otherwise."""
    kinds = {r[0] for r in per_rank}
    if kinds == {"refused"}:
        lines = {r[1] for r in per_rank}
        line = per_rank[0][1]
        named = [k for k, words in combo.settings().items() if words.search(line)]
        if len(lines) > 1 or "\n" in line or len(named) < 2:
            return "other", f"refused without naming two settings alike on every rank: {line!r}"
        return "refused", line
    if kinds != {"ok"}:
        return "other", "; ".join(sorted({f"{r[0]}: {r[1]}" for r in per_rank if r[0] != "ok"}))
    tol = TOL[combo.precision]
    for step, (ref_state, ref_norm) in enumerate(ref):
        merged: dict = {}
        for result in per_rank:
            for name, figures in result[1][step][0].items():
                merged.setdefault(name, figures)
        if merged.keys() != ref_state.keys():
            missing = sorted(ref_state.keys() - merged.keys())[:3]
            return "other", f"step {step}: parameters not held by any rank: {missing}"
        norm = per_rank[0][1][step][1]
        if norm is None or abs(norm - ref_norm) > tol * ref_norm:
            return "other", f"step {step}: gradient norm {norm} against {ref_norm}"
        if combo.precision == "fp32":
            worst = max(merged, key=lambda n: merged[n][0])
            if merged[worst][0] > tol:
                return "other", f"step {step}: {worst} differs by {merged[worst][0]:.2e}"
        else:  # the update of all parameters together, relative to the reference's
            err = sum(f[1] for f in merged.values()) ** 0.5
            size = sum(f[2] for f in merged.values()) ** 0.5
            if err > tol * size:
                return "other", f"step {step}: the update differs by {err / size:.2e}"
    return "works", ""


# -------------------------------------------------------------------------------- the page


def measure(
    combos: list[Combo] | None = None, world: int = WORLD
) -> tuple[list[Combo], list[tuple[str, str]]]:
    """Run every combination on ``world`` gloo ranks (4: the matrix) and judge each:
    (combinations, verdicts)."""
    from tests.support.ranks import run_distributed

    combos = combos if combos is not None else globals()["combos"]()
    refs = {key(c): reference(*key(c)) for c in combos}
    per_rank = run_distributed(run_all, world, args=(combos, pickle.dumps(refs)), timeout=1500)
    verdicts = [judge(c, [r[i] for r in per_rank], refs[key(c)]) for i, c in enumerate(combos)]
    return combos, verdicts


def summary(verdicts: list[tuple[str, str]]) -> str:
    count = {k: sum(v == k for v, _ in verdicts) for k in ("works", "refused", "other")}
    return (
        f"{len(verdicts)} combinations: {count['works']} work (parity), "
        f"{count['refused']} refused (named), {count['other']} other"
    )


def render(combos: list[Combo], verdicts: list[tuple[str, str]]) -> str:
    """The page's table: a row per layout, a column per ZeRO stage; a cell holds fp32, bf16,
    fp32 offloaded, bf16 offloaded: ✓ (works) or the number of its refusal, listed below."""
    reasons: list[str] = []
    cells: dict[tuple[str, int], list[str]] = {}
    for combo, (verdict, line) in zip(combos, verdicts, strict=True):
        if verdict == "works":
            mark = "✓"
        elif verdict == "refused":
            if line not in reasons:
                reasons.append(line)
            mark = str(reasons.index(line) + 1)
        else:
            mark = "✗"
        cells.setdefault((combo.layout, combo.stage), []).append(mark)
    rows = list(dict.fromkeys(c.layout for c in combos))
    lines = [
        f"**{summary(verdicts)}**",
        "",
        "| layout | stage 0 | stage 1 | stage 2 | stage 3 |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row} | " + " | ".join(" ".join(cells[row, s]) for s in range(4)) + " |")
    lines += ["", "Refusals:", ""]
    lines += [f"{i}. `{line}`" for i, line in enumerate(reasons, 1)]
    return "\n".join(lines) + "\n"
