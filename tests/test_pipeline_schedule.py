"""Pipeline schedules, checked by simulation: deadlock-freedom, bubble, memory, stream shape; and
the real executor on gloo ranks runs exactly the schedules the simulator accepts.

The closed forms below are the textbook ones (Huang et al. 2019; Narayanan et al. 2021), computed
here independently of the module; the simulator's timing model is pinned by hand-worked cases.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import FrozenInstanceError
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import zerostack
import zerostack.validate as init_checks  # initialize's validate step
from zerostack import ConfigError, Topology
from zerostack.config import load_config
from zerostack.pipeline import LayerSpec, PipelineModule
from zerostack.pipeline.schedule import (
    SCHEDULES,
    STEP_TAIL,
    Backward,
    DeadlockError,
    Forward,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    ScheduleError,
    SendActivation,
    SendGrad,
    build_schedule,
    build_streams,
    gpipe,
    interleaved,
    one_f_one_b,
    peer_of,
)
from zerostack.pipeline.simulate import check_schedule, simulate, validate

from tests.support.ranks import run_distributed

TOL = 1e-9
P_RANGE, M_RANGE, V_RANGE = range(1, 9), range(1, 17), range(2, 5)
TAIL = [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


def sim(name, p, m, v=1, backward=1.0):
    return _sim(name, p, m, v, backward)  # one cache key per case, however it is called


@functools.cache
def _sim(name, p, m, v, backward):
    return simulate(build_streams(name, p, m, v), backward=backward, chunks=v)


def flush_bubble(p, m):
    """GPipe and 1F1B: every rank idles (p - 1) forward+backward slots of m + p - 1."""
    return (p - 1) / (m + p - 1)


def interleaved_bubble(p, m, v):
    """Interleaved: the fill/drain costs (p - 1) chunk slots, each 1/v of a stage's work."""
    return (p - 1) / (v * m + p - 1)


# --- instructions ------------------------------------------------------------------------------


def test_instructions_print_compactly_and_are_frozen_values():
    assert repr(Forward(3, 1)) == "F(mb=3, chunk=1)"
    assert str(Backward(0)) == "B(mb=0, chunk=0)"
    assert str(LoadMicroBatch(2)) == "Load(mb=2)"
    assert str(SendActivation(1, 0)) == "SendAct(mb=1, chunk=0)"
    assert str(RecvGrad(4, 2)) == "RecvGrad(mb=4, chunk=2)"
    assert [str(i) for i in STEP_TAIL] == ["ReduceTiedGrads()", "ReduceGrads()", "OptimizerStep()"]
    assert Forward(1, 2) == Forward(micro=1, chunk=2) != Backward(1, 2)
    assert len({Forward(1), Forward(1, 0), Forward(2)}) == 2
    with pytest.raises(FrozenInstanceError):
        Forward(1).micro = 2


def test_peer_is_the_neighbouring_virtual_stage():
    # p=4, v=2: virtual stage = chunk * 4 + rank; rank 3 chunk 0 (vs 3) feeds rank 0 chunk 1 (vs 4).
    assert peer_of(SendActivation(0, 0), 3, 4, 2) == (0, 1)
    assert peer_of(RecvActivation(0, 1), 0, 4, 2) == (3, 0)
    assert peer_of(SendGrad(0, 1), 0, 4, 2) == (3, 0)
    assert peer_of(RecvGrad(0, 0), 3, 4, 2) == (0, 1)
    assert peer_of(SendActivation(0, 0), 1, 4, 2) == (2, 0)
    with pytest.raises(ScheduleError, match="virtual stage 7 has no next stage"):
        peer_of(SendActivation(0, 1), 3, 4, 2)
    with pytest.raises(ScheduleError, match="virtual stage 0 has no previous stage"):
        peer_of(RecvActivation(0, 0), 0, 4, 2)


# --- every schedule is well formed and deadlock-free -------------------------------------------

GRID = [("gpipe", 1), ("1f1b", 1)] + [("interleaved", v) for v in V_RANGE]


@pytest.mark.parametrize("name,v", GRID, ids=[f"{n}-v{v}" for n, v in GRID])
@pytest.mark.slow
def test_every_stream_is_complete_and_simulates_without_deadlock(name, v):
    for p in P_RANGE:
        for m in M_RANGE:
            streams = build_streams(name, p, m, v)
            where = f"{name} p={p} m={m} v={v}"
            last = p * v - 1
            for rank, stream in enumerate(streams):
                assert stream[-3:] == TAIL, where
                assert not any(isinstance(i, type(t)) for i in stream[:-3] for t in TAIL), where
                count = Counter((type(i), i.micro, i.chunk) for i in stream if hasattr(i, "chunk"))
                for mb in range(m):
                    for c in range(v):
                        assert count[(Forward, mb, c)] == 1, (where, rank, mb, c)
                        assert count[(Backward, mb, c)] == 1, (where, rank, mb, c)
                        vs = c * p + rank
                        assert count[(RecvActivation, mb, c)] == (vs > 0), where
                        assert count[(SendActivation, mb, c)] == (vs < last), where
                        assert count[(RecvGrad, mb, c)] == (vs < last), where
                        assert count[(SendGrad, mb, c)] == (vs > 0), where
                loads = [i.micro for i in stream if isinstance(i, LoadMicroBatch)]
                first_fwd = {}
                for pos, i in enumerate(stream):
                    if isinstance(i, Forward):
                        first_fwd.setdefault(i.micro, pos)
                if rank in (0, last % p):
                    assert sorted(loads) == list(range(m)), where
                    for pos, i in enumerate(stream):
                        if isinstance(i, LoadMicroBatch):
                            assert pos < first_fwd[i.micro], where
                else:
                    assert loads == [], where
            result = sim(name, p, m, v)  # raises on deadlock or any unmatched op
            assert result.makespan > 0
            assert all(b == pytest.approx(2 * m) for b in result.busy), where  # every layer, f+b


def test_per_stage_functions_agree_with_the_dispatcher():
    assert gpipe(3, 5, 1) == build_schedule("gpipe", 3, 5, 1)
    assert one_f_one_b(3, 5, 2) == build_schedule("1f1b", 3, 5, 2)
    assert interleaved(3, 5, 0, 2) == build_schedule("interleaved", 3, 5, 0, chunks=2)
    assert interleaved(3, 5, 0, chunks=1) == one_f_one_b(3, 5, 0)
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved"}


# --- bubble ------------------------------------------------------------------------------------


@pytest.mark.parametrize("backward", [1.0, 2.0])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, backward):
    # Unit forward (and backward = 1 or 2, as in practice), free transfers: the makespan is
    # (m + p - 1)(f + b) exactly, so the bubble is the closed form. Rendezvous transfers must not
    # add any stall to that.
    for p in P_RANGE:
        for m in M_RANGE:
            r = sim(name, p, m, 1, backward)
            assert abs(r.makespan - (m + p - 1) * (1 + backward)) < TOL, (name, p, m)
            assert abs(r.bubble_fraction - flush_bubble(p, m)) < TOL, (name, p, m)


@pytest.mark.parametrize("backward", [1.0, 2.0])
def test_interleaved_bubble_is_v_times_smaller_when_p_divides_m(backward):
    # With groups of exactly p micro-batches this is Megatron's schedule, whose fill and drain
    # take (p - 1) chunk slots (1/v of a stage each): bubble (p - 1) / (v m + p - 1). Checked for
    # m a multiple of p; batches are matched in lockstep, so it holds for backward = 2f as well.
    for v in V_RANGE:
        for p in P_RANGE:
            for m in range(p, 17, p):
                r = sim("interleaved", p, m, v, backward)
                assert abs(r.bubble_fraction - interleaved_bubble(p, m, v)) < TOL, (p, m, v)


def test_interleaved_beats_1f1b_for_every_micro_batch_count():
    # Strictly smaller bubble whenever p > 1, v > 1 and m >= 2, also when p does not divide m.
    # With m = 1 nothing overlaps: the lone micro-batch crosses all v*p chunks in turn, the same
    # time as 1F1B, so the bubble is equal (and never larger).
    for v in V_RANGE:
        for p in range(2, 9):
            for m in M_RANGE:
                fast, base = sim("interleaved", p, m, v), sim("1f1b", p, m)
                if m == 1:
                    assert abs(fast.bubble_fraction - base.bubble_fraction) < TOL, (p, v)
                else:
                    assert fast.bubble_fraction < base.bubble_fraction - TOL, (p, m, v)


def test_interleaved_spreads_a_remainder_over_groups_of_at_least_p():
    # m=7, p=3: groups of 4 and 3 micro-batches, each run through chunk 0 then chunk 1, rather
    # than Megatron's 3, 3 and a partial 1 (a group under p cannot keep the pipeline fed).
    for rank, stream in enumerate(build_streams("interleaved", 3, 7, 2)):
        order = [(i.micro, i.chunk) for i in stream if isinstance(i, Forward)]
        group1 = [(mb, c) for c in (0, 1) for mb in range(4)]
        group2 = [(mb, c) for c in (0, 1) for mb in range(4, 7)]
        assert order == group1 + group2, rank
        backward = [(i.micro, i.chunk) for i in stream if isinstance(i, Backward)]
        assert backward == [(mb, 1 - c) for mb, c in group1 + group2], rank


# --- memory ------------------------------------------------------------------------------------


def test_1f1b_keeps_at_most_p_activations_where_gpipe_keeps_m():
    for p in P_RANGE:
        for m in M_RANGE:
            one, gp = sim("1f1b", p, m), sim("gpipe", p, m)
            assert one.peak_activations[0] == min(p, m), (p, m)
            assert gp.peak_activations[0] == m, (p, m)
            assert all(one.peak_activations[s] <= p - s for s in range(p)), (p, m)
            if m > p:
                assert one.peak_activations[0] < gp.peak_activations[0]


def test_interleaved_warmup_is_megatrons():
    # Rank s runs 2 (p - s - 1) + (v - 1) p warm-up forwards, then forward/backward pairs; so
    # min(warm-up + 1, m v) forwards come before its first backward, and that many chunk
    # activations are alive at once.
    for v in V_RANGE:
        for p in P_RANGE:
            for m in range(p, 17, p):
                for s, stream in enumerate(build_streams("interleaved", p, m, v)):
                    compute = [i for i in stream if isinstance(i, Forward | Backward)]
                    first_b = next(k for k, i in enumerate(compute) if isinstance(i, Backward))
                    expected = min(2 * (p - s - 1) + (v - 1) * p + 1, m * v)
                    assert first_b == expected, (p, m, v, s)
                    assert sim("interleaved", p, m, v).peak_activations[s] == expected


# --- simulator: timing model -------------------------------------------------------------------


def test_transfer_cost_and_rendezvous_timing():
    # p=2, m=1 GPipe: F on rank 0, transfer, F and B on rank 1, transfer, B on rank 0.
    r = simulate(build_streams("gpipe", 2, 1), forward=1.0, backward=2.0, comm=0.5)
    assert r.makespan == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)
    assert r.finish == pytest.approx((7.0, 5.0))  # rank 1 ends when its gradient has gone
    assert r.busy == pytest.approx((3.0, 3.0)) and r.idle == pytest.approx((4.0, 4.0))
    # One rank with two chunks: a local handoff is free, and a chunk costs half the rank's time.
    r = simulate(build_streams("interleaved", 1, 1, 2), comm=10.0, chunks=2)
    assert r.makespan == pytest.approx(2.0) and r.bubble_fraction == 0.0


L, F, B = LoadMicroBatch, Forward, Backward


def test_a_send_waits_for_its_recv():
    # Each rank sends in a batch of its own (a Load between transfers ends a batch) and only then
    # receives what the other sent: fine with buffered sends, a deadlock under rendezvous.
    rank0 = [L(0), F(0), SendActivation(0), L(1), F(1), SendActivation(1), L(2), RecvGrad(0)]
    rank0 += [B(0), F(2), SendActivation(2), RecvGrad(1), B(1), RecvGrad(2), B(2), *TAIL]
    head1 = [RecvActivation(0), L(0), F(0), B(0)]
    tail1 = [F(1), B(1), SendGrad(1), RecvActivation(2), L(2), F(2), B(2), SendGrad(2), *TAIL]
    rank1 = head1 + [SendGrad(0), L(1), RecvActivation(1)] + tail1
    with pytest.raises(
        DeadlockError, match=r"rank 0 waits on SendAct\(mb=1.*rank 1 waits on SendG"
    ):
        simulate([rank0, rank1])
    # Posting the receive with the send, in one batch, is what the schedules do.
    rank1 = head1 + [SendGrad(0), RecvActivation(1), L(1)] + tail1
    assert simulate([rank0, rank1]).makespan == pytest.approx(8.0)


def test_both_ranks_receiving_first_is_a_deadlock_naming_both():
    rank0 = [L(0), F(0), RecvGrad(0), B(0), SendActivation(0), *TAIL]
    rank1 = [RecvActivation(0), L(0), F(0), B(0), SendGrad(0), *TAIL]
    with pytest.raises(DeadlockError) as err:
        simulate([rank0, rank1])
    assert isinstance(err.value, RuntimeError)
    msg = str(err.value)
    assert "ranks 0, 1 are stuck" in msg
    assert "rank 0 waits on RecvGrad(mb=0, chunk=0) with rank 1" in msg
    assert "rank 1 waits on RecvAct(mb=0, chunk=0) with rank 0" in msg
    # Sending before receiving (one batch) resolves it, so the error was no false alarm.
    rank0[2:5] = [SendActivation(0), RecvGrad(0), B(0)]
    assert simulate([rank0, rank1]).makespan == pytest.approx(4.0)


# --- simulator: malformed streams --------------------------------------------------------------

GOOD0 = [L(0), F(0), SendActivation(0), RecvGrad(0), B(0)]
GOOD1 = [RecvActivation(0), L(0), F(0), B(0), SendGrad(0)]
MALFORMED = {
    "unmatched send": (
        [L(0), F(0), SendActivation(0), L(1), F(1), SendActivation(1), RecvGrad(0), B(0)],
        GOOD1,
        r"SendAct\(mb=1, chunk=0\) on rank 0 has no matching RecvActivation on rank 1",
    ),
    "unmatched recv": (
        GOOD0,
        [*GOOD1, RecvActivation(1)],
        r"RecvAct\(mb=1, chunk=0\) on rank 1 has no matching SendActivation on rank 0",
    ),
    "backward first": (
        GOOD0,
        [RecvActivation(0), L(0), B(0), F(0), SendGrad(0)],
        r"rank 1, instruction 2: B\(mb=0, chunk=0\): comes before its Forward",
    ),
    "backward before its gradient": (
        [L(0), F(0), SendActivation(0), B(0), RecvGrad(0)],
        GOOD1,
        r"rank 0, instruction 3: B\(mb=0, chunk=0\): comes before its RecvGrad",
    ),
    "forward before its input": (
        [F(0), L(0), SendActivation(0), RecvGrad(0), B(0)],
        GOOD1,
        "rank 0, instruction 0: .*comes before its LoadMicroBatch",
    ),
    "send before compute": (
        GOOD0,
        [RecvActivation(0), L(0), F(0), SendGrad(0), B(0)],
        r"SendGrad\(mb=0, chunk=0\): comes before its Backward",
    ),
    "twice": (
        [L(0), F(0), F(0), SendActivation(0), RecvGrad(0), B(0)],
        GOOD1,
        r"rank 0, instruction 2: F\(mb=0, chunk=0\): appears twice",
    ),
    "past the last stage": (GOOD0, [*GOOD1, SendActivation(0)], "stage 1 has no next stage"),
    "chunk out of range": ([F(0, 1), *GOOD0], GOOD1, "chunk out of range 0..0"),
    "not an instruction": (["F0", *GOOD0], GOOD1, "rank 0, instruction 0: 'F0': not an Instr"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_streams_are_named(case):
    rank0, rank1, message = MALFORMED[case]
    streams = [[*rank0, *TAIL], [*rank1, *TAIL]]
    simulate([[*GOOD0, *TAIL], [*GOOD1, *TAIL]])  # the reference pair is fine
    with pytest.raises(ScheduleError, match=message):
        validate(streams)
    with pytest.raises(ScheduleError, match=message):
        simulate(streams)


def test_load_only_on_first_and_last_stage_ranks():
    streams = build_streams("1f1b", 3, 2)
    streams[1].insert(0, LoadMicroBatch(0))
    with pytest.raises(ScheduleError, match="rank 1 holds neither the first nor the last"):
        validate(streams)


def test_local_handoff_must_send_before_receiving():
    stream = build_schedule("interleaved", 1, 1, 0, chunks=2)
    validate([stream], chunks=2)
    send = stream.index(SendActivation(0, 0))
    recv = stream.index(RecvActivation(0, 1))
    stream[send], stream[recv] = stream[recv], stream[send]
    with pytest.raises(
        ScheduleError, match="SendAct.* on rank 0 is a local handoff after its Recv"
    ):
        validate([stream], chunks=2)


# --- arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: build_schedule("gpipe", 0, 4, 0), "stages: must be an integer >= 1, got 0"),
        (lambda: build_schedule("1f1b", 2, 0, 0), "micro_batches: must be an integer >= 1, got 0"),
        (lambda: build_schedule("1f1b", 4, 8, 4), "stage: 4 is out of range 0..3 for stages=4"),
        (lambda: build_schedule("1f1b", 4, 8, -1), "stage: -1 is out of range"),
        (lambda: build_schedule("interleaved", 2, 4, 0, chunks=0), "chunks: must be an integer"),
        (lambda: build_schedule("zb-h1", 2, 4, 0), "schedule: 'zb-h1' is not one of gpipe, 1f1b"),
        (lambda: build_schedule("1f1b", 2, 4, 0, chunks=2), "chunks: '1f1b' runs one chunk"),
        (
            lambda: build_schedule("interleaved", 2, 4, 0, chunks=1),
            "chunks: 'interleaved' needs chunks >= 2",
        ),
        (lambda: gpipe(2, 2.5, 0), r"micro_batches: must be an integer >= 1, got 2\.5"),
        (lambda: simulate(build_streams("gpipe", 2, 2), comm=-1), "comm: must be a cost >= 0"),
        (lambda: simulate([], chunks=1), "streams: need at least one rank"),
    ],
)
def test_bad_arguments_raise_one_clear_value_error(call, message):
    with pytest.raises(ValueError, match=message) as err:
        call()
    assert "\n" not in str(err.value)


def test_streams_are_fresh_lists():
    # Schedules are cached internally; editing a returned stream must not leak into the next one.
    a = build_schedule("1f1b", 2, 2, 0)
    a.clear()
    assert build_schedule("1f1b", 2, 2, 0)


# --- the executor runs exactly what the simulator accepts ---------------------------------------
# Every (schedule, micro-batches m, chunks v) for p = 2..4 ranks, one spawn per p, on a stack of
# d x d Linear layers trained one batch with plain SGD and no clipping (so a gradient scaled by a
# constant, e.g. a loss not divided by m, shows). Tolerance 1e-5: the pipeline sums the batch's
# gradient micro-batch by micro-batch, the reference in one backward, ~1e-7 apart in fp32.

D, MICRO, LR, SEED = 8, 2, 0.5, 1234  # SEED: PipelineModule's base_seed for seed_layers
EXEC_COMBOS = [(name, v, m) for name in SCHEDULES for v in (1, 2) for m in range(1, 9)]


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _data(m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(m)
    return [
        (torch.randn(MICRO, D, generator=g), torch.randn(MICRO, D, generator=g)) for _ in range(m)
    ]


def _every_schedule(rank, world):
    topo = Topology.build(pp=world)
    out = {}
    for name, v, m in EXEC_COMBOS:
        model = PipelineModule(
            [LayerSpec(nn.Linear, D, D) for _ in range(world * v)],
            topology=topo,
            loss_fn=_mse,
            partition_method="uniform",
            seed_layers=True,
            base_seed=SEED,
            virtual_stages=v,
        )
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default
            "gradient_accumulation_steps": m,
            "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "pipeline": {"schedule": name, "virtual_stages": v},
        }
        try:
            engine, *_ = zerostack.initialize(model=model, config=config)
        except ConfigError as exc:
            out[(name, v, m)] = str(exc)
            continue
        loss = engine.train_batch(iter(_data(m))).item()
        out[(name, v, m)] = (loss, {k: t.detach().clone() for k, t in model.named_parameters()})
    return out


def _reference(layers: int, m: int) -> tuple[float, dict[str, torch.Tensor]]:
    """One SGD step on the mean loss of the m micro-batches, in one process."""
    modules = []
    with torch.random.fork_rng():  # leave this process's RNG as it was
        for idx in range(layers):
            torch.manual_seed(SEED + idx)
            modules.append(nn.Linear(D, D))
    model = nn.Sequential(*modules)  # parameter names "3.weight", as PipelineModule's
    loss = torch.stack([_mse(model(x), y) for x, y in _data(m)]).mean()
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return loss.item(), {k: t.detach() for k, t in model.named_parameters()}


def _simulator_accepts(name: str, p: int, m: int, v: int) -> bool:
    try:
        check_schedule(name, p, m, v)
    except (ValueError, ScheduleError, DeadlockError):
        return False
    return True


@pytest.mark.distributed
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.slow
def test_the_executor_runs_exactly_what_the_simulator_accepts(p):
    results = run_distributed(_every_schedule, p, timeout=150, collective_timeout=20)
    accepted = {c for c in EXEC_COMBOS if _simulator_accepts(c[0], p, c[2], c[1])}
    ran = {c for c, r in results[0].items() if not isinstance(r, str)}
    assert ran == accepted
    assert {m for name, v, m in accepted if name == "interleaved"} == set(range(1, 9))
    for combo, first in results[0].items():
        if isinstance(first, str):  # refused at initialize, on every rank, naming the key
            assert all(r[combo] == first for r in results), combo
            assert first.startswith("pipeline.virtual_stages: "), first
            assert "\n" not in first
            continue
        name, v, m = combo
        ref_loss, ref = _reference(p * v, m)
        held = {}
        for r in results:
            loss, params = r[combo]
            assert loss == pytest.approx(ref_loss, rel=1e-5), (combo, "mean loss")
            held.update(params)
        assert held.keys() == ref.keys(), combo  # every layer on exactly one rank
        for k, t in held.items():
            torch.testing.assert_close(t, ref[k], rtol=1e-5, atol=1e-6, msg=f"{combo} {k}")


def test_a_schedule_the_simulator_refuses_is_a_config_error_at_initialize(monkeypatch):
    def deadlocks(name, stages, micro_batches, chunks):
        raise DeadlockError("deadlock: ranks 0, 1 are stuck")

    monkeypatch.setattr(init_checks, "check_schedule", deadlocks)
    # what _check_pipeline reads of a PipelineModule on a rank of two (no process group here)
    module = SimpleNamespace(
        num_stages=2,
        virtual_stages=2,
        partition_method="parameters",
        activation_checkpoint_interval=0,
    )
    cfg = load_config(
        {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default
            "gradient_accumulation_steps": 3,
            "pipeline": {"schedule": "interleaved", "virtual_stages": 2},
        }
    )
    with pytest.raises(ConfigError) as err:
        init_checks._check_pipeline(module, cfg, 1, 3)
    assert str(err.value) == (
        "pipeline.schedule: 'interleaved' cannot run 2 stages x 2 chunks with "
        "gradient_accumulation_steps=3: deadlock: ranks 0, 1 are stuck"
    )


def test_two_ranks_must_post_the_messages_between_them_in_the_same_order():
    # Gloo and NCCL match a pair's messages in posting order: receiving micro-batch 1 before 0
    # would put 0's activation in 1's buffer, though every op has its counterpart.
    streams = build_streams("gpipe", 2, 2)
    validate(streams)
    streams[1].remove(RecvActivation(1))
    streams[1].insert(streams[1].index(RecvActivation(0)), RecvActivation(1))
    with pytest.raises(
        ScheduleError,
        match=r"SendAct\(mb=0, chunk=0\) on rank 0 meets RecvAct\(mb=1, chunk=0\) on rank 1: "
        "rank 1 receives from rank 0 in another order than it sends",
    ):
        validate(streams)
