"""``communication_data_type`` and ``data_types.grad_accum_dtype``: the dtype gradients are reduced
in over dp, and the one they are summed in across micro-batches (DeepSpeed's keys and defaults).

The value checks are exact, not within a tolerance. Each rank records its own per-micro-batch
bf16 gradients (a hook registered before the engine's, so it sees each ``.grad`` before the
engine folds or drops it); the reference is then their sum in fp32, in the order the stage sums
(stages 0-1: a rank's micro-batches first, then over dp; stages 2-3: over dp per micro-batch,
then the micro-batches). Reduced and accumulated in fp32, the engine's gradient is that number
bit for bit; reduced or accumulated in bf16 it is rounded, and differs. Bytes on the wire come
from the CommLog, gradient storage from a live-storage census (tests/support/census.py).
"""

from __future__ import annotations

import pytest
import torch

import zerostack
from zerostack.config import ConfigError, load_config
from zerostack.core.precision import Precision
from zerostack.utils import safe_get_full_grad

from tests.support import census
from tests.support.models import batch, tiny_gpt
from tests.support.parity import _model, describe, merge_stages, mixed_reference
from tests.support.ranks import run_distributed

MICRO = 4  # sequences per rank per micro-batch


# --------------------------------------------------------------------------- config, no processes
def _cfg(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, **extra}


@pytest.mark.parametrize(
    "precision, model",
    [("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)],
)
def test_defaults_are_deepspeeds(precision, model):
    """Not given: reduced in the model's dtype at every stage (DeepSpeed's engine property);
    summed in the model's dtype at stages 0-1 (DeepSpeed's get_data_types), in fp32 at stages
    2-3, where zerostack keeps its reduced pieces in fp32."""
    extra = {precision: {"enabled": True}} if precision != "fp32" else {}
    p = Precision.from_config(load_config(_cfg(**extra)))
    assert p.compute_dtype == model and p.reduce_dtype == model
    assert [p.accum_dtype(s) for s in range(4)] == [model, model, torch.float32, torch.float32]
    given = Precision.from_config(
        load_config(
            _cfg(
                **extra,
                communication_data_type="FP32",  # DeepSpeed lower-cases it
                data_types={"grad_accum_dtype": "bfloat16"},  # a DtypeEnum spelling
                zero_optimization={"stage": 1},
            )
        )
    )
    assert given.reduce_dtype == torch.float32
    assert [given.accum_dtype(s) for s in (1, 2, 3)] == [torch.bfloat16] * 3


BAD = [
    (
        {"communication_data_type": "fp64"},
        "communication_data_type: must be 'fp32', 'fp16' or 'bf16' (got 'fp64')",
    ),
    (
        {"data_types": {"grad_accum_dtype": "int8"}},
        "data_types.grad_accum_dtype: must be 'fp32', 'fp16' or 'bf16' (got 'int8')",
    ),
    (
        {"data_types": {"grad_accum_type": "fp32"}},
        "data_types.grad_accum_type: unknown key (did you mean 'grad_accum_dtype'?)",
    ),
    (  # DeepSpeed: NotImplementedError "unsupported mix of model_dtype and grad_accum_dtype"
        {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
        "data_types.grad_accum_dtype, zero_optimization.stage: fp32 accumulation of a bf16 "
        "model needs ZeRO stage 1, 2 or 3 (stage 0 accumulates in the model's dtype, as in "
        "DeepSpeed)",
    ),
    (
        {"data_types": {"grad_accum_dtype": "fp16"}, "zero_optimization": {"stage": 0}},
        "data_types.grad_accum_dtype, zero_optimization.stage: fp16 accumulation of a fp32 "
        "model needs ZeRO stage 1, 2 or 3 (stage 0 accumulates in the model's dtype, as in "
        "DeepSpeed)",
    ),
    (
        {
            "bf16": {"enabled": True},
            "data_types": {"grad_accum_dtype": "bf16"},
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"},
            },
        },
        "data_types.grad_accum_dtype, zero_optimization.offload_optimizer.device: stage 3 with "
        "nvme offload keeps its gradients in fp32 files, not bf16",
    ),
]


@pytest.mark.parametrize("extra, message", BAD)
def test_bad_values_and_combinations_fail_in_one_line(extra, message):
    with pytest.raises(ConfigError) as e:
        load_config(_cfg(**extra))
    assert str(e.value) == message


def test_combinations_deepspeed_accepts():
    """The model's own dtype is fine at stage 0; bf16 accumulation under nvme is fine below
    stage 3 (pieces in memory)."""
    for extra in (
        {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}},
        {"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "bf16"},
        {
            "bf16": {"enabled": True},
            "data_types": {"grad_accum_dtype": "bf16"},
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"},
            },
        },
    ):
        load_config(_cfg(**extra))


def _auto_stage(rank, world):
    cfg = _cfg(
        bf16={"enabled": True},
        data_types={"grad_accum_dtype": "fp32"},
        zero_optimization={"stage": "auto"},
        optimizer={"type": "SGD", "params": {"lr": 0.1}},
    )
    try:
        zerostack.initialize(model=tiny_gpt(), config=cfg)
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.distributed
def test_auto_stage_0_is_refused_too():
    """ "auto" picks stage 0 for a model this small; the refusal comes once it is picked."""
    (message,) = run_distributed(_auto_stage, 1)
    assert message == (
        "data_types.grad_accum_dtype, zero_optimization.stage: fp32 accumulation of a bf16 model "
        "needs ZeRO stage 1, 2 or 3 (stage 0 accumulates in the model's dtype, as in DeepSpeed)"
    )


# --------------------------------------------------------------------------- 2 ranks, exact values
def _reduced_elements(engine) -> int:
    """Elements each rank puts into the gradient reductions of one micro-batch: the padded flat
    buffers (stages 0-2) or the bucket matrices (stage 3)."""
    zero = engine.zero
    if zero.stage == 3:
        return zero.dp * sum(zero.reduce.width)
    return sum(fg.layout.padded_numel for fg in zero.flat.groups)


def _grad_storage(engine, base) -> dict[str, int]:
    """Bytes of live gradient storage by dtype (the census walks what is reachable; storage only
    gc finds is never "grads", so there is nothing to settle)."""
    out: dict[str, int] = {}
    for s in census.take(engine, exclude=base, settle=0).storages.values():
        if s.category == "grads":
            out[str(s.dtype)] = out.get(str(s.dtype), 0) + s.nbytes
    return out


def _accum_numel(engine) -> int:
    """Elements of the buffer a window's gradients are summed in, on this rank."""
    zero = engine.zero
    if zero.stage == 3:
        return sum(g.grad_shard.numel() for g in zero.groups)
    if zero.stage == 2:
        return sum(fg.layout.shard_numel for fg in zero.flat.groups)
    return sum(fg.layout.padded_numel for fg in zero.flat.groups)


def _run(rank, world, cases):
    """Per case: this rank's bf16 gradient of each micro-batch, the engine's mean gradient after
    the window's last backward, the gradient-reduction bytes, the elements reduced, and (gas > 1)
    the gradient storage after the first micro-batch with the elements it should hold."""
    out = []
    for stage, gas, comm, accum in cases:
        base = census.baseline()
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": gas,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "bf16": {"enabled": True},
            "zero_optimization": {
                "stage": stage,
                "reduce_bucket_size": 5000,
                "stage3_param_persistence_threshold": 0,
            },
        }
        if comm:
            cfg["communication_data_type"] = comm
        if accum:
            cfg["data_types"] = {"grad_accum_dtype": accum}
        model = tiny_gpt()
        named = list(model.named_parameters())
        local: dict[str, list[torch.Tensor]] = {n: [] for n, _ in named}
        for n, p in named:  # before the engine's hooks: each micro-batch's own .grad
            p.register_post_accumulate_grad_hook(
                lambda p, seen=local[n]: seen.append(p.grad.detach().float().clone())
            )
        engine, *_ = zerostack.initialize(model=model, config=cfg)
        log = engine.comm.log
        first = len(log.records)
        x, y = batch(0, MICRO * world * gas)
        storage = None
        for m in range(gas):
            lo = (m * world + rank) * MICRO
            engine.backward(engine(x[lo : lo + MICRO], y[lo : lo + MICRO]))
            if m == 0 and gas > 1:
                storage = (_grad_storage(engine, base), _accum_numel(engine))
            if m < gas - 1:
                engine.step()
        grads = {n: safe_get_full_grad(p).clone() for n, p in named}
        engine.step()
        # gradient reductions: the dp all-reduces / reduce-scatters bigger than a scalar (the
        # norm's all-reduce is 4 bytes)
        sent = sum(
            r.bytes
            for r in log.records[first:]
            if r.axis == "dp" and r.op in ("all_reduce", "reduce_scatter") and r.bytes > 16
        )
        out.append((local, grads, sent, _reduced_elements(engine), storage))
        engine.destroy()
        base.release()
    return out


def _reference(locals_, stage: int) -> dict[str, torch.Tensor]:
    """The mean gradient summed in fp32 in the stage's order, from every rank's bf16 gradients
    (``locals_[rank][name][micro]``); the engine's result has been multiplied by 1/dp, exact."""
    world, out = len(locals_), {}
    for name in locals_[0]:
        per = [locals_[r][name] for r in range(world)]
        gas = len(per[0])
        if stage < 2:  # each rank sums its micro-batches, then the ranks are summed
            total = _ordered_sum([_ordered_sum(per[r]) for r in range(world)])
        else:  # each micro-batch is reduced over dp, then the reduced ones are summed
            reduced = [_ordered_sum([per[r][m] for r in range(world)]) for m in range(gas)]
            total = _ordered_sum(reduced)
        out[name] = total / world
    return out


def _ordered_sum(ts: list[torch.Tensor]) -> torch.Tensor:
    total = ts[0].clone()
    for t in ts[1:]:
        total += t
    return total


def _mismatch(got: dict, ref: dict) -> float:
    """Share of elements where ``got`` is not exactly ``ref``."""
    bad = sum(int((got[n] != ref[n]).sum()) for n in ref)
    return bad / sum(ref[n].numel() for n in ref)


@pytest.mark.distributed
@pytest.mark.slow
def test_fp32_reduction_sends_fp32_and_sums_exactly():
    """bf16 training, dp = 2, one micro-batch: with communication_data_type "fp32" every
    gradient reduction moves 4 bytes per element (2 by default), and the gradient is the fp32 sum
    of the ranks' bf16 gradients exactly (stage 0 writes it back into its bf16 buffer, as
    DeepSpeed does: the sum rounded once); reduced in bf16 it is rounded."""
    cases = [(s, 1, comm, None) for s in range(4) for comm in (None, "fp32")]
    ranks = run_distributed(_run, 2, args=(cases,), timeout=300)
    for i, (stage, _, comm, _) in enumerate(cases):
        local, grads, sent, elements, _ = ranks[0][i]
        assert sent == (4 if comm else 2) * elements, (stage, comm, sent, elements)
        ref = _reference([r[i][0] for r in ranks], stage)
        if comm is None:
            assert _mismatch(grads, ref) > 0.05, stage  # bf16 rounding is visible
            continue
        assert all(torch.equal(local[n][0], ranks[0][i - 1][0][n][0]) for n in local)
        want = ref if stage > 0 else {n: t.bfloat16().float() for n, t in ref.items()}
        assert _mismatch(grads, want) == 0, stage
        assert _mismatch(ranks[1][i][1], want) == 0, stage


@pytest.mark.distributed
@pytest.mark.slow
def test_fp32_accumulation_buffer_across_micro_batches():
    """bf16 training, dp = 2, two micro-batches, reduced in fp32: grad_accum_dtype "fp32" keeps
    one fp32 buffer (stage 1: the full flat buffer, no bf16 .grad left; stages 2-3: the shard)
    between micro-batches, and the window's gradient is the fp32 sum exactly; bf16 accumulation
    (stage 1's default, given explicitly at stages 2-3) keeps a bf16 buffer of the same
    elements and rounds."""
    cases = [(s, 2, "fp32", a) for s in (1, 2, 3) for a in ("fp32", "bf16" if s > 1 else None)]
    ranks = run_distributed(_run, 2, args=(cases,), timeout=300)
    for i, (stage, _, _, accum) in enumerate(cases):
        _, grads, _, _, (storage, numel) = ranks[0][i]
        exact = accum == "fp32"
        want = {"torch.float32": 4 * numel} if exact else {"torch.bfloat16": 2 * numel}
        assert storage == want, (stage, accum, storage)
        fp32_run = i if exact else i - 1  # its hooks saw each micro-batch's own gradient
        ref = _reference([r[fp32_run][0] for r in ranks], stage)
        if exact:
            assert _mismatch(grads, ref) == 0, stage
        else:
            assert _mismatch(grads, ref) > 0.05, stage


# --------------------------------------------------------------------------- training parity
U = {"fp16": 2.0**-11, "bf16": 2.0**-8}
LOSS_SCALE = 1024.0
PARITY = [
    {"stage": 1, "gas": 2, "precision": "bf16", "dtypes": ("fp32", "fp32")},
    {"stage": 1, "gas": 2, "precision": "fp16", "dtypes": ("fp32", "fp32")},
    {"stage": 2, "gas": 2, "precision": "bf16", "dtypes": ("fp32", "bf16")},
    {"stage": 3, "gas": 2, "precision": "bf16", "dtypes": ("fp32", "bf16")},
    # a pipeline's tied embedding: its two copies' gradients are summed in the fp32 buffer
    {"stage": 1, "gas": 2, "precision": "bf16", "dtypes": (None, "fp32"), "pp": 2},
]


def _run_parity(rank, world, cases):
    from tests.support import parity

    plain = parity._config

    def config(case, micro, nvme_root):
        cfg = plain(case, micro, nvme_root)
        comm, accum = case["dtypes"]
        if comm:
            cfg["communication_data_type"] = comm
        cfg["data_types"] = {"grad_accum_dtype": accum}
        return cfg

    parity._config = config
    try:
        return parity.run_cases(rank, world, cases)
    finally:
        parity._config = plain


@pytest.mark.distributed
def test_training_matches_mixed_precision_reference():
    """Three SGD steps against tests/support/parity.py's single-process mixed-precision
    reference: the update of the fp32 masters and the gradient norm within 8 u (see
    test_mixed_precision), at stages 1-3, fp16 and bf16, dp = 2 and a pipeline with a tied
    embedding (pp = 2)."""
    cases = [{**c, "optimizer": "sgd", "loss_scale": LOSS_SCALE} for c in PARITY]
    results = merge_stages(run_distributed(_run_parity, 2, args=(cases,), timeout=300))
    start = _flat({k: v.detach() for k, v in _model().named_parameters()})
    failures = []
    for case, steps in zip(cases, results, strict=True):
        dtype = torch.float16 if case["precision"] == "fp16" else torch.bfloat16
        ref = mixed_reference("sgd", case["gas"], dtype, LOSS_SCALE)
        tol = 8 * U[case["precision"]]
        before, ref_before = start, start
        for step, ((state, norm), (ref_state, ref_norm)) in enumerate(zip(steps, ref, strict=True)):
            upd, ref_upd = _flat(state) - before, _flat(ref_state) - ref_before
            errors = (_rel(upd, ref_upd), _rel(norm, ref_norm))
            if max(errors) > tol:
                failures.append(f"{describe(case)} {case['dtypes']}, step {step}: {errors}")
            before, ref_before = _flat(state), _flat(ref_state)
    assert not failures, "\n".join(failures)


def _flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state[k].double().reshape(-1) for k in sorted(state)])


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm())
