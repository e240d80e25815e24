"""CommLog: what stages 0-2 move per step, counted by the program itself, against the ZeRO paper.

Stage 0 all-reduces the gradient buffer once per optimizer step (psi elements, counted as the
buffer size); stages 1-2 reduce-scatter it and all-gather the updated parameters: 2 psi, plus one
scalar all-reduce for the global gradient norm. Stage 2 reduces on every micro-step (it keeps only
its gradient pieces); stages 0-1 stay silent until the last micro-step of the window. With
``reduce_scatter: false`` stages 1-2 all-reduce the buckets instead (each call counts the same
bytes: the bucket's).
"""

from __future__ import annotations

import pytest

import zerostack
from zerostack.comm.grid import comm_for
from zerostack.zero.partition import FlatLayout

from tests.support.models import batch, tiny_gpt
from tests.support.ranks import run_distributed

BUCKET = 4096


def _comm_per_step(rank, world, gas, stage, reduce_scatter=None):
    zero = {"stage": stage, "reduce_bucket_size": BUCKET}
    if reduce_scatter is not None:
        zero["reduce_scatter"] = reduce_scatter
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
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


@pytest.mark.distributed
@pytest.mark.parametrize("world,gas", [(2, 1), (4, 2)])
def test_stage0_all_reduce_bytes_and_bucket_count(world, gas):
    shapes, summaries, per_micro = run_distributed(_comm_per_step, world, args=(gas, 0))[0]
    layout = FlatLayout.build(shapes, world=1, bucket_numel=BUCKET)
    grad_bytes = layout.numel * 4
    for summary in summaries:
        assert set(summary) == {"all_reduce"}
        ar = summary["all_reduce"]
        assert ar["calls"] == len(layout.buckets)
        assert ar["bytes"] == layout.padded_numel * 4
        assert grad_bytes <= ar["bytes"] <= grad_bytes + 4 * len(layout.buckets)
    for is_boundary, calls in per_micro:
        if not is_boundary:
            assert calls == 0, "a micro-step inside the accumulation window communicated"
        else:
            assert calls > 0, "no bucket was reduced during the boundary backward (no overlap)"


@pytest.mark.distributed
@pytest.mark.parametrize("reduce_scatter", [None, False])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world,gas", [(2, 1), (4, 2)])
@pytest.mark.slow
def test_stages_1_2_move_two_psi(stage, world, gas, reduce_scatter):
    """Not given (DeepSpeed's true), the buckets are reduce-scattered; with
    ``reduce_scatter: false``, all-reduced (with the norm's scalar: one more call)."""
    shapes, summaries, per_micro = run_distributed(
        _comm_per_step, world, args=(gas, stage, reduce_scatter)
    )[0]
    layout = FlatLayout.build(shapes, world=world, bucket_numel=BUCKET)
    psi_bytes = layout.numel * 4
    n = len(layout.buckets)
    reductions = gas if stage == 2 else 1
    scatter = reduce_scatter is None
    reduce_op, norm = ("reduce_scatter", 0) if scatter else ("all_reduce", 1)
    for summary in summaries:
        assert set(summary) == {"reduce_scatter", "all_gather", "all_reduce"} - (
            set() if scatter else {"reduce_scatter"}
        )
        assert summary[reduce_op]["calls"] == n * reductions + norm
        assert summary[reduce_op]["bytes"] == layout.padded_numel * 4 * reductions + 4 * norm
        assert summary["all_gather"]["calls"] == n
        assert summary["all_gather"]["bytes"] == layout.padded_numel * 4
        if scatter:
            norm_only = {"calls": 1, "bytes": 4, "seconds": pytest.approx(0, abs=5)}
            assert summary["all_reduce"] == norm_only
        # The paper's 2 psi per step (reduce-scatter + all-gather); stage 2 with accumulation
        # reduce-scatters once per micro-step: (gas + 1) psi.
        total = sum(v["bytes"] for v in summary.values())
        assert total <= (reductions + 1) * psi_bytes * 1.05, f"{total} bytes for psi={psi_bytes}"
    for is_boundary, calls in per_micro:
        if stage == 1 and not is_boundary:
            assert calls == 0, "stage 1 communicated inside the accumulation window"
        else:
            assert calls > 0, "no bucket was reduced during backward (no overlap)"


def _strings(rank, world):
    topo = zerostack.Topology.build()
    texts = ["", "schrödinger's rank", "a" * 300, "x"]
    got = comm_for(topo).all_gather_strings(texts[rank])
    return got, comm_for(topo).log.total_bytes(op="all_gather") > 0


@pytest.mark.distributed
def test_all_gather_strings_moves_text_without_pickle():
    """What checkpoints use to agree on errors: every rank's text, any length, any script."""
    for got, logged in run_distributed(_strings, 4):
        assert got == ["", "schrödinger's rank", "a" * 300, "x"]
        assert logged  # through Comm, so the CommLog counts it


def test_a_long_run_holds_a_bounded_log():
    """The log of a run of any length holds the current step's records and ``keep_steps``
    before it: ``count`` and ``seq`` go on, ``since`` still finds the held ones, and a dropped
    step's summary is empty."""
    from zerostack.comm import CommLog

    log = CommLog(keep_steps=3)
    for step in range(10):
        for i in range(step + 1):  # step s makes s + 1 records
            log.add("all_reduce", "dp", 10 * step + i, 0.0)
        assert [r.step for r in log.records] == [
            s for s in range(max(0, step - 3), step + 1) for _ in range(s + 1)
        ]
        log.next_step()
    assert log.count == sum(range(1, 11)) == log.records[-1].seq + 1
    assert [r.seq for r in log.records] == list(range(log.count - 27, log.count))  # steps 7-9
    first = log.count - 10
    assert [r.bytes for r in log.since(first)] == [90 + i for i in range(10)]
    assert log.since(0) == log.records  # older than the held ones: all that is held
    assert log.for_step(5) == [] and log.step_summary(9)["all_reduce"]["calls"] == 10
    log.clear()
    log.add("broadcast", "dp", 1, 0.0)
    assert log.records[0].seq == 55 and log.since(55) == log.records
    with pytest.raises(ValueError, match="keep_steps must be at least 1, got 0"):
        CommLog(keep_steps=0)


def _long_run(rank, world, steps):
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
    x, y = batch(0, 1)
    counts = []  # collectives since the start, after each step
    for _ in range(steps):
        engine.backward(engine(x, y))
        engine.step()
        counts.append(engine.comm.log.count)
    log = engine.comm.log
    return sorted({r.step for r in log.records}), len(log.records), counts


@pytest.mark.distributed
def test_an_engine_run_holds_the_last_64_steps_of_its_log():
    """An engine's log, 80 steps on: the records of the step now open (none yet) and of the 64
    before it, each step's as many as any other's; ``count`` still counts every collective since
    the start."""
    steps = 80
    for held, n, counts in run_distributed(_long_run, 2, args=(steps,)):
        per_step = counts[1] - counts[0]
        steps_made = [b - a for a, b in zip(counts[:-1], counts[1:], strict=True)]
        assert per_step > 0 and set(steps_made) == {per_step}
        assert held == list(range(steps - 64, steps))
        assert n == 64 * per_step < counts[-1]


@pytest.mark.parametrize("backend, row, cloned", [
    ("nccl", 0, False),  # NCCL gathers in place: no bucket-sized copy at every step
    ("gloo", 0, True),  # torch's gloo does not promise it
    ("nccl", None, True),  # overlapping, but not this rank's row
])  # fmt: skip
def test_an_in_place_all_gather_is_copied_only_where_it_must_be(monkeypatch, backend, row, cloned):
    import torch
    import torch.distributed as dist

    from zerostack.comm import gloo

    seen = {}

    def gather(output, input, group=None, async_op=False):
        seen["aliased"] = input.data_ptr() == output.data_ptr()
        output[: input.numel()].copy_(input)

    monkeypatch.setattr(gloo, "_all_gather", gather)
    monkeypatch.setattr(gloo, "_gloo", lambda group: False)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    out = torch.arange(8.0)
    piece = out[:4] if row == 0 else out[1:5]
    gloo._all_gather_peers(out, piece, group=None, async_op=False)
    assert seen["aliased"] is (not cloned)
