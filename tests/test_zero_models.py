"""ZeRO stages 0-3 on awkward models: sizes not divisible by N, a parameter with no gradient.

The reference is single-process fp32 torch.optim on the whole batch; tolerance 1e-5 relative as
in test_data_parallel. A parameter that never gets a gradient sees a zero gradient in the flat
buffer (as in DeepSpeed): with Adam and no weight decay that leaves it exactly where torch (which
skips it) leaves it, so it sits in the no-decay group here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerostack

from tests.support.models import max_rel_diff
from tests.support.ranks import run_distributed

pytestmark = pytest.mark.distributed  # every test here starts ranks

STEPS, B = 5, 8


class Odd(nn.Module):
    """61 parameters: not divisible by 2 or 4; ``unused`` never reaches the loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(7, 5)
        self.b = nn.Linear(5, 3)
        self.unused = nn.Parameter(torch.randn(3))

    def forward(self, x, y):
        return F.mse_loss(self.b(torch.tanh(self.a(x))), y)


def _groups(model):
    return [
        {"params": [model.a.weight, model.b.weight], "weight_decay": 0.1},
        {"params": [model.a.bias, model.b.bias, model.unused], "weight_decay": 0.0},
    ]


def _data(step, n):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 7, generator=g), torch.randn(n, 3, generator=g)


def _reference(gas, optimizer):
    model = Odd()
    if optimizer == "AdamW":
        opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    else:
        opt = torch.optim.SGD(_groups(model), lr=1e-1, momentum=0.9)
    for step in range(STEPS):
        x, y = _data(step, B * gas)
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _poison(engine) -> None:
    """Fill stage 2's buffer pool with NaN buffers of every bucket's sizes, as many as it
    keeps: whatever a reused buffer held must never reach a gradient."""
    pool = engine.zero.flat.pool
    for st in engine.zero.flat.buckets:
        for numel in (st.bucket.numel, st.bucket.piece_numel):
            for _ in range(pool.keep):
                pool.give(torch.full((numel,), float("nan")))


def _train(rank, world, stage, gas, optimizer, poison=False):
    model = Odd()
    params = {"lr": 1e-2} if optimizer == "AdamW" else {"lr": 1e-1, "momentum": 0.9}
    cfg = {
        "train_micro_batch_size_per_gpu": B // world,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.5,
        "optimizer": {"type": optimizer, "params": params},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 20,
            "stage3_param_persistence_threshold": 4,  # the biases stay whole, the rest is split
        },
    }
    engine, *_ = zerostack.initialize(model=model, model_parameters=_groups(model), config=cfg)
    if poison:
        _poison(engine)
    n = B // world
    for step in range(STEPS):
        x, y = _data(step, B * gas)
        for micro in range(gas):
            lo = micro * B + rank * n
            engine.backward(engine(x[lo : lo + n], y[lo : lo + n]))
            engine.step()
    if poison:  # nothing a reused buffer held reached the flat masters or their Adam moments,
        # padding included (the gradient norm, summed parameter by parameter, would not show it)
        flat = [*engine.zero.masters()]
        flat += [t for m in flat for t in engine.optimizer.state[m].values() if t.dim() > 0]
        assert all(torch.isfinite(t).all() for t in flat)
    return engine.full_state_dict()


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.slow
def test_odd_sizes_and_an_unused_parameter(world, stage, optimizer):
    ref = _reference(2, optimizer)
    results = run_distributed(_train, world, args=(stage, 2, optimizer))
    for got in results:  # every rank ends with the same full weights
        diff, name = max_rel_diff(got, ref)
        assert diff <= 1e-5, f"{name}: relative difference {diff:.2e}"
    assert torch.equal(results[0]["unused"], Odd().unused)


@pytest.mark.parametrize("world", [1, 2])
def test_stage2_reuses_buffers_without_their_old_values(world):
    """Stage 2 stages each bucket in a reused buffer (core/scratch.py's Pool) and writes only
    the ranges of parameters that got a gradient: the padding and the unused parameter's range
    must still be zeros, here where every buffer the pool starts with is NaN."""
    ref = _reference(2, "AdamW")
    for got in run_distributed(_train, world, args=(2, 2, "AdamW", True)):
        diff, name = max_rel_diff(got, ref)
        assert diff <= 1e-5, f"{name}: relative difference {diff:.2e}"
        assert torch.equal(got["unused"], Odd().unused)
