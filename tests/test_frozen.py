"""Frozen parameters (``requires_grad=False``) in checkpoints: a LoRA-style model, frozen base
Linears with trainable low-rank adapters and a frozen embedding, trained at ZeRO stages 0-3.

The frozen weights stay exactly their initial values through training, are written to the
checkpoint (fp32 of what is held: bf16-rounded in a bf16 run), come back on another ZeRO stage
and dp size, and are in the consolidated state dict, which a plain model loads strictly and then
computes exactly the engine's logits (fp32 throughout, the same ops on the same values: the
comparison is ``torch.equal``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerostack
from zerostack.checkpoint import CheckpointError

from tests.support.ranks import run_distributed

pytestmark = pytest.mark.distributed  # every test here starts ranks

V, B, STEPS = 11, 8, 3
FP32 = [f"s{stage}" for stage in range(4)]
RUNS = {
    **{f"s{stage}": (stage, False) for stage in range(4)},
    "bf16_s1": (1, True),
    "bf16_s3": (3, True),
    "s3_param_cpu": (3, False),
}
# Runs whose stage-3 parameter pieces live in host memory (offload_param), frozen ones included:
# a checkpoint reads those pieces in and a load writes them back.
OFFLOADED = {"s3_param_cpu"}


class LoRALinear(nn.Module):
    """A frozen base Linear plus a trainable low-rank update ``b @ a``."""

    def __init__(self, d_in: int, d_out: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, d_in) * 0.3)
        self.b = nn.Parameter(torch.zeros(d_out, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


class Tiny(nn.Module):
    # l1.base.bias has 7 elements: split unevenly over dp 2, and at stage 3 below the persistence
    # threshold (8), so it stays gathered and must be refreshed after a load.
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 8).requires_grad_(False)
        self.l1 = LoRALinear(8, 7)
        self.l2 = LoRALinear(7, 8)
        self.head = nn.Linear(8, V)

    def forward(self, x, y=None):
        logits = self.head(self.l2(torch.tanh(self.l1(self.emb(x)))))
        return logits if y is None else F.cross_entropy(logits.flatten(0, 1), y.flatten())


def tiny(seed: int) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


FROZEN = [n for n, p in tiny(0).named_parameters() if not p.requires_grad]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (B, 5), generator=g), torch.randint(0, V, (B, 5), generator=g)


def _engine(world: int, stage: int, bf16: bool = False, seed: int = 0, offload: bool = False):
    cfg = {
        "train_micro_batch_size_per_gpu": B // world,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 8},
        "bf16": {"enabled": bf16},
    }
    if offload:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    engine, *_ = zerostack.initialize(model=tiny(seed), config=cfg)
    return engine


def _logits(engine) -> torch.Tensor:
    with torch.no_grad():
        return engine(_batch(99)[0]).float()


def _train_and_save(rank, world, root):
    """Each run: 3 steps from seed 0, the frozen weights checked unchanged, then saved."""
    initial = dict(tiny(0).named_parameters())
    out = {}
    for name, (stage, bf16) in RUNS.items():
        engine = _engine(world, stage, bf16, offload=name in OFFLOADED)
        per = B // world
        for step in range(STEPS):
            x, y = _batch(step)
            engine.backward(
                engine(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
            )
            engine.step()
        state = engine.full_state_dict()
        for n in FROZEN:
            want = initial[n].detach().to(torch.bfloat16).float() if bf16 else initial[n]
            assert torch.equal(state[n], want), f"{name}: frozen {n} changed in training"
        assert not torch.equal(state["l1.b"], initial["l1.b"]), f"{name}: the adapters trained"
        engine.save_checkpoint(f"{root}/{name}")
        out[name] = (state, _logits(engine))
    return out


def _load_elsewhere(rank, world, root, plan):
    """``plan``: (saved run, stage to load it at, where to save it again or None, offload_param);
    a load that fails gives its message."""
    out = {}
    for src, stage, again, offload in plan:
        # other weights, frozen ones included
        engine = _engine(world, stage, seed=5, offload=offload)
        try:
            engine.load_checkpoint(f"{root}/{src}")
        except CheckpointError as exc:
            out[src] = str(exc)
            continue
        out[src] = (engine.full_state_dict(), _logits(engine))
        if again:
            engine.save_checkpoint(f"{root}/{again}")
    return out


def test_frozen_parameters_save_load_and_consolidate_at_every_stage(tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file

    from zerostack.checkpoint import consolidate

    root = str(tmp_path)
    saved = run_distributed(_train_and_save, 2, args=(root,))[0]
    initial = dict(tiny(0).named_parameters())

    # (a) consolidated: a plain model loads it strictly and computes the engine's logits.
    for name, (_, bf16) in RUNS.items():
        state, logits = saved[name]
        weights = load_file(consolidate(f"{root}/{name}", f"{root}/{name}.safetensors"))
        plain = tiny(7)
        plain.load_state_dict(weights, strict=True)
        for n, p in plain.named_parameters():
            assert torch.equal(p.detach(), state[n]), f"{name}: {n}"
        for n in FROZEN:
            want = initial[n].detach().to(torch.bfloat16).float() if bf16 else initial[n]
            assert torch.equal(weights[n], want), f"{name}: consolidated frozen {n}"
        if not bf16:
            with torch.no_grad():
                assert torch.equal(plain(_batch(99)[0]), logits), f"{name}: logits"

    # (b) dp 2 -> dp 1 on another stage (stage 3 -> 0 and 0 -> 3 among them), saved there, and
    # back to dp 2 at the original stage: the same parameters and logits at every hop.
    there = [(name, 3 - RUNS[name][0], f"dp1_{name}", False) for name in FP32]
    there += [("bf16_s3", 0, None, False), ("s3_param_cpu", 1, "dp1_s3_param_cpu", False)]
    dp1 = run_distributed(_load_elsewhere, 1, args=(root, there))[0]
    # A checkpoint without a frozen parameter's slices (as written before frozen parameters were
    # saved) is refused with the parameter's name, not loaded with the fresh model's values.
    shutil.copytree(f"{root}/s3", f"{root}/no_emb")
    path = f"{root}/no_emb/global_step{STEPS}/manifest.json"
    manifest = json.loads(open(path).read())
    for rec in manifest["files"]:
        rec["slices"] = [s for s in rec["slices"] if s[0] != "emb.weight"]
    open(path, "w").write(json.dumps(manifest))
    back = [(f"dp1_{name}", RUNS[name][0], None, False) for name in FP32]
    back += [("no_emb", 1, None, False), ("dp1_s3_param_cpu", 3, None, True)]
    dp2 = run_distributed(_load_elsewhere, 2, args=(root, back))[0]
    for name in [*FP32, *OFFLOADED]:
        state, logits = saved[name]
        for got, where in ((dp1[name], "dp 1"), (dp2[f"dp1_{name}"], "back at dp 2")):
            assert got[0].keys() == state.keys()
            for n in state:
                assert torch.equal(got[0][n], state[n]), f"{name} {where}: {n}"
            assert torch.equal(got[1], logits), f"{name} {where}: logits"
    assert "emb.weight: slices cover 0 of elements" in dp2["no_emb"], dp2["no_emb"]
    for n in FROZEN:  # a bf16 run's frozen weights load into fp32 as the bf16 values they were
        assert torch.equal(dp1["bf16_s3"][0][n], initial[n].detach().to(torch.bfloat16).float())


def _empty_group(rank, world, stage):
    """The Hugging Face Trainer's optimizer for a LoRA model: a weight-decay group holding every
    trainable parameter and a no-decay group left empty (no trainable bias or norm)."""
    model = tiny(0)
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": trained, "weight_decay": 0.0}, {"params": [], "weight_decay": 0.0}]
    cfg = {"train_micro_batch_size_per_gpu": B // world, "zero_optimization": {"stage": stage}}
    engine, *_ = zerostack.initialize(
        model=model, optimizer=torch.optim.SGD(groups, lr=0.5), config=cfg
    )
    per = B // world
    for step in range(STEPS):
        x, y = _batch(step)
        engine.backward(engine(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
        engine.step()
    return engine.full_state_dict()


def test_an_empty_optimizer_group_trains_as_one_process():
    """SGD without clipping at dp 2, stages 0-3, against one process (stage 2 once failed on
    the empty group's bucket, which holds only padding)."""
    want = run_distributed(_empty_group, 1, args=(0,))[0]
    for stage in range(4):
        for got in run_distributed(_empty_group, 2, args=(stage,)):
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
