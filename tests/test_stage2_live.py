"""Stage 2 during backward: each bucket's staged gradients go as soon as its reduce-scatter is
waited for (at most two buckets in flight), found by a census of live tensor storage
(tests/support/census.py) at the gradient hooks, not by asking the engine.

Held until the end of backward (as before), the staged buckets were the whole model's gradient
in the reduce dtype at backward's peak: stage 1's memory, not stage 2's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import zerostack
from zerostack.models import GPT

from tests.support import census
from tests.support.models import TINY, batch
from tests.support.ranks import run_distributed

pytestmark = pytest.mark.distributed  # every test here starts ranks

CFG = dataclasses.replace(TINY, n_layer=4, d_model=64, n_head=4)
WORLD, STEPS = 2, 2


def _staged(rank, world, reduce_scatter: bool):
    """Bytes of staged buckets (``buckets[].staging``, reached from the strategy or from a
    collective in flight) at every third gradient hook of the last backward; the buckets'
    sizes."""
    before = census.baseline()
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": 20_000,
            "reduce_scatter": reduce_scatter,
        },
    }
    engine, *_ = zerostack.initialize(model=GPT(CFG), config=config)

    def train(step):
        x, y = batch(step, world)
        engine.backward(engine(x[rank : rank + 1], y[rank : rank + 1]))
        engine.step()

    seen = census.held_at_grad_hooks(engine, before, train, STEPS, "staging")
    sizes = [4 * st.bucket.numel for st in engine.zero.flat.buckets]
    before.release()
    return {"peak": max(seen), "bucket": max(sizes), "all": sum(sizes), "n": len(sizes)}


@pytest.mark.parametrize("reduce_scatter", [True, False])
def test_staged_buckets_go_during_backward(reduce_scatter):
    got = run_distributed(_staged, WORLD, args=(reduce_scatter,), timeout=300)[0]
    assert got["n"] >= 8, got["n"]
    # the bucket being filled and at most two in flight
    assert got["peak"] <= 3 * got["bucket"], got
    assert got["peak"] < got["all"] / 2, got


def _into_shard(rank, world):
    """For each micro-step of a window of two: how many of the bucket reduce-scatters wrote
    straight into the gradient shard, and how many there were."""
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 20_000},
    }
    engine, *_ = zerostack.initialize(model=GPT(CFG), config=config)
    comm, shard = engine.zero.comm, engine.zero.flat.groups[0].grad_shard
    lo, hi = shard.data_ptr(), shard.data_ptr() + shard.nbytes
    outputs = []
    real = comm.reduce_scatter

    def spy(output, input, **kw):
        outputs.append(lo <= output.data_ptr() < hi)
        return real(output, input, **kw)

    comm.reduce_scatter = spy
    seen = []
    for step in range(2):
        for micro in range(2):
            x, y = batch(2 * step + micro, world)
            outputs.clear()
            engine.backward(engine(x[rank : rank + 1], y[rank : rank + 1]))
            engine.step()
            seen.append((sum(outputs), len(outputs)))
    return seen


def test_the_first_micro_step_reduces_into_the_shard():
    """The shard is zero after a step, so a window's first micro-step reduce-scatters every
    bucket straight into it (no piece, no add); later micro-steps add pieces."""
    for seen in run_distributed(_into_shard, WORLD, timeout=300):
        n = seen[0][1]
        assert n >= 8, seen
        assert seen == [(n, n), (0, n)] * 2, seen


def _piped(rank, world, stage):
    """pp 2 x dp 2, 4 micro-batches a batch: bytes of gradient storage (full gradients, staged
    buckets, the shard) at every third gradient hook of the second batch; the stage's
    parameter bytes; its largest bucket's."""
    from zerostack import Topology
    from zerostack.models.gpt_pipe import GPTLoss, gpt_layers
    from zerostack.pipeline import PipelineModule

    before = census.baseline()
    topo = Topology.build(pp=2)
    torch.manual_seed(0)
    model = PipelineModule(
        gpt_layers(dataclasses.replace(CFG, n_layer=8), topology=topo),
        topology=topo,
        loss_fn=GPTLoss(topo),
        partition_method="type:Block",
    )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        # a bucket a parameter, four blocks a stage: the shard and a few buckets are less than
        # the whole
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2_000},
    }
    engine, *_ = zerostack.initialize(model=model, config=config)

    def train(step):
        x, y = batch(step, 8)
        lo = [2 * m + topo.dp_rank for m in range(4)]
        engine.train_batch(iter([(x[i : i + 1], y[i : i + 1]) for i in lo]))

    def gradients(path: str) -> bool:  # a parameter's .grad (not an activation's), a shard,
        # a bucket's staging
        parameter = path.endswith(".grad") and "executor.inputs" not in path
        return parameter or "grad_shard" in path or "staging" in path

    seen = census.held_at_grad_hooks(engine, before, train, STEPS, gradients)
    params = sum(4 * p.numel() for p in model.parameters())
    buckets = engine.zero.flat.buckets
    bucket = max((4 * st.bucket.numel for st in buckets), default=0)
    before.release()
    return max(seen), params, bucket


def test_stage_2_under_a_pipeline_holds_a_shard_of_the_gradients():
    """Stage 2 under a pipeline reduce-scatters each micro-batch's gradients as its backward
    ends: at every hook of a batch, the gradient storage is this rank's shard (1/dp) and the
    buckets being staged, never the whole gradient, which stage 1 holds for the whole batch."""
    for (peak2, params, bucket), (peak1, _, _) in zip(
        run_distributed(_piped, 4, args=(2,), timeout=300),
        run_distributed(_piped, 4, args=(1,), timeout=300),
        strict=True,
    ):
        assert peak1 >= params, (peak1, params)
        # the shard, the bucket being staged, those in flight and one awaiting its add
        assert peak2 <= params / 2 + 4 * bucket, (peak2, params, bucket)
        assert peak2 < 0.8 * params, (peak2, params)


class _MyAdamW(torch.optim.AdamW):
    """A client's optimizer: zerostack cannot know that it updates each parameter alone."""


def _step_order(rank, world, stage, client_optimizer):
    """The order of optimizer steps and parameter all-gathers within engine.step()."""
    torch.manual_seed(0)
    model = GPT(CFG)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000},
    }
    if client_optimizer:
        optimizer = _MyAdamW(model.parameters(), lr=1e-3)
    else:
        optimizer, config["optimizer"] = None, {"type": "AdamW", "params": {"lr": 1e-3}}
    engine, opt, *_ = zerostack.initialize(model=model, optimizer=optimizer, config=config)
    events = []
    opt.register_step_post_hook(lambda *_: events.append("step"))
    real = engine.zero.comm.all_gather

    def spy(output, input, **kw):
        events.append("gather")
        return real(output, input, **kw)

    engine.zero.comm.all_gather = spy
    x, y = batch(0, world)
    engine.backward(engine(x[rank : rank + 1], y[rank : rank + 1]))
    events.clear()
    engine.step()
    return events, len(engine.zero.flat.buckets)


@pytest.mark.parametrize("stage", [1, 2])
def test_each_bucket_is_gathered_as_soon_as_it_is_stepped(stage):
    """With torch's AdamW each bucket's master is stepped alone and its all-gather launched
    before the next bucket's step (so the gathers overlap the step); a client's optimizer,
    which may couple parameters, steps once and every gather follows."""
    events, n = run_distributed(_step_order, WORLD, args=(stage, False), timeout=300)[0]
    assert n >= 8
    assert events == ["step", "gather"] * n, events
    events, n = run_distributed(_step_order, WORLD, args=(stage, True), timeout=300)[0]
    assert events == ["step"] + ["gather"] * n, events
