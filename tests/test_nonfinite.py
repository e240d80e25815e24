"""A NaN on one rank skips the step on every rank, in fp32, bf16 and fp16, and training goes on.

Without the guard, bf16 and fp32 would multiply every weight by NaN (``min(nan, 1.0)`` is NaN and
SGD/Adam apply a NaN gradient as it is); fp16 always had it as the loss scaler's overflow.
"""

from __future__ import annotations

import logging

import pytest
import torch

import zerostack

from tests.support.models import batch, tiny_gpt
from tests.support.ranks import run_distributed

pytestmark = pytest.mark.distributed  # every test here starts ranks

K = 1  # the step whose loss is NaN on the last rank
PRECISIONS = ["fp32", "bf16", "fp16"]
STAGES = [0, 2, 3]


def _config(precision: str, stage: int, policy: str = "skip") -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "on_nonfinite_grads": policy,
    }
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _nan_on_one_rank(rank, world):
    log = logging.getLogger("zerostack")
    out = {}
    for precision in PRECISIONS:
        for stage in STAGES:
            records = _Records()
            log.addHandler(records)
            log.setLevel(logging.INFO)
            engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(precision, stage))
            states, finite = [engine.full_state_dict()], []
            for step in range(3):
                x, y = batch(step, 4 * world)
                loss = engine(x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4])
                if step == K and rank == world - 1:
                    loss = loss * float("nan")
                engine.backward(loss)
                engine.step()
                states.append(engine.full_state_dict())
                finite.append(all(bool(torch.isfinite(v).all()) for v in states[-1].values()))
            log.removeHandler(records)
            unchanged = [
                all(torch.equal(a[k], b[k]) for k in a)
                for a, b in zip(states, states[1:], strict=False)
            ]
            out[precision, stage] = {
                "unchanged": unchanged,
                "finite": finite,
                "skipped": engine.skipped_steps,
                "steps": engine.global_steps,
                "messages": [m for m in records.messages if "skipped" in m],
            }
    # the "error" policy: every rank raises, none is left waiting in a collective
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config("bf16", 2, "error"))
    x, y = batch(0, 4 * world)
    loss = engine(x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4])
    engine.backward(loss * float("nan") if rank == 0 else loss)
    try:
        engine.step()
        out["error"] = None
    except FloatingPointError as exc:
        out["error"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_nan_on_one_rank, 2, timeout=300)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_nan_on_one_rank_skips_the_step_everywhere(results, precision, stage):
    for rank, out in enumerate(results):
        got = out[precision, stage]
        # step K left every parameter as it was; steps before and after it moved them
        assert got["unchanged"] == [False, True, False], (rank, got["unchanged"])
        assert all(got["finite"]), (rank, got["finite"])
        assert got["skipped"] == 1 and got["steps"] == 3
        if rank == 0:  # logged once, by rank 0, naming the step
            assert len(got["messages"]) == 1, got["messages"]
            assert got["messages"][0].startswith(f"step {K + 1}:"), got["messages"]
        else:
            assert got["messages"] == []


def test_error_policy_raises_on_every_rank(results):
    for out in results:
        assert out["error"] is not None
        assert "step 1: the global gradient norm is nan" in out["error"]
