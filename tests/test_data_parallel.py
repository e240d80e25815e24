"""Parity: ZeRO stages 0-3 at dp = 1, 2, 4 end where single-process fp32 training ends.

Tolerance 1e-5 relative per tensor: the only differences are the order of floating-point sums
(per-rank means averaged by the all-reduce instead of one mean over the batch, and a flat-buffer
gradient norm), each ~1e-7 relative per step, which Adam's normalised update keeps from growing.
"""

from __future__ import annotations

import pytest

import zerostack

from tests.support.models import batch, max_rel_diff, reference_train, tiny_gpt
from tests.support.ranks import run_distributed

STEPS = 5
B = 8  # global batch per micro-step window


def _train(rank, world, gas, clip, optimizer="AdamW", stage=0, persist=0):
    params = {"lr": 1e-3, "weight_decay": 0.01}
    if optimizer == "SGD":
        params.update(momentum=0.9)
    cfg = {
        "train_micro_batch_size_per_gpu": B // world,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": optimizer, "params": params},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 5000,
            "stage3_param_persistence_threshold": persist,
            "stage3_prefetch_bucket_size": 3000,
        },
    }
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
    per_rank = B // world
    for step in range(STEPS):
        x, y = batch(step, B * gas)
        for micro in range(gas):
            lo = micro * B + rank * per_rank
            loss = engine(x[lo : lo + per_rank], y[lo : lo + per_rank])
            engine.backward(loss)
            engine.step()
    assert engine.global_steps == STEPS and engine.micro_steps == STEPS * gas
    state = engine.full_state_dict()  # a collective at stages 1-2: every rank calls it
    return state if rank == 0 else None


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.slow
def test_matches_single_process(stage, world, gas):
    ref = reference_train(STEPS, B * gas, clip=0.5)
    got = run_distributed(_train, world, args=(gas, 0.5), kwargs={"stage": stage})[0]
    diff, name = max_rel_diff(got, ref)
    assert diff <= 1e-5, f"{name}: relative difference {diff:.2e}"


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.slow
def test_without_clipping_and_with_sgd(stage):
    ref = reference_train(STEPS, B)
    got = run_distributed(_train, 2, args=(1, 0.0), kwargs={"stage": stage})[0]
    diff, name = max_rel_diff(got, ref)
    assert diff <= 1e-5, f"AdamW {name}: relative difference {diff:.2e}"
    ref = reference_train(STEPS, B, optimizer="sgd")
    got = run_distributed(_train, 2, args=(1, 0.0), kwargs={"optimizer": "SGD", "stage": stage})[0]
    diff, name = max_rel_diff(got, ref)
    assert diff <= 1e-5, f"SGD {name}: relative difference {diff:.2e}"


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("clip", [0.5, 100.0])
def test_clipping_with_sgd(stage, clip):
    """SGD, which keeps every constant factor Adam would normalise away: the clipping factor
    where it acts (0.5, below the norm) and where it must be 1 (100, above it)."""
    ref = reference_train(STEPS, B, clip=clip, optimizer="sgd")
    got = run_distributed(_train, 2, args=(1, clip), kwargs={"optimizer": "SGD", "stage": stage})
    diff, name = max_rel_diff(got[0], ref)
    assert diff <= 1e-5, f"{name}: relative difference {diff:.2e}"


@pytest.mark.distributed
def test_stage3_with_small_parameters_kept_whole():
    """stage3_param_persistence_threshold above the LayerNorm sizes: those stay gathered."""
    ref = reference_train(STEPS, B * 2, clip=0.5)
    got = run_distributed(_train, 2, args=(2, 0.5), kwargs={"stage": 3, "persist": 100})[0]
    diff, name = max_rel_diff(got, ref)
    assert diff <= 1e-5, f"{name}: relative difference {diff:.2e}"


def test_clipping_changes_the_result():
    """Guards the parity test itself: with clip 0.5 the norm is above it, so clipping acts."""
    diff, _ = max_rel_diff(reference_train(STEPS, B, clip=0.5), reference_train(STEPS, B))
    assert diff > 1e-3


def _accumulate(rank, world, micro, gas, stage):
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
    assert engine.train_batch_size() == 16
    for step in range(3):
        x, y = batch(step, 16)
        for m in range(gas):
            lo = (m * world + rank) * micro
            engine.backward(engine(x[lo : lo + micro], y[lo : lo + micro]))
            engine.step()
    return engine.full_state_dict()


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.slow
def test_gradient_accumulation_invariance(stage):
    """The same global batch of 16 as micro 8 x GAS 1, micro 2 x GAS 4, micro 1 x GAS 8 (dp=2)
    gives the parameters of one step on all 16 sequences: the loss is normalised once."""
    ref = reference_train(3, 16, clip=0.5)
    for micro, gas in [(8, 1), (2, 4), (1, 8)]:
        got = run_distributed(_accumulate, 2, args=(micro, gas, stage))[0]
        diff, name = max_rel_diff(got, ref)
        assert diff <= 1e-5, f"micro {micro} x gas {gas}: {name} differs by {diff:.2e}"


def _batches(rank, world, stage):
    """train_batch on a plain engine against the DeepSpeed-style loop it stands for."""
    import torch

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }

    def micro(step):
        x, y = batch(step, 8)
        for m in range(2):
            lo = (m * world + rank) * 2
            yield x[lo : lo + 2], y[lo : lo + 2]

    by_loop, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
    by_batch, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
    loop_losses, batch_losses = [], []
    for step in range(3):
        total = 0.0
        for x, y in micro(step):
            loss = by_loop(x, y)
            by_loop.backward(loss)
            by_loop.step()
            total += loss.item()
        mean = torch.tensor(total / 2)
        by_loop.comm.all_reduce(mean, axis="dp")
        loop_losses.append(mean.item() / world)
        batch_losses.append(by_batch.train_batch(micro(step)).item())
    evaluated = by_batch.eval_batch(micro(0)).item()
    a, b = by_loop.full_state_dict(), by_batch.full_state_dict()
    return all(torch.equal(a[k], b[k]) for k in a), loop_losses, batch_losses, evaluated


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 3])
def test_train_batch_is_the_micro_step_loop(stage):
    for same, loop_losses, batch_losses, evaluated in run_distributed(_batches, 2, args=(stage,)):
        assert same  # the very same parameters
        assert batch_losses == pytest.approx(loop_losses, rel=1e-6)  # the batch's mean loss
        assert evaluated < batch_losses[0]  # batch 0 again, after three steps on it and others
