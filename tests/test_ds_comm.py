"""``zerostack.comm`` as DeepSpeed's ``deepspeed.comm``: the module functions give what
torch.distributed gives; ``log_summary()`` prints DeepSpeed's table with the counts and message
sizes of a known sequence of ops and DeepSpeed's bandwidth formulas; the ``comms_logger`` block
summarises an engine's collectives (all of them, or the ``prof_ops``), each printed as it happens
with ``verbose``."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from zerostack.comm.summary import bandwidth, convert_size
from zerostack.config import ConfigError, load_config
from zerostack.zero.partition import FlatLayout

from tests.support.models import batch, tiny_gpt
from tests.support.ranks import run_distributed

# DeepSpeed's header line (deepspeed/utils/comms_logging.py, log_all), column for column
HEADER = (
    f"{'Comm. Op': <20}{'Message Size': <20}{'Count': <20}{'Total Latency(ms)': <20}"
    f"{'Avg Latency(ms)': <20}{'tput_avg (Gbps)': <20}{'busbw_avg (Gbps)': <20}"
)


def _table(text: str) -> dict[str, list[list[str]]]:
    """The printed summary: op -> its rows' seven cells."""
    lines = text.splitlines()
    assert lines[0] == HEADER, lines[0]
    table: dict[str, list[list[str]]] = {}
    op = None
    for line in lines[1:]:
        if line.startswith(" " * 20):
            table[op].append([line[i : i + 20].strip() for i in range(0, 140, 20)])
        else:
            op = line
            table[op] = []
    return table


# ------------------------------------------------------------------ the formulas, pure
def test_bandwidth_formulas_per_op():
    """DeepSpeed's (nccl-tests') formulas, n = 4, 1000 bytes in 2 ms = 0.004 Gbit/s."""
    assert bandwidth("all_reduce", 1000, 2.0, 4) == pytest.approx((0.008, 0.006))
    # an all-gather's message is one rank's input: n of them cross the wire
    assert bandwidth("all_gather_into_tensor", 1000, 2.0, 4) == pytest.approx((0.016, 0.012))
    assert bandwidth("all_gather", 1000, 2.0, 4) == pytest.approx((0.016, 0.012))
    # a reduce-scatter's message is the whole input: the same traffic as the all-gather above
    assert bandwidth("reduce_scatter_tensor", 4000, 2.0, 4) == pytest.approx((0.016, 0.012))
    assert bandwidth("all_to_all_single", 1000, 2.0, 4) == pytest.approx((0.004, 0.003))
    for op in ("broadcast", "send", "recv", "barrier"):
        assert bandwidth(op, 1000, 2.0, 4) == pytest.approx((0.004, 0.004))
    assert bandwidth("all_reduce", 1000, 0.0, 4) == (0.0, 0.0)
    assert [convert_size(s) for s in (0, 100, 4096, 1536 * 1024)] == [
        "0B",
        "100.0 B",
        "4.0 KB",
        "1.5 MB",
    ]


def test_comms_logger_block_is_checked():
    cfg = load_config({"comms_logger": {"enabled": True, "prof_ops": ["all_reduce"]}})
    assert cfg.comms_logger.enabled and cfg.comms_logger.prof_all
    assert cfg.comms_logger.prof_ops == ["all_reduce"]
    with pytest.raises(ConfigError) as err:
        load_config({"comms_logger": {"verbos": True}})
    assert str(err.value) == "comms_logger.verbos: unknown key (did you mean 'verbose'?)"
    with pytest.raises(ConfigError) as err:
        load_config({"comms_logger": {"prof_ops": "all_reduce"}})
    assert str(err.value).startswith("comms_logger.prof_ops: ")
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ the module functions
def _same_as_torch(rank, world):
    import torch.distributed as td

    import zerostack.comm as dist

    out = {}
    for enabled in (False, True):
        dist.configure(enabled=enabled)
        x = torch.arange(6.0) + 10 * rank

        def pair(name, ours, theirs, x=x, enabled=enabled):
            a, b = x.clone(), x.clone()
            ours(a)
            theirs(b)
            out[(name, enabled)] = (a, b)

        pair("all_reduce", dist.all_reduce, td.all_reduce)
        pair(
            "all_reduce MAX",
            lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX),
            lambda t: td.all_reduce(t, op=td.ReduceOp.MAX),
        )
        pair("all_reduce async", lambda t: dist.all_reduce(t, async_op=True).wait(), td.all_reduce)
        pair("broadcast", lambda t: dist.broadcast(t, src=1), lambda t: td.broadcast(t, src=1))
        pair("reduce", lambda t: dist.reduce(t, dst=0), lambda t: td.reduce(t, dst=0))

        g_ours, g_theirs = torch.empty(6 * world), torch.empty(6 * world)
        dist.all_gather_into_tensor(g_ours, x)
        td.all_gather_into_tensor(g_theirs, x)
        out[("all_gather_into_tensor", enabled)] = (g_ours, g_theirs)
        parts = [torch.empty(6) for _ in range(world)]
        dist.all_gather(parts, x)
        out[("all_gather", enabled)] = (torch.cat(parts), g_theirs)
        r_ours, r_theirs = torch.empty(3), torch.empty(3)
        dist.reduce_scatter_tensor(r_ours, x)
        td.reduce_scatter_tensor(r_theirs, x)
        out[("reduce_scatter_tensor", enabled)] = (r_ours, r_theirs)
        a_ours, a_theirs = torch.empty(6), torch.empty(6)
        dist.all_to_all_single(a_ours, x)
        td.all_to_all_single(a_theirs, x)
        out[("all_to_all_single", enabled)] = (a_ours, a_theirs)

        peer = 1 - rank
        got = torch.zeros(6)
        if rank == 0:
            dist.send(x, dst=1)
            dist.recv(got, src=1)
        else:
            dist.recv(got, src=0)
            dist.send(x, dst=0)
        out[("send/recv", enabled)] = (got, torch.arange(6.0) + 10 * peer)
        got = torch.zeros(6)
        works = [dist.isend(x, dst=peer), dist.irecv(got, src=peer)]
        for w in works:
            w.wait()
        out[("isend/irecv", enabled)] = (got, torch.arange(6.0) + 10 * peer)
        got = torch.zeros(6)
        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, got, peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        out[("batch_isend_irecv", enabled)] = (got, torch.arange(6.0) + 10 * peer)
        dist.barrier()

        group = dist.new_group([0, 1])
        queries = (
            dist.is_initialized(),
            dist.get_rank(),
            dist.get_world_size(),
            dist.get_local_rank(),
            dist.get_rank(group),
            dist.get_global_rank(group, 1),
            dist.get_all_ranks_from_group(group),
        )
        out[("queries", enabled)] = queries
        out[("records", enabled)] = [r.op for r in dist.log.records]
    return out


@pytest.mark.distributed
def test_module_functions_match_torch_distributed():
    """Logger off and on (the timed path): the same tensors as torch.distributed's own calls,
    and, while on, each call recorded once in zerostack.comm.log."""
    results = run_distributed(_same_as_torch, 2)
    for rank, out in enumerate(results):
        x0, x1 = torch.arange(6.0), torch.arange(6.0) + 10
        for enabled in (False, True):
            for name, value in out.items():
                if name[0] not in ("queries", "records") and (name[0], rank) != ("reduce", 1):
                    ours, theirs = value
                    assert torch.equal(ours, theirs), (name, rank)
            assert torch.equal(out[("all_reduce", enabled)][0], x0 + x1)
            assert torch.equal(out[("all_reduce MAX", enabled)][0], x1)
            assert torch.equal(out[("broadcast", enabled)][0], x1)
            assert torch.equal(out[("all_gather", enabled)][0], torch.cat([x0, x1]))
            assert torch.equal(
                out[("reduce_scatter_tensor", enabled)][0], (x0 + x1)[3 * rank :][:3]
            )
            assert out[("queries", enabled)] == (True, rank, 2, rank, rank, 1, [0, 1])
        assert out[("records", False)] == []
        assert out[("records", True)] == [
            "all_reduce",
            "all_reduce",
            "all_reduce",
            "broadcast",
            "reduce",
            "all_gather_into_tensor",
            "all_gather",
            "reduce_scatter_tensor",
            "all_to_all_single",
            *(("send", "recv") if rank == 0 else ("recv", "send")),
            "isend",
            "irecv",
            "batch_isend_irecv",
            "barrier",
        ]


# ------------------------------------------------------------------ log_summary
def _sequence(rank, world, **conf):
    import zerostack.comm as dist

    dist.configure(enabled=True, **conf)
    for _ in range(3):
        dist.all_reduce(torch.ones(1024))  # 4 KB
    for _ in range(2):
        dist.all_reduce(torch.ones(16), op=dist.ReduceOp.MAX)  # 64 B
    for _ in range(2):
        dist.all_gather_into_tensor(torch.empty(256 * world), torch.ones(256))  # 1 KB per rank
    dist.all_gather([torch.empty(8) for _ in range(world)], torch.ones(8))  # 32 B
    dist.reduce_scatter_tensor(torch.empty(64), torch.ones(64 * world))  # 256 B per rank
    dist.broadcast(torch.ones(4), src=0)
    if rank == 0:
        dist.send(torch.ones(32), dst=1)
    elif rank == 1:
        dist.recv(torch.zeros(32), src=0)
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        summary = dist.log_summary(return_dict=True)
    return stdout.getvalue(), summary, dist.comms_logger.get_raw_data()


@pytest.mark.distributed
def test_log_summary_prints_deepspeeds_table():
    """On 4 ranks, so that every factor of n in the formulas shows (2 (n - 1) / n is 1 at n = 2)."""
    n = 4
    results = run_distributed(_sequence, n)
    (text, summary, raw), (_, summary1, _) = results[:2]
    assert all(r[0] == "" for r in results[1:])  # rank 0 prints
    table = _table(text)
    assert list(table) == [
        "all_reduce",
        "all_gather_into_tensor",
        "all_gather",
        "reduce_scatter_tensor",
        "broadcast",
        "send",
        "log_summary_barrier",  # DeepSpeed's summary counts its own first barrier
    ]
    sizes_counts = {op: [(row[1], row[2]) for row in rows] for op, rows in table.items()}
    assert sizes_counts == {
        "all_reduce": [("64.0 B", "2"), ("4.0 KB", "3")],
        "all_gather_into_tensor": [("1.0 KB", "2")],
        "all_gather": [("32.0 B", "1")],
        "reduce_scatter_tensor": [("1.0 KB", "1")],
        "broadcast": [("16.0 B", "1")],
        "send": [("128.0 B", "1")],
        "log_summary_barrier": [("0B", "1")],
    }
    assert set(summary1["summary"]) == set(table) - {"send"} | {"recv"}
    formulas = {  # DeepSpeed's algbw and busbw of S bytes in t ms, in Gbit/s
        "all_reduce": lambda s, t: (2 * s / t * 8e-6, s / t * 2 * (n - 1) / n * 8e-6),
        "all_gather_into_tensor": lambda s, t: (n * s / t * 8e-6, n * s / t * (n - 1) / n * 8e-6),
        "all_gather": lambda s, t: (n * s / t * 8e-6, n * s / t * (n - 1) / n * 8e-6),
        # the whole input is the message: not DeepSpeed's n x (see zerostack.comm.summary)
        "reduce_scatter_tensor": lambda s, t: (s / t * 8e-6, s / t * (n - 1) / n * 8e-6),
    }
    for op, formula in formulas.items():
        for size, (count, lats, algbws, busbws) in raw[op].items():
            assert count == len(lats) == summary["summary"][op][size]["count"]
            expected = [formula(size, t) for t in lats]
            assert algbws == pytest.approx([a for a, _ in expected], rel=1e-12)
            assert busbws == pytest.approx([b for _, b in expected], rel=1e-12)
            stats = summary["summary"][op][size]
            assert stats["total_latency_ms"] == pytest.approx(sum(lats))
            # counts <= 4: the 10% trimmed mean trims nothing
            assert stats["tput_avg_gbps"] == pytest.approx(sum(algbws) / count)
            assert stats["busbw_avg_gbps"] == pytest.approx(sum(busbws) / count)
        for stats in summary["summary"][op].values():
            row = next(r for r in table[op] if r[1] == stats["msg_size_str"])
            assert row[3:] == [
                f"{stats[k]:.2f}"
                for k in ("total_latency_ms", "avg_latency_ms", "tput_avg_gbps", "busbw_avg_gbps")
            ]
    assert sorted(raw["all_reduce"]) == [64, 4096]
    assert sorted(raw["all_gather_into_tensor"]) == [1024]


@pytest.mark.distributed
def test_prof_ops_and_debug():
    """prof_all off: only the listed ops (not even log_summary's barrier); debug: rows named
    with the calling function."""
    conf = dict(prof_all=False, prof_ops=["all_gather_into_tensor"], debug=True)
    (text, summary, raw), (text1, _, raw1) = run_distributed(_sequence, 2, kwargs=conf)
    name = "all_gather_into_tensor | [Caller Func: _sequence]"
    assert list(raw) == list(raw1) == [name]
    assert list(_table(text)) == [name]
    assert summary["summary"][name][1024]["count"] == 2
    assert text1 == ""


def _verbose(rank, world):
    import zerostack.comm as dist

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        # DeepSpeed's init_distributed(config=...): the block, on an initialised world
        dist.init_distributed(config={"comms_logger": {"enabled": True, "verbose": True}})
        dist.all_reduce(torch.ones(1024))
        dist.all_gather_into_tensor(torch.empty(512), torch.ones(256))
    return stdout.getvalue(), dist.comms_logger.get_raw_data()


@pytest.mark.distributed
def test_verbose_prints_each_op_on_rank_0():
    """The block given to init_distributed: each op printed as it completes, on rank 0."""
    (text, raw), (text1, _) = run_distributed(_verbose, 2)
    assert text1 == ""
    lines = text.splitlines()
    assert len(lines) == 2
    expected = [("all_reduce", 4096), ("all_gather_into_tensor", 1024)]
    for line, (op, size) in zip(lines, expected, strict=True):
        count, (lat,), (algbw,), (busbw,) = raw[op][size]
        assert count == 1
        assert line == (
            f"comm op: {op} | time (ms): {lat:.2f} | msg size: {convert_size(size)} "
            f"| algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}"
        )


def _stragglers(rank, world):
    import time

    import zerostack.comm as dist

    dist.configure(enabled=True)
    for _ in range(3):
        if rank == 1:
            time.sleep(0.02)
        dist.all_reduce(torch.ones(4))
    lats = list(dist.comms_logger.get_raw_data()["all_reduce"][16][1])
    out = dist.log_summary(show_straggler=True, return_dict=True)
    after = dist.comms_logger.get_raw_data()["all_reduce"][16][0]
    return lats, out["straggler_analysis"]["all_reduce"][16], after


@pytest.mark.distributed
def test_straggler_analysis_against_the_fastest_rank():
    (lat0, s0, after0), (lat1, s1, after1) = run_distributed(_stragglers, 2)
    fastest = [min(a, b) for a, b in zip(lat0, lat1, strict=True)]
    for lats, s in ((lat0, s0), (lat1, s1)):
        assert s["count"] == 3
        assert s["total_comm_lat_ms"] == pytest.approx(sum(fastest), rel=1e-9)
        assert s["total_straggler_ms"] == pytest.approx(
            sum(a - f for a, f in zip(lats, fastest, strict=True)), rel=1e-9, abs=1e-9
        )
    assert after0 == after1 == 3  # the analysis's own all-reduces are not logged


# ------------------------------------------------------------------ the engine's block
BUCKET = 4096


def _engine_runs(rank, world):
    import zerostack
    import zerostack.comm as dist

    results = []
    blocks = [
        None,  # no block: the logger stays off
        {"enabled": True, "prof_all": False, "prof_ops": ["all_gather"]},
        {"enabled": True, "verbose": True},
    ]
    for block in blocks:
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": BUCKET},
        }
        if block is not None:
            cfg["comms_logger"] = block
        dist.reset_log()
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            engine, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
            for step in range(2):
                x, y = batch(step, 2 * world)
                engine.backward(engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
                engine.step()
            summary = dist.log_summary(return_dict=True)["summary"]
        shapes = [tuple(p.shape) for p in engine.module.parameters()]
        ops = [r.op for r in engine.comm.log.records]
        results.append((stdout.getvalue(), summary, shapes, ops))
        engine.destroy()
    return results


@pytest.mark.distributed
def test_comms_logger_block_summarises_the_engines_collectives():
    ranks = run_distributed(_engine_runs, 2)
    (off, prof_ops, full), (_, _, full1) = ranks
    # no block: nothing recorded, the table is its header alone
    assert off[1] == {} and off[0].splitlines() == [HEADER]

    text, summary, shapes, ops = full
    layout = FlatLayout.build(shapes, world=2, bucket_numel=BUCKET)
    steps, buckets, psi = 2, len(layout.buckets), layout.padded_numel * 4

    def total(op):
        return sum(size * s["count"] for size, s in summary[op].items())

    def calls(op):
        return sum(s["count"] for s in summary[op].values())

    # stage 2: per step, every bucket reduce-scattered (the whole bucket is the message) and
    # all-gathered (one rank's piece is the message), and one all-reduce of the norm's scalar
    assert calls("reduce_scatter") == calls("all_gather") == steps * buckets
    assert total("reduce_scatter") == steps * psi
    assert total("all_gather") == steps * psi // 2
    assert summary["all_reduce"][4]["count"] == steps
    assert set(summary) == set(ops) | {"log_summary_barrier"}
    for op in set(ops):
        assert calls(op) == ops.count(op)
    # verbose: every collective printed as it completed, on rank 0, then the table
    verbose = [ln for ln in text.splitlines() if ln.startswith("comm op: ")]
    assert len(verbose) == len(ops) + 2  # and log_summary's two barriers
    printed = sorted(ln.split(" | ")[0] for ln in verbose[:-2])
    assert printed == sorted(f"comm op: {op}" for op in ops)
    assert HEADER in text.splitlines()
    assert full1[0] == ""

    # prof_all off, prof_ops ["all_gather"]: the engine's all-gathers alone, nothing printed
    text, summary, _, _ = prof_ops
    assert list(summary) == ["all_gather"]
    assert sum(s["count"] for s in summary["all_gather"].values()) == steps * buckets
    assert list(_table(text)) == ["all_gather"]
