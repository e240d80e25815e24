"""fp16 dynamic loss scaling (DeepSpeed's arithmetic) and bf16 training through the engine."""

from __future__ import annotations

import pytest
import torch

import zerostack
from zerostack.core.precision import DynamicLossScaler

from tests.support.models import batch, tiny_gpt
from tests.support.ranks import run_distributed


def test_scaler_hysteresis_halving_floor_and_growth():
    """DeepSpeed 0.19.8's arithmetic (``DynamicLossScaler.update_scale``)."""
    s = DynamicLossScaler(
        initial_scale_power=4, loss_scale_window=3, hysteresis=2, min_loss_scale=4
    )
    s.update(overflow=True)  # first overflow is absorbed by hysteresis
    assert s.loss_scale == 16
    s.update(overflow=True)  # hysteresis spent: halve
    assert s.loss_scale == 8
    s.update(overflow=True)
    assert s.loss_scale == 4
    for _ in range(3):  # the first clean step after an overflow does not count
        s.update(overflow=False)
        assert s.loss_scale == 4
    s.update(overflow=False)  # third counted clean step since the last overflow: grow
    assert s.loss_scale == 8
    assert s.cur_hysteresis == 2  # refilled on growth
    for _ in range(3):  # each further window of clean steps grows it again
        s.update(overflow=False)
    assert s.loss_scale == 16


def test_scaler_overflow_at_the_floor_ends_the_run():
    s = DynamicLossScaler(initial_scale_power=3, hysteresis=1, min_loss_scale=4)
    s.update(overflow=True)
    assert s.loss_scale == 4
    with pytest.raises(FloatingPointError, match=r"minimum loss scale \(fp16.min_loss_scale=4\)"):
        s.update(overflow=True)


def test_scaler_state_round_trip():
    a = DynamicLossScaler(initial_scale_power=8, loss_scale_window=2, hysteresis=1)
    for overflow in (True, False, False, True, False):
        a.update(overflow)
    b = DynamicLossScaler(initial_scale_power=8, loss_scale_window=2, hysteresis=1)
    b.load_state_dict(a.state_dict())
    for overflow in (False, False, True):
        a.update(overflow)
        b.update(overflow)
        assert a.loss_scale == b.loss_scale


def _fp16_overflow(rank, world):
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "fp16": {
            "enabled": True,
            "initial_scale_power": 10,
            "loss_scale_window": 3,
            "hysteresis": 1,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
    scales, skipped, changed = [], [], []
    for step in range(6):
        x, y = batch(step, 4 * world)
        before = [p.detach().clone() for p in engine.module.parameters()]
        loss = engine(x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4])
        if step == 1 and rank == world - 1:
            loss = loss * float("inf")  # one rank overflows: every rank must skip
        engine.backward(loss)
        engine.step()
        after = list(engine.module.parameters())
        changed.append(any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)))
        scales.append(engine.loss_scale)
        skipped.append(engine.skipped_steps)
    return scales, skipped, changed


@pytest.mark.distributed
def test_fp16_overflow_skips_step_halves_scale_and_regrows():
    for scales, skipped, changed in run_distributed(_fp16_overflow, 2):
        # step 0 clean; step 1 overflows (skip, halve); steps 2-5 clean: the first after an
        # overflow does not count (DeepSpeed 0.19), so it grows after the next 3.
        assert scales == [1024, 512, 512, 512, 512, 1024]
        assert skipped == [0, 1, 1, 1, 1, 1]
        assert changed == [True, False, True, True, True, True]


def _bf16_losses(rank, world):
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    }
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    losses = []
    for step in range(30):
        x, y = batch(step, 8 * world)
        loss = engine(x[rank * 8 : rank * 8 + 8], y[rank * 8 : rank * 8 + 8])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.distributed
def test_bf16_trains_and_loss_falls():
    losses = run_distributed(_bf16_losses, 2)[0]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, f"bf16 loss went from {first:.3f} to {last:.3f}"
