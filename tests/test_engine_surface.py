"""DeepSpeed's engine surface as Transformers and Accelerate call it, on real gloo ranks.

* ``zerostack.utils.safe_get_full_*`` / ``safe_set_full_*`` at ZeRO stages 0-3, with optimizer
  offload and with tensor parallelism, against single-process fp32 training with torch AdamW:
  the full gradient between backward and step (mid-window and on the boundary), the full fp32
  parameter and Adam's ``exp_avg`` after each step, and a value set on the engine changing the
  next step exactly as setting it on the single-process model does. Gradients set with
  ``safe_set_full_grad`` (after the first micro-batch, so the second adds to it, and on the
  boundary), ``safe_update_full_grad_vectorized`` and, at stage 3, the ``safe_set_local_*``
  setters: the step is the one the single-process model takes with those ``p.grad``. Tolerance
  1e-5 relative per tensor, as the parity tests: only the order of floating-point sums differs.
* ``load_checkpoint``: ``(None, None)`` with nothing saved, ``load_module_strict=False``,
  ``custom_load_fn``; ``save_checkpoint(exclude_frozen_parameters=True)``.
* ``save_16bit_model`` and ``_zero3_consolidated_16bit_state_dict``: the file's entries are the
  model's state dict, whole, in the compute dtype, equal to the engine's own weights.
* ``no_sync``, ``set_gradient_accumulation_boundary``, ``was_step_applied``, the loss scale and
  the accessors. These use SGD: one AdamW step moves every weight by about lr whatever the
  gradient's scale, so a lost factor would not show.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import zerostack
from zerostack import Topology
from zerostack.checkpoint import CheckpointError
from zerostack.models import GPT, GPTConfig
from zerostack.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)

from tests.support.models import batch, max_rel_diff, tiny_gpt
from tests.support.ranks import run_distributed

pytestmark = pytest.mark.distributed  # every test here starts ranks

B, GAS, STEPS, TOL = 8, 2, 3, 1e-5
LR, WD = 1e-3, 0.01
# 4 heads so that tp = 2 splits them; no biases (see common.TINY)
TP_CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, d_model=32, bias=False)
# stage, optimizer offload, tp
CASES = {
    "s0": (0, None, 1),
    "s1": (1, None, 1),
    "s2": (2, None, 1),
    "s3": (3, None, 1),
    "s2_cpu": (2, "cpu", 1),
    "s3_cpu": (3, "cpu", 1),
    "s2_nvme": (2, "nvme", 1),
    "s3_nvme": (3, "nvme", 1),
    "s1_tp2": (1, None, 2),
}
SET = ("blocks.0.attn.qkv.weight", "blocks.1.ln1.weight")  # a tp-split matrix, a replicated vector


def _surface(rank, world, stage, offload, tp, root):
    zero = {"stage": stage, "reduce_bucket_size": 5000, "stage3_param_persistence_threshold": 64}
    if offload:
        zero["offload_optimizer"] = {"device": offload, "nvme_path": root}
    dp = world // tp
    per = B // dp // GAS
    config = {
        "train_micro_batch_size_per_gpu": per,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": zero,
    }
    if tp > 1:
        topo = Topology.build(tp=tp)
        torch.manual_seed(0)
        model, cfg = GPT(TP_CFG, topology=topo), TP_CFG
    else:
        topo, model, cfg = None, tiny_gpt(), None
    engine, *_ = zerostack.initialize(model=model, topology=topo, config=config)
    ref = tiny_gpt(cfg=cfg) if cfg is not None else tiny_gpt()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    ours = dict(engine.module.named_parameters())
    theirs = dict(ref.named_parameters())
    dp_rank = engine.topology.dp_rank
    out = {"mid": [], "grad": [], "param": [], "exp_avg": []}

    def ref_grads(x, y, scale=1.0):
        ref.zero_grad(set_to_none=True)
        (ref(x, y) * scale).backward()
        return {n: p.grad.clone() for n, p in theirs.items()}

    def train_step(step):
        x, y = batch(step, B)
        half = ref_grads(x[: dp * per], y[: dp * per], 1.0 / GAS)  # micro-batch 0 of every rank
        whole = ref_grads(x, y)
        for m in range(GAS):
            lo = (m * dp + dp_rank) * per
            engine.backward(engine(x[lo : lo + per], y[lo : lo + per]))
            grads = {n: safe_get_full_grad(p) for n, p in ours.items()}
            out["mid" if m == 0 else "grad"].append(max_rel_diff(grads, half if m == 0 else whole))
            engine.step()
        opt.step()
        params = {n: safe_get_full_fp32_param(p) for n, p in ours.items()}
        out["param"].append(max_rel_diff(params, {n: p.detach() for n, p in theirs.items()}))
        moments = {n: safe_get_full_optimizer_state(p, "exp_avg") for n, p in ours.items()}
        out["exp_avg"].append(
            max_rel_diff(moments, {n: opt.state[p]["exp_avg"] for n, p in theirs.items()})
        )

    def piece(name, value):
        """This rank's stage-3 piece of a whole value (padded), as the local setters take it."""
        pn = ours[name]._zs.piece.numel()
        out = torch.zeros(pn)
        part = value.reshape(-1)[dp_rank * pn : (dp_rank + 1) * pn]
        out[: part.numel()] = part
        return out

    def set_grads_step(step):
        """SET[0]'s gradient set after the first micro-batch (the second adds to it), then
        doubled on the boundary; SET[1]'s set on the boundary (at stage 3: this rank's piece)."""
        x, y = batch(step, B)
        half = ref_grads(x[: dp * per], y[: dp * per], 1.0 / GAS)
        whole = ref_grads(x, y)
        first, second = SET
        mid, end = half[first] * -3.0 + 0.01, whole[second] * 0.5 - 0.02
        expected = dict(whole)
        expected[first] = (mid + whole[first] - half[first]) * 2.0
        expected[second] = end
        for m in range(GAS):
            lo = (m * dp + dp_rank) * per
            engine.backward(engine(x[lo : lo + per], y[lo : lo + per]))
            if m == 0:
                safe_set_full_grad(ours[first], mid)
                out["mid_set"] = max_rel_diff(
                    {first: safe_get_full_grad(ours[first])}, {first: mid}
                )
            if m == GAS - 1:
                if stage == 3:
                    safe_set_local_grad(ours[second], piece(second, end))
                    local = safe_get_local_grad(ours[second]).cpu()
                    out["local_grad"] = torch.equal(local, piece(second, end))
                else:
                    safe_set_full_grad(ours[second], end)
                safe_update_full_grad_vectorized([ours[first]], lambda g, p: g * 2.0)
                grads = {n: safe_get_full_grad(p) for n, p in ours.items()}
                out["grad_set"] = max_rel_diff(grads, expected)
            engine.step()
        norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in expected.values()]))
        out["norm"] = (engine.get_global_grad_norm(), norm.item())  # the set values counted
        for n, p in theirs.items():
            p.grad = expected[n].clone()
        opt.step()
        params = {n: safe_get_full_fp32_param(p) for n, p in ours.items()}
        out["after_grad_set"] = max_rel_diff(params, {n: p.detach() for n, p in theirs.items()})

    for step in range(STEPS):
        train_step(step)
    # Set a weight and its first moment on both, the same values; the next step must agree.
    # At stage 3 SET[1] (kept whole: under the persistence threshold) is set piece by piece.
    roundtrip = []
    for name in SET:
        value = theirs[name].detach() * 0.5 + 0.01
        moment = opt.state[theirs[name]]["exp_avg"] * -2.0
        if stage == 3 and name == SET[1]:
            safe_set_local_fp32_param(ours[name], piece(name, value))
            safe_set_local_optimizer_state(ours[name], piece(name, moment), "exp_avg")
            got = safe_get_local_optimizer_state(ours[name], "exp_avg").cpu()
            out["local_state"] = torch.equal(got, piece(name, moment))
        else:
            safe_set_full_fp32_param(ours[name], value)
            safe_set_full_optimizer_state(ours[name], moment, "exp_avg")
        with torch.no_grad():
            theirs[name].copy_(value)
            opt.state[theirs[name]]["exp_avg"].copy_(moment)
        got = safe_get_full_fp32_param(ours[name])
        got_moment = safe_get_full_optimizer_state(ours[name], "exp_avg")
        roundtrip.append(torch.equal(got.cpu(), value) and torch.equal(got_moment.cpu(), moment))
    out["roundtrip"] = roundtrip
    x, y = batch(STEPS, B)  # the forward right after the set uses the new values
    lo = dp_rank * per
    out["loss_after_set"] = (
        engine(x[lo : lo + per], y[lo : lo + per]).item(),
        ref(x[lo : lo + per], y[lo : lo + per]).item(),
    )
    train_step(STEPS)
    set_grads_step(STEPS + 1)
    local = safe_get_local_fp32_param(ours[SET[0]]) if stage == 3 else None
    out["local"] = None if local is None else (local.numel(), ours[SET[0]]._zs.piece.numel())
    p = ours[SET[0]]
    if stage == 3:
        with pytest.raises(ValueError) as info:
            safe_set_local_grad(p, torch.zeros(3))
        assert str(info.value) == (
            f"safe_set_local_grad: value has 3 elements, this rank's piece "
            f"{p._zs.piece.numel()} (padding included)"
        )
    else:  # as in DeepSpeed, the local setters are for stage 3's pieces only
        for setter, args in (
            (safe_set_local_grad, ()),
            (safe_set_local_fp32_param, ()),
            (safe_set_local_optimizer_state, ("exp_avg",)),
        ):
            with pytest.raises(ValueError) as info:
                setter(p, torch.zeros(3), *args)
            assert str(info.value) == (
                f"{setter.__name__}: only defined for ZeRO stage 3 partitioned parameters "
                f"(this engine runs stage {stage})"
            )
    engine.destroy()
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_full_values_match_single_process(case, tmp_path):
    stage, offload, tp = CASES[case]
    results = run_distributed(_surface, 2, args=(stage, offload, tp, str(tmp_path)))
    for rank, out in enumerate(results):
        for key in ("mid", "grad", "param", "exp_avg"):
            worst, name = max(out[key])
            assert worst < TOL, f"rank {rank} {key}: {name} differs by {worst:.2e}"
        for key in ("mid_set", "grad_set", "after_grad_set"):
            worst, name = out[key]
            assert worst < TOL, f"rank {rank} {key}: {name} differs by {worst:.2e}"
        assert out["roundtrip"] == [True, True], f"rank {rank}: a set value does not read back"
        ours, theirs = out["norm"]
        assert abs(ours - theirs) < TOL * theirs, f"rank {rank}: gradient norm {ours} vs {theirs}"
        if stage == 3:
            assert out["local_grad"] and out["local_state"], f"rank {rank}: a local value differs"
        ours, theirs = out["loss_after_set"]
        assert abs(ours - theirs) < TOL * abs(theirs), f"rank {rank}: loss {ours} vs {theirs}"
        if stage == 3:
            assert out["local"][0] == out["local"][1]


def _fp16_grads(rank, world, stage):
    config = {
        "train_micro_batch_size_per_gpu": B // world,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "fp16": {"enabled": True, "initial_scale_power": 8},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=config)
    ref = tiny_gpt()
    x, y = batch(0, B)
    ref(x, y).backward()
    per = B // world
    engine.backward(engine(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
    grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
    expected = {n: p.grad for n, p in ref.named_parameters()}
    # a gradient set in the same (unscaled) terms reads back: the loss scale is put in and out
    value = expected["wpe.weight"] * -0.5
    safe_set_full_grad(engine.module.wpe.weight, value)
    back = {"wpe.weight": safe_get_full_grad(engine.module.wpe.weight)}
    return (
        engine.loss_scale,
        max_rel_diff(grads, expected),
        max_rel_diff(back, {"wpe.weight": value}),
    )


@pytest.mark.parametrize("stage", [1, 3])
def test_full_grad_is_unscaled_in_fp16(stage):
    """The loss scale (256) is taken out; fp16 arithmetic leaves ~1e-3 relative differences."""
    for scale, *diffs in run_distributed(_fp16_grads, 2, args=(stage,)):
        assert scale == 256.0
        for worst, name in diffs:
            assert worst < 2e-2, f"{name} differs by {worst:.2e}"


def _read_twice(rank, world, stage):
    config = {
        "train_micro_batch_size_per_gpu": B // world,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "fp16": {"enabled": True, "initial_scale_power": 8},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=config)
    per = B // world
    x, y = batch(0, B)
    engine.backward(engine(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
    p = engine.module.wpe.weight
    first = safe_get_full_grad(p).clone()  # a view of the shard would change with it
    second = safe_get_full_grad(p)
    engine.destroy()
    return torch.equal(first, second)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_reading_a_gradient_leaves_it_as_it_was(stage, world):
    """``safe_get_full_grad`` reads; at stage 2 on one rank in fp16 it divided the gradient
    shard itself by the loss scale (the read's unscaling was done in place on a view)."""
    assert all(run_distributed(_read_twice, world, args=(stage,)))


# ---------------------------------------------------------------------------- checkpoints
class Net(nn.Module):
    """Two Linears, ``a`` then ``second`` (named as asked), ``a`` frozen if asked."""

    def __init__(self, seed: int, second: str = "b", frozen: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(6, 6)
        self.add_module(second, nn.Linear(6, 3))
        self.second = second
        if frozen:
            self.a.requires_grad_(False)

    def forward(self, x, y):
        return F.cross_entropy(getattr(self, self.second)(torch.tanh(self.a(x))), y)


def _net_config(world, stage, lr=0.1, gas=1, **extra):
    return {
        "train_micro_batch_size_per_gpu": B // world // gas,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": lr}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **extra,
    }


def _data(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(B, 6, generator=g), torch.randint(0, 3, (B,), generator=g)


def _net_engine(world, stage, seed, **kwargs):
    extra = kwargs.pop("config", {})
    engine, *_ = zerostack.initialize(
        model=Net(seed, **kwargs), config=_net_config(world, stage, **extra)
    )
    return engine


def _net_step(engine, rank, world, step):
    x, y = _data(step)
    per = B // world
    engine.backward(engine(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
    engine.step()


def _padded_piece(rank, world):
    """Stage 3: a local gradient set with garbage in its piece's padding (``b.bias``: 3
    elements over 2 ranks, rank 1's piece one element short)."""
    engine = _net_engine(world, 3, seed=11)
    x, y = _data(0)
    per = B // world
    engine.backward(engine(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
    p = engine.module.b.bias
    value = torch.tensor([0.5, -1.0, 2.0])
    lo, hi = p._zs.extent()
    piece = torch.full((p._zs.piece.numel(),), 1000.0)
    piece[: hi - lo] = value[lo:hi]
    safe_set_local_grad(p, piece)
    local = safe_get_local_grad(p).cpu()
    full = safe_get_full_grad(p).cpu()
    others = [safe_get_full_grad(q) for q in engine.module.parameters() if q is not p]
    want = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in [*others, value]]))
    engine.step()
    got = engine.get_global_grad_norm()
    engine.destroy()
    return hi - lo, piece.numel(), local, full, float(got), float(want)


def test_the_padding_of_a_local_gradient_is_no_part_of_it():
    """``safe_set_local_grad`` takes the piece with its padding (as ``safe_get_local_grad``
    gives it); what a caller leaves there is not gradient: it reads back as zeros and is not
    in the full gradient or the norm."""
    value = torch.tensor([0.5, -1.0, 2.0])
    results = run_distributed(_padded_piece, 2)
    assert any(n < pn for n, pn, *_ in results)  # a piece with padding is in the test
    for n, pn, local, full, got, want in results:
        assert torch.equal(local[n:], torch.zeros(pn - n)), local
        assert torch.equal(full, value), full
        assert abs(got - want) <= 1e-6 * want, (got, want)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _checkpoints(rank, world, root, stage):
    records = _Records()
    logging.getLogger("zerostack").addHandler(records)
    first = _net_engine(world, stage, seed=1)
    _net_step(first, rank, world, 0)
    # nothing saved yet: (None, None) and DeepSpeed's warning, on rank 0 only
    empty = os.path.join(root, "empty")
    assert first.load_checkpoint(empty) == (None, None)
    warned = [m for m in records.messages if m.startswith("Unable to find latest file at")]
    assert len(warned) == (1 if rank == 0 else 0), records.messages
    assert f"{empty}/latest" in warned[0] if warned else True
    # a named tag that does not exist is an error, as in DeepSpeed
    with pytest.raises(CheckpointError) as info:
        first.load_checkpoint(empty, tag="nope")
    assert str(info.value) == f"{empty}/nope/manifest.json: missing (not a complete checkpoint)"

    first.save_checkpoint(os.path.join(root, "plain"), tag="t")
    saved = first.full_state_dict()
    # load_module_strict: the other model has c where the checkpoint has b
    other = _net_engine(world, stage, seed=2, second="c")
    before = other.full_state_dict()
    with pytest.raises(CheckpointError) as info:
        other.load_checkpoint(os.path.join(root, "plain"))
    assert str(info.value) == f"{root}/plain/t: no parameter 'c.weight' in the checkpoint"
    path, client = other.load_checkpoint(os.path.join(root, "plain"), load_module_strict=False)
    assert path == os.path.join(root, "plain", "t") and client == {}
    after = other.full_state_dict()
    for name in after:
        expected = saved[name] if name.startswith("a.") else before[name]
        assert torch.equal(after[name], expected), name

    # exclude_frozen_parameters: a frozen, left out; a load keeps the model's own a
    lora = _net_engine(world, stage, seed=3, frozen=True)
    _net_step(lora, rank, world, 1)
    assert safe_get_full_fp32_param(lora.module.a.weight) is None  # frozen: no master
    lora.save_checkpoint(os.path.join(root, "lora"), tag="t", exclude_frozen_parameters=True)
    trained = lora.full_state_dict()
    manifest = json.load(open(os.path.join(root, "lora", "t", "manifest.json")))
    assert manifest["excluded"] == ["a.bias", "a.weight"]
    assert sorted(manifest["params"]) == ["b.bias", "b.weight"]
    keys = [k for rec in manifest["files"] for k in rec["sha256"]]
    assert not [k for k in keys if k.startswith("master/a.")], keys
    fresh = _net_engine(world, stage, seed=4, frozen=True)
    own = fresh.full_state_dict()
    fresh.load_checkpoint(os.path.join(root, "lora"))  # strict: excluded is not missing
    loaded = fresh.full_state_dict()
    for name in loaded:
        assert torch.equal(loaded[name], own[name] if name.startswith("a.") else trained[name])

    # custom_load_fn(src=state_dict, dst=module) loads the weights; what it leaves is trained
    seen = []

    def custom(src, dst):
        seen.append(sorted(src))
        dst.load_state_dict(src)
        with torch.no_grad():
            dst.b.weight.mul_(2.0)

    target = _net_engine(world, stage, seed=5)
    target.load_checkpoint(os.path.join(root, "plain"), custom_load_fn=custom)
    assert seen == [["a.bias", "a.weight", "b.bias", "b.weight"]]
    for name, value in target.full_state_dict().items():
        expected = saved[name] * 2.0 if name == "b.weight" else saved[name]
        assert torch.equal(value, expected), name
    assert torch.equal(
        safe_get_full_fp32_param(target.module.b.weight).cpu(), saved["b.weight"] * 2
    )
    logging.getLogger("zerostack").removeHandler(records)
    return True


@pytest.mark.parametrize("stage", [1, 3])
def test_load_checkpoint_keywords_and_excluded_frozen(stage, tmp_path):
    assert run_distributed(_checkpoints, 2, args=(str(tmp_path), stage)) == [True, True]


# ---------------------------------------------------------------------------- 16-bit model
def _save16(rank, world, root, stage):
    gather = {"stage3_gather_16bit_weights_on_model_save": True} if stage == 3 else {}
    config = {
        "train_micro_batch_size_per_gpu": B // world,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **gather},
    }
    model = tiny_gpt()
    model.wpe.requires_grad_(False)
    engine, *_ = zerostack.initialize(model=model, config=config)
    x, y = batch(0, B)
    per = B // world
    engine.backward(engine(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
    engine.step()
    full = engine.full_state_dict()
    assert engine.save_16bit_model(root) is True
    assert engine.save_16bit_model(root, "lora.safetensors", exclude_frozen_parameters=True)
    keys = list(engine.module.state_dict())  # with the tied head's second name
    if stage == 3:
        sd = engine._zero3_consolidated_16bit_state_dict()
        assert (sd is None) == (rank != 0)
        config["zero_optimization"].pop("stage3_gather_16bit_weights_on_model_save")
        plain, *_ = zerostack.initialize(model=tiny_gpt(), config=config)
        assert plain.save_16bit_model(root, "not_saved.bin") is False
    else:
        with pytest.raises(ValueError, match="^this function requires ZeRO-3 mode$"):
            engine._zero3_consolidated_16bit_state_dict()
        held = {n: p.detach().clone() for n, p in engine.module.state_dict().items()}
    if rank != 0:
        return True
    # DeepSpeed's .bin: a plain tensor state dict that loads without unpickling code
    saved = torch.load(os.path.join(root, "pytorch_model.bin"), weights_only=True)
    assert sorted(saved) == sorted(keys)
    for key, t in saved.items():
        assert t.dtype == torch.bfloat16, key
        assert torch.equal(t, full["wte.weight" if key == "head.weight" else key].bfloat16()), key
        if stage != 3:  # the engine's own bf16 weights, whole at stages 0-2
            assert torch.equal(t, held[key]), key
    if stage == 3:
        assert list(sd) == keys and all(torch.equal(sd[k], saved[k]) for k in keys)
        assert not os.path.exists(os.path.join(root, "not_saved.bin"))
    lora = load_file(os.path.join(root, "lora.safetensors"))
    assert sorted(lora) == sorted(k for k in keys if k != "wpe.weight")
    return True


@pytest.mark.parametrize("stage", [2, 3])
def test_save_16bit_model_writes_the_whole_bf16_weights(stage, tmp_path):
    assert run_distributed(_save16, 2, args=(str(tmp_path), stage)) == [True, True]


# ---------------------------------------------------------------------------- controls
def _reference_two_micro_batches(lr=0.1):
    """SGD on the sum of the two micro-batches' mean losses (what accumulating them gives)."""
    ref = Net(10)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    loss = sum(ref(*_data(step)) for step in (0, 1))
    loss.backward()
    opt.step()
    return {n: p.detach() for n, p in ref.named_parameters()}


def _reductions(engine, since: int) -> int:
    return sum(
        1
        for r in engine.comm.log.records[since:]
        if r.axis == "dp" and r.op in ("all_reduce", "reduce_scatter")
    )


def _controls(rank, world):
    expected = _reference_two_micro_batches()
    engine = _net_engine(world, 1, seed=10)
    assert engine.get_batch_info() == (B, B // world, 1)
    assert (engine.fp16_enabled(), engine.bfloat16_enabled()) == (False, False)
    assert engine.zero_optimization_stage() == 1
    assert engine.loss_scale == 1.0 and engine.loss_scale() == 0.0
    # no_sync: the first micro-batch's gradients stay on each rank; the next backward reduces
    with engine.no_sync():
        since = len(engine.comm.log.records)
        _net_backward(engine, rank, world, 0)
        assert _reductions(engine, since) == 0
        with pytest.raises(RuntimeError, match="^no_sync context manager reentry is unsupported$"):
            with engine.no_sync():
                pass
        with pytest.raises(RuntimeError, match=r"^engine.step\(\) inside engine.no_sync\(\)"):
            engine.step()
    _net_backward(engine, rank, world, 1)
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 1
    diff, name = max_rel_diff(engine.full_state_dict(), expected)
    assert diff < TOL, (name, diff)
    # set_gradient_accumulation_boundary: the same two micro-batches, one step
    manual = _net_engine(world, 1, seed=10)
    manual.set_gradient_accumulation_boundary(False)
    _net_backward(manual, rank, world, 0)
    manual.step()
    assert not manual.was_step_applied() and manual.global_steps == 0
    manual.set_gradient_accumulation_boundary(True)
    _net_backward(manual, rank, world, 1)
    manual.step()
    assert manual.was_step_applied() and manual.global_steps == 1
    diff, name = max_rel_diff(manual.full_state_dict(), expected)
    assert diff < TOL, (name, diff)
    # stages 2-3 reduce gradients as backward goes: no_sync is refused, as in DeepSpeed
    partitioned = _net_engine(world, 2, seed=10)
    with pytest.raises(RuntimeError) as info:
        with partitioned.no_sync():
            pass
    assert str(info.value) == (
        "no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage 2"
    )
    # the loss scale: the current one as a number, DeepSpeed's configured one when called
    static = _net_engine(world, 0, seed=10, config={"fp16": {"enabled": True, "loss_scale": 128}})
    assert static.loss_scale == 128.0 and static.loss_scale() == 128.0
    assert static.fp16_enabled() and not static.dynamic_loss_scale()
    dynamic = _net_engine(
        world, 0, seed=10, config={"fp16": {"enabled": True, "initial_scale_power": 8}}
    )
    assert dynamic.loss_scale == 256.0 and dynamic.loss_scale() == 0.0
    assert dynamic._get_optimizer_loss_scale() == 256.0 and dynamic.dynamic_loss_scale()
    return True


def _net_backward(engine, rank, world, step):
    x, y = _data(step)
    per = B // world
    engine.backward(engine(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))


def test_no_sync_and_manual_boundary_accumulate_like_one_batch():
    assert run_distributed(_controls, 2) == [True, True]


def _trained_with(rank, world) -> dict[str, dict]:
    """Per way of dividing the loss: weights after 2 SGD steps (no clipping) of 2 micro-batches
    at stages 0, 2 and 3, and what rank 0 printed. The loss goes to ``backward`` whole ("engine":
    the engine divides it by the accumulation steps), divided first with
    ``scale_wrt_gas=False`` ("caller", as the Trainer calls it, with Accelerate's
    ``steps_per_print: inf``), or divided first and by the engine too ("twice")."""
    out: dict[str, dict] = {}
    for divide in ("engine", "caller", "twice"):
        out[divide] = {}
        for stage in (0, 2, 3):
            config = {
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": GAS,
                "gradient_clipping": 0.0,
                "steps_per_print": math.inf if divide == "caller" else 1,
                "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
                "zero_optimization": {"stage": stage},
            }
            engine, *_ = zerostack.initialize(model=tiny_gpt(), config=config)
            with contextlib.redirect_stdout(io.StringIO()) as printed:
                for step in range(2 * GAS):
                    x, y = batch(step, 2 * world)
                    loss = engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
                    if divide == "engine":
                        engine.backward(loss)
                    else:
                        engine.backward(loss / GAS, scale_wrt_gas=divide == "twice")
                    engine.step()
            out[divide][stage] = (engine.full_state_dict(), printed.getvalue())
            engine.destroy()
    return out


@pytest.mark.slow
def test_backward_scale_wrt_gas_false_leaves_the_division_to_the_caller():
    """With the loss divided by the caller (accumulation 2, a power of two: the division is
    exact), the weights are the engine's own division's bit for bit; divided twice they are
    not (plain SGD moves them by the gradient, so the factor shows). ``steps_per_print: inf``
    prints no progress line; 1 prints one a step."""
    runs = run_distributed(_trained_with, 2)[0]
    for stage, (want, printed) in runs["engine"].items():
        caller, silent = runs["caller"][stage]
        for k, v in want.items():
            assert torch.equal(caller[k], v), (stage, k)
        assert max_rel_diff(runs["twice"][stage][0], want)[0] > 1e-3, stage
        assert printed.count("step=") == 2 and "step=" not in silent, (printed, silent)


def _config_as_deepspeed_reads_it(rank, world):
    config = {
        "train_batch_size": 2 * world,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3},
    }
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=config)
    view = engine.config
    # what Transformers' save_model and Accelerate read: DeepSpeed's dict, defaults filled in
    assert view.get("zero_optimization", {}).get("stage") == 3
    assert view["train_micro_batch_size_per_gpu"] == 2 and view["gradient_accumulation_steps"] == 1
    assert "bf16" in view and "no_such_key" not in view and view.get("no_such_key", 7) == 7
    batch_keys = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}
    assert set(view) == set(view.typed.to_dict()) | batch_keys and len(view) == len(list(view))
    # zerostack's typed fields, as before
    assert view.zero_optimization.stage == 3 and view.typed is zerostack.load_config(view)
    # read-only: a write would change nothing in the running engine, so it is refused
    view["zero_optimization"]["stage"] = 1
    assert view["zero_optimization"]["stage"] == 3
    with pytest.raises(TypeError, match="engine.config is read-only"):
        view.gradient_clipping = 1.0
    with pytest.raises(TypeError):
        view["gradient_clipping"] = 1.0
    engine.destroy()
    return True


def test_engine_config_reads_as_deepspeeds_dict_and_as_the_typed_config():
    assert run_distributed(_config_as_deepspeed_reads_it, 1) == [True]


class _Seen:
    """A user's step callback: what each report said."""

    wants_loss = True

    def __init__(self):
        self.reports = []

    def after_step(self, report):
        loss = None if report.loss is None else float(report.loss)
        loss = "nan" if loss is not None and math.isnan(loss) else loss  # comparable
        self.reports.append(
            (report.step, report.samples, loss, report.applied, report.skipped_steps, report.lrs)
        )


def _reports(rank, world):
    engine = _net_engine(world, 1, seed=0, config={"gas": GAS})
    seen = engine.add_callback(_Seen())
    per = B // world // GAS
    losses = []
    for step in range(3):
        x, y = _data(step)
        if step == 1 and rank == world - 1:
            x[-1, 0] = float("nan")  # one rank's NaN skips the step on every rank
        mine = [
            (x[(rank * GAS + m) * per :][:per], y[(rank * GAS + m) * per :][:per])
            for m in range(GAS)
        ]
        losses.append(float(engine.train_batch(iter(mine))))
    engine.destroy()
    return losses, seen.reports


def test_a_step_callback_gets_each_steps_report():
    """``engine.add_callback``: after each optimizer step a callback gets the step's report: the
    counters after it, the window's mean loss over micro-batches and dp ranks (what
    ``train_batch`` returns), whether it was applied, and the learning rates."""
    out = run_distributed(_reports, 2)
    (losses, reports), (losses1, reports1) = out
    assert reports == reports1  # every rank the same report
    assert [r[:2] for r in reports] == [(1, B), (2, 2 * B), (3, 3 * B)]
    assert [r[3:5] for r in reports] == [(True, 0), (False, 1), (True, 1)]
    assert all(r[5] == [0.1] for r in reports)
    assert reports[1][2] == "nan" and math.isnan(losses[1])
    assert [reports[0][2], reports[2][2]] == [losses[0], losses[2]] == [losses1[0], losses1[2]]


def _two_engines(rank, world):
    from zerostack.compat.deepspeed.runtime.engine import DeepSpeedEngine
    from zerostack.compose import initialize as native_initialize

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    from zerostack.engine import Engine

    own = [  # DeepSpeedEngine's and its compat mixins' (EngineQueries), less what it overrides
        n
        for cls in DeepSpeedEngine.__mro__
        if cls.__module__.startswith("zerostack.compat.")
        for n in vars(cls)
        if not n.startswith("__") and n not in vars(Engine)
    ]
    native, *_ = native_initialize(model=tiny_gpt(), config=config)
    ds, *_ = zerostack.initialize(model=tiny_gpt(), config=config)
    out = (
        type(native).__name__,
        type(ds).__name__,
        sorted(own),
        [n for n in own if hasattr(native, n)],
        [n for n in own if not hasattr(ds, n)],
    )
    native.destroy()
    ds.destroy()
    return out


def test_deepspeeds_own_accessors_live_on_its_engine_alone():
    from zerostack.compat.deepspeed.runtime.engine import DeepSpeedEngine
    from zerostack.engine import Engine

    """``zerostack.initialize`` is DeepSpeed's and returns a ``DeepSpeedEngine``: the native
    engine plus the accessors DeepSpeed's callers alone use, which the native engine lacks."""
    ((native, ds, own, on_native, missing),) = run_distributed(_two_engines, 1)
    assert (native, ds) == ("Engine", "DeepSpeedEngine")
    assert {"fp16_enabled", "zero_optimization_stage", "save_16bit_model", "loss_scale"} <= set(own)
    assert on_native == [] and missing == []
    # what DeepSpeedEngine overrides: backward and step, refused while offload_states() holds
    # the states in host memory; forward and step, which start and stop DeepSpeed's tput_timer
    overridden = [n for n in vars(DeepSpeedEngine) if n in vars(Engine) and n[:2] != "__"]
    assert sorted(overridden) == ["backward", "forward", "step"]


class _Ticks:
    """A clock that moves one second per reading."""

    def __init__(self):
        self.t = 0.0

    def now(self):
        self.t += 1.0
        return self.t


def _optimizer_surface(rank, world):
    import zerostack.compat.deepspeed as deepspeed

    out = {}
    for stage in (2, 3):
        ran = {}
        for how in ("engine", "optimizer"):
            engine, optimizer, *_ = deepspeed.initialize(
                model=Net(0), config=_net_config(world, stage, gas=2, steps_per_print=2)
            )
            engine.tput_timer.clock = _Ticks()
            records, logger = _Records(), logging.getLogger("zerostack")
            logger.addHandler(records)
            level = logger.level
            logger.setLevel(logging.INFO)  # DeepSpeed's logs its lines at info
            per = B // world // 2
            for step in range(6):
                x, y = _data(step)
                for m in range(2):
                    lo = (rank * 2 + m) * per
                    loss = engine(x[lo : lo + per], y[lo : lo + per])
                    if how == "engine":
                        engine.backward(loss)
                    else:  # DeepSpeed's ZeRO optimizer does not divide by the accumulation
                        optimizer.backward(loss / 2)
                    engine.step()
                if step == 3:
                    engine.tput_timer.update_epoch_count()
            logger.removeHandler(records)
            logger.setLevel(level)
            t = engine.tput_timer
            ran[how] = {
                "state": engine.full_state_dict(),
                "timer": (t.epoch_count, t.micro_step_count, t.global_step_count,
                          t.avg_samples_per_sec()),
                "lines": [m for m in records.messages if "RunningAvgSamplesPerSec" in m],
                "pieces": [p.ds_tensor is p._zs.piece for p in engine.module.parameters()
                           if hasattr(p, "ds_tensor")],
                "count": sum(p.ds_numel if hasattr(p, "ds_tensor") else p.numel()
                             for p in engine.module.parameters()),
            }
            engine.destroy()
        out[stage] = ran
    return out


def test_deepspeed_optimizer_backward_throughput_timer_and_ds_tensor():
    """What DeepSpeed-Chat's and BERT scripts reach for: ``optimizer.backward(loss)`` (the loss
    not divided by the accumulation steps: divided by the caller it gives engine.backward's
    weights bit for bit, with SGD); ``engine.tput_timer`` (DeepSpeed's rules: 2 steps of
    warm-up untimed, a line every ``steps_per_print`` timed steps; with a clock of one second per
    reading each timed micro-step lasts 1 s, so 2 per step: 16 samples / 2 s); and stage 3's
    ``p.ds_tensor``, this rank's live piece (DeepSpeed-Chat counts ``ds_numel`` where it is)."""
    out = run_distributed(_optimizer_surface, 2)[0]
    for stage, ran in out.items():
        want = ran["engine"]
        for k, v in want["state"].items():
            assert torch.equal(ran["optimizer"]["state"][k], v), (stage, k)
        assert want["timer"] == (1, 4, 6, B / 2.0), stage
        assert [m.split(",")[0] for m in want["lines"]] == [  # step 2 is untimed: no line
            "epoch=0/micro_step=8/global_step=4", "epoch=1/micro_step=4/global_step=6"
        ]
        assert "RunningAvgSamplesPerSec=4.0," in want["lines"][-1]
        assert want["count"] == sum(p.numel() for p in Net(0).parameters())
        assert want["pieces"] == ([True] * 4 if stage == 3 else []), stage


def _overflow_checks(rank, world):
    import zerostack.compat.deepspeed as deepspeed

    out = {}
    for stage in (1, 2, 3):
        engine, optimizer, *_ = deepspeed.initialize(
            model=Net(0), config=_net_config(world, stage, gas=2)
        )
        per, seen = B // world // 2, []
        x, y = _data(0)
        for m in range(2):
            lo = (rank * 2 + m) * per
            loss = engine(x[lo : lo + per], y[lo : lo + per])
            if m == 1 and rank == 0:
                loss = loss * float("inf")  # one rank's second micro-batch overflows
            engine.backward(loss)
            optimizer.check_overflow()
            seen.append(optimizer.overflow)
            engine.step()
        out[stage] = (seen, engine.was_step_applied(), optimizer.overflow)
        engine.destroy()
    return out


def test_check_overflow_sees_any_ranks_non_finite_gradient():
    """DeepSpeed's ``optimizer.check_overflow()`` (DeepSpeed-Chat aligns the actor's and
    critic's skipped steps with it): False after a finite micro-step, True on every rank once one
    rank's gradients hold an inf, before the step, which then skips."""
    for out in run_distributed(_overflow_checks, 2):
        for stage, (seen, applied, overflow) in out.items():
            assert seen == [False, True] and not applied and overflow, stage
