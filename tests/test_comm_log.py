"""CommLog: what the data-parallel engine moves per step, counted by the program itself."""

from __future__ import annotations

import pytest
from common import batch, tiny_gpt
from distributed import run_distributed

import zerostack
from zerostack.zero.partition import FlatLayout

BUCKET = 4096


def _comm_per_step(rank, world, gas):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 0, "reduce_bucket_size": BUCKET},
    }
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
    log = engine.comm.log
    per_micro = []
    for step in range(3):
        x, y = batch(step, 2 * world * gas)
        for micro in range(gas):
            n_before = len(log.records)
            lo = (micro * world + rank) * 2
            engine.backward(engine(x[lo : lo + 2], y[lo : lo + 2]))
            per_micro.append(
                (engine.is_gradient_accumulation_boundary(), len(log.records) - n_before)
            )
            engine.step()
    shapes = [tuple(p.shape) for p in engine.module.parameters()]
    summaries = [log.step_summary(s) for s in range(3)]
    return shapes, summaries, per_micro


@pytest.mark.parametrize("world,gas", [(2, 1), (4, 2)])
def test_all_reduce_bytes_and_bucket_count(world, gas):
    shapes, summaries, per_micro = run_distributed(_comm_per_step, world, args=(gas,))[0]
    layout = FlatLayout.build(shapes, world=world)
    grad_bytes = sum(s.numel for s in layout.slots) * 4
    for summary in summaries:
        assert set(summary) == {"all_reduce"}
        ar = summary["all_reduce"]
        assert ar["calls"] == len(layout.buckets(BUCKET))
        assert grad_bytes <= ar["bytes"] <= (layout.padded_numel) * 4
    for is_boundary, calls in per_micro:
        if not is_boundary:
            assert calls == 0, "a micro-step inside the accumulation window communicated"
        else:
            assert calls > 0, "no bucket was reduced during the boundary backward (no overlap)"
