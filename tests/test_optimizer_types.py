"""The config's ``"optimizer": {"type": "Lion"}`` and ``"Adagrad"`` train as DeepSpeed 0.19.8's
do: the same tiny model, config and batches as scripts/optimizer_types_golden.py ran under real
DeepSpeed (its losses in tests/golden/optimizer_types.json), on one rank and on dp 2, within
1e-5 relative at every step. The sharded update against one process's is in test_parity.py
(families ``lion-adagrad-*``); Lion's update against DeepSpeed's kernels in
test_ds_optimizers.py."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import zerostack
from zerostack.optim import Lion

from tests.support.ranks import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import optimizer_types_golden as golden  # noqa: E402

GOLDEN = json.load(open(os.path.join(ROOT, "tests", "golden", "optimizer_types.json")))
TOL = 1e-5


def _losses(rank, world, name):
    config = golden.config(name)
    config["train_micro_batch_size_per_gpu"] = golden.MICRO // world
    engine, *_ = zerostack.initialize(model=golden.model(), config=config)
    per = golden.MICRO // world
    losses = []
    for ids in golden.batches():
        loss = engine(ids[rank * per : (rank + 1) * per])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    kind = type(engine.optimizer).__name__
    engine.destroy()
    return losses, kind


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", list(golden.CASES))
def test_losses_are_deepspeeds(name, world):
    assert GOLDEN["deepspeed"] == "0.19.8"
    results = run_distributed(_losses, world, args=(name,))
    ours = [sum(r[0][step] for r in results) / world for step in range(golden.STEPS)]
    theirs = GOLDEN["cases"][name]
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert abs(a - b) <= TOL * abs(b), (name, step, ours, theirs)
    want = Lion if name.startswith("lion") else torch.optim.Adagrad
    assert all(kind == want.__name__ for _, kind in results), results


def test_the_types_build_their_optimizers_with_the_configs_values():
    """Every params key reaches the optimizer (each set away from its default)."""
    from zerostack.config import load_config
    from zerostack.optim import build_optimizer

    p = [torch.nn.Parameter(torch.zeros(3))]
    lion = load_config({"optimizer": golden.LION}).optimizer
    got = build_optimizer(lion, [{"params": p}]).defaults
    assert got == {"lr": 2e-3, "betas": (0.8, 0.95), "weight_decay": 0.1}
    spec = dict(golden.ADAGRAD, params={**golden.ADAGRAD["params"], "maximize": True})
    got = build_optimizer(load_config({"optimizer": spec}).optimizer, [{"params": p}]).defaults
    want = {"lr": 0.05, "eps": 1e-8, "weight_decay": 0.01, "lr_decay": 0.02,
            "initial_accumulator_value": 0.1, "maximize": True}  # fmt: skip
    assert {k: got[k] for k in want} == want


def test_where_deepspeeds_lion_moves_a_weight_without_gradient_ours_leaves_it():
    """DeepSpeed's CPU Lion computes ``-copysign(lr, c)``: an element whose update direction
    ``c`` is zero (no gradient, no momentum: an embedding row not in the batch, a shard's
    padding) moves down by a whole lr each step (its FusedLion moves it up). The paper's update
    is ``sign(c)``, 0 there: zerostack keeps such weights where they are, as Adam does."""
    probe = GOLDEN["zero_gradient"]
    assert probe["after"] == pytest.approx([0.9, 0.9, 0.9])  # DeepSpeed: all three moved
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([0.0, -0.0, 1.0])
    Lion([p], lr=probe["lr"]).step()
    assert p.detach().tolist() == pytest.approx([1.0, 1.0, 0.9])


def _resume(rank, world, name, stage, root):
    """tests/support/models.py's resume_pair with Lion's or Adagrad's config."""
    from tests.support.models import resume_pair

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": golden.LION if name == "lion" else golden.ADAGRAD,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    return resume_pair(rank, world, config, root)


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("name", ["lion", "adagrad"])
def test_a_checkpoint_resumes_exactly(name, stage, tmp_path):
    """The state each keeps (Lion's momentum; Adagrad's sums and step) is saved and comes back:
    the resumed run equals the uninterrupted one bit for bit."""
    for uninterrupted, resumed, want, got in run_distributed(
        _resume, 2, args=(name, stage, str(tmp_path))
    ):
        assert resumed == uninterrupted
        kinds = {k.split("/")[1] for k in want if k.startswith("master")}
        assert kinds >= ({"exp_avg"} if name == "lion" else {"sum", "step"}), kinds
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k


def test_sgds_torch_keys_reach_it_and_fused_adams_set_grad_none_loads():
    """DeepSpeed hands SGD's params to torch's SGD and Adam's to FusedAdam: ``maximize`` and
    ``foreach`` are torch's, ``set_grad_none`` FusedAdam's (gradients are released after every
    step here either way)."""
    from zerostack.config import load_config
    from zerostack.optim import build_optimizer

    p = [torch.nn.Parameter(torch.zeros(3))]
    spec = {"type": "SGD", "params": {"lr": 0.1, "maximize": True, "foreach": False}}
    got = build_optimizer(load_config({"optimizer": spec}).optimizer, [{"params": p}]).defaults
    assert (got["maximize"], got["foreach"]) == (True, False)
    adam = {"type": "Adam", "params": {"set_grad_none": False}}
    assert load_config({"optimizer": adam}).optimizer.params.set_grad_none is False
