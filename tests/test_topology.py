"""Topology: the pp x dp x tp grid on real gloo ranks (sizes, coordinates, groups, timeouts)."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from itertools import product

import pytest
import torch
import torch.distributed as dist

import zerostack
from zerostack.comm import Comm
from zerostack.topology import AXES, Topology, TopologyError

from tests.support.ranks import run_distributed

# (pp, tp) grids per world size; dp is what they leave.
GRIDS = {
    1: [(1, 1)],
    2: [(1, 1), (1, 2), (2, 1)],
    4: [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (1, 4)],
    8: [(2, 2)],
}
TIMEOUT = timedelta(seconds=60)  # so a mismatch in these tests never waits the 30 min default


def _pg_timeout(group) -> timedelta:
    """The timeout a gloo process group applies to its collectives (what _set_pg_timeout sets)."""
    return group._get_backend(torch.device("cpu")).options._timeout


def _expected(world, pp, tp):
    """rank -> coords under the documented layout: tp innermost, then dp, then pp."""
    dp = world // (pp * tp)
    coords = {}
    for p, d, t in product(range(pp), range(dp), range(tp)):
        coords[(p * dp + d) * tp + t] = {"pp": p, "dp": d, "tp": t}
    assert sorted(coords) == list(range(world))
    return dp, coords


def _grid_facts(rank, world, grids):
    out = []
    for pp, tp in grids:
        topo = Topology.build(pp=pp, tp=tp, timeout=TIMEOUT)
        comm = Comm(topo)
        facts = {
            "sizes": (topo.pp, topo.dp, topo.tp),
            "size": {axis: topo.size(axis) for axis in AXES},
            "world_size": topo.world_size,
            "global_rank": topo.global_rank,
            "coords": topo.coords(),
            "dp": (topo.dp_rank, topo.dp_size),
            "device": str(topo.device),
            "members": {},
            "sums": {},
        }
        for axis in AXES:
            facts["members"][axis] = dist.get_process_group_ranks(topo.group(axis))
            t = torch.tensor([1 << rank, rank, 1], dtype=torch.int64)
            comm.all_reduce(t, axis=axis)
            facts["sums"][axis] = t.tolist()
        facts["log"] = [(r.op, r.axis, r.bytes) for r in comm.log.records]
        out.append(facts)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_grid_coordinates_groups_and_all_reduce(world):
    grids = GRIDS[world]
    per_rank = run_distributed(_grid_facts, world, args=(grids,), timeout=120)
    for (pp, tp), i in zip(grids, range(len(grids)), strict=True):
        dp, coords = _expected(world, pp, tp)
        for rank, facts in enumerate(r[i] for r in per_rank):
            where = f"world {world} pp={pp} tp={tp} rank {rank}"
            assert facts["sizes"] == (pp, dp, tp), where
            assert facts["size"] == {"pp": pp, "dp": dp, "tp": tp}, where
            assert facts["world_size"] == pp * dp * tp == world, where
            assert facts["global_rank"] == rank, where
            c = facts["coords"]
            assert c == coords[rank], where
            assert rank == (c["pp"] * dp + c["dp"]) * tp + c["tp"], where
            assert facts["dp"] == (c["dp"], dp), where
            assert facts["device"] == "cpu", where
            for axis in AXES:
                # Members: the ranks that agree with this one on the other two coordinates.
                members = sorted(
                    r for r, rc in coords.items() if all(rc[a] == c[a] for a in AXES if a != axis)
                )
                assert len(members) == facts["size"][axis], where
                assert facts["members"][axis] == members, (where, axis)
                expected_sum = [sum(1 << m for m in members), sum(members), len(members)]
                assert facts["sums"][axis] == expected_sum, (where, axis)
            assert facts["log"] == [("all_reduce", axis, 3 * 8) for axis in AXES], where


def _bad_sizes(rank, world):
    cases = [
        {"tp": 3},
        {"pp": 3},
        {"pp": 2, "tp": 3},
        {"dp": 3},
        {"pp": 2, "dp": 1},
        {"dp": 0},
        {"tp": 0},
        {"pp": -1},
    ]
    messages = []
    for kwargs in cases:
        try:
            Topology.build(timeout=TIMEOUT, **kwargs)
        except TopologyError as exc:
            messages.append((kwargs, str(exc)))
        else:
            messages.append((kwargs, None))
    # Every check happens before any group is created, so the world is still in step.
    t = torch.ones(1)
    dist.all_reduce(t)
    return messages, t.item()


@pytest.mark.distributed
def test_bad_sizes_raise_topology_error_naming_them():
    assert issubclass(TopologyError, ValueError)
    for messages, total in run_distributed(_bad_sizes, 4, timeout=60):
        assert total == 4
        got = {tuple(sorted(k.items())): m for k, m in messages}
        assert None not in got.values(), got
        assert "world size 4" in got[(("tp", 3),)] and "1 * 3" in got[(("tp", 3),)]
        assert "world size 4" in got[(("pp", 3),)] and "3 * 1" in got[(("pp", 3),)]
        assert "2 * 3" in got[(("pp", 2), ("tp", 3))]
        assert "1 * 3 * 1" in got[(("dp", 3),)] and "4" in got[(("dp", 3),)]
        assert "2 * 1 * 1" in got[(("dp", 1), ("pp", 2))]
        assert "1 * 0 * 1" in got[(("dp", 0),)]
        assert "tp" in got[(("tp", 0),)] and "0" in got[(("tp", 0),)]
        assert "pp" in got[(("pp", -1),)] and "-1" in got[(("pp", -1),)]


def _group_timeouts(rank, world):
    before = _pg_timeout(dist.group.WORLD)
    topo = Topology.build(pp=1, tp=2, timeout=timedelta(seconds=7))
    after = {axis: _pg_timeout(topo.group(axis)) for axis in AXES}
    return before, after, _pg_timeout(dist.group.WORLD), topo.timeout


@pytest.mark.distributed
def test_axis_groups_get_the_topology_timeout():
    # world 4, tp=2: no axis spans the whole world, so the world group must keep its own timeout.
    for before, after, world_after, topo_timeout in run_distributed(
        _group_timeouts, 4, timeout=60, collective_timeout=45
    ):
        assert before == timedelta(seconds=45)
        assert after == {axis: timedelta(seconds=7) for axis in AXES}
        assert world_after == timedelta(seconds=45)
        assert topo_timeout == timedelta(seconds=7)


def _mismatched_dp_collective(rank, world, seconds):
    topo = Topology.build(pp=1, tp=2, timeout=timedelta(seconds=seconds))
    error, elapsed = None, None
    if rank == 0:  # its dp partner (rank 2) never joins
        t0 = time.monotonic()
        try:
            Comm(topo).all_reduce(torch.ones(4), axis="dp")
        except Exception as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {exc}"
        elapsed = time.monotonic() - t0
    # On the world group (45 s): keeps rank 2 alive, its connections open, until rank 0 is done.
    dist.barrier()
    return error, elapsed


@pytest.mark.distributed
@pytest.mark.slow
def test_mismatched_collective_fails_after_the_group_timeout():
    seconds = 3
    results = run_distributed(
        _mismatched_dp_collective, 4, args=(seconds,), timeout=90, collective_timeout=45
    )
    error, elapsed = results[0]
    assert error is not None, "a collective only one member joined did not fail"
    assert "timed out" in error.lower(), error
    assert 0.8 * seconds <= elapsed <= 2 * seconds + 2, (elapsed, error)
    assert all(r == (None, None) for r in results[1:])


def _default_timeout_keeps_world(rank, world):
    Topology.build()
    return _pg_timeout(dist.group.WORLD)


@pytest.mark.distributed
def test_default_build_keeps_the_world_timeout():
    for timeout in run_distributed(_default_timeout_keeps_world, 2, collective_timeout=45):
        assert timeout == timedelta(seconds=45)


def _already_initialised(rank, world):
    group = dist.group.WORLD
    zerostack.init_distributed()  # a second call does nothing
    same = dist.group.WORLD is group
    topo = Topology.build(timeout=TIMEOUT)
    comm = Comm(topo)
    sums = {}
    for axis in AXES:
        t = torch.tensor([5.0])
        comm.all_reduce(t, axis=axis)
        sums[axis] = t.item()
    return same, (topo.pp, topo.dp, topo.tp), topo.coords(), sums


@pytest.mark.distributed
def test_world_of_one_with_launcher_environment():
    [(same, sizes, coords, sums)] = run_distributed(_already_initialised, 1, timeout=60)
    assert same
    assert sizes == (1, 1, 1)
    assert coords == {"pp": 0, "dp": 0, "tp": 0}
    assert sums == {"pp": 5.0, "dp": 5.0, "tp": 5.0}


def _no_launcher(rank, world):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    dist.destroy_process_group()
    assert not dist.is_initialized()

    zerostack.init_distributed()
    first = (dist.get_world_size(), dist.get_rank(), dist.get_backend())
    topo = Topology.build(timeout=TIMEOUT)
    t = torch.tensor([3.0])
    Comm(topo).all_reduce(t)
    first += ((topo.pp, topo.dp, topo.tp), t.item())
    dist.destroy_process_group()

    # Topology.build initialises the world itself when nobody has, with its own timeout.
    topo = Topology.build(timeout=timedelta(seconds=7))
    second = (dist.get_world_size(), dist.get_backend(), (topo.pp, topo.dp, topo.tp))
    second += (_pg_timeout(dist.group.WORLD),)
    return first, second


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-launcher default is gloo on CPU")
def test_no_launcher_runs_as_a_world_of_one():
    [(first, second)] = run_distributed(_no_launcher, 1, timeout=60)
    assert first == (1, 0, "gloo", (1, 1, 1), 3.0)
    assert second == (1, "gloo", (1, 1, 1), timedelta(seconds=7))


def _gloo_threads() -> int:
    """This process's gloo worker threads (torch names them pt_gloo_runloop)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return names.count("pt_gloo_runloop")


def _threads_after_shutdown(rank, world, pipeline):
    """Threads of gloo before and after ``zerostack.shutdown()``, with an engine alive and
    ``torch.distributed.nn.functional`` imported after ``init_process_group`` (as torch._dynamo
    does when the first optimizer is built in a script that imported nothing of it before)."""
    import importlib

    import torch.distributed.nn.functional as fn

    from tests.support.models import TINY, batch, tiny_gpt

    importlib.reload(fn)  # its defaults now hold the world group, as after a late import
    config = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 0 if pipeline else 2},
    }
    if pipeline:  # two stages sharing the embedding: a tied-weight group of their own
        from zerostack.models.gpt_pipe import GPTLoss, gpt_layers
        from zerostack.pipeline import PipelineModule

        topo = Topology.build(pp=2)
        model = PipelineModule(gpt_layers(TINY, topo), topology=topo, loss_fn=GPTLoss(topo))
        data = list(zip(*batch(0, 4), strict=True))
        engine = zerostack.initialize(model=model, config=config, training_data=data)[0]
        engine.train_batch()
    else:
        engine = zerostack.initialize(model=tiny_gpt(), config=config)[0]
        x, y = batch(0, 2)
        engine.backward(engine(x, y))
        engine.step()
    before = _gloo_threads()
    engine.destroy()
    zerostack.shutdown()
    return before, _gloo_threads()


@pytest.mark.distributed
@pytest.mark.parametrize("pipeline", [False, True], ids=["stage2", "pipeline-tied"])
def test_shutdown_ends_the_gloo_threads_while_the_engine_lives(pipeline):
    """A group that outlives ``shutdown`` is destroyed by the interpreter's last collection,
    where a gloo thread dropping a finished collective's tensor can abort the process
    ("terminate called without an active exception", CI stop 23); every group must be gone,
    and its threads joined, when ``shutdown`` returns, however long the engine lives on."""
    results = run_distributed(_threads_after_shutdown, world=2, args=(pipeline,))
    for before, after in results:
        assert before > 0, "no gloo threads before shutdown: the test proves nothing"
        assert after == 0, f"{after} gloo threads outlived shutdown ({before} before)"


@pytest.mark.parametrize(
    "backend,cuda,want",
    [
        ("nccl", True, "cuda"),
        ("cpu:gloo,cuda:nccl", True, "cuda"),  # torchtitan's; get_backend() is not "nccl"
        ("undefined", True, "cuda"),  # init_process_group() with no backend: gloo + NCCL
        ("gloo", True, "cpu"),  # gloo chosen on a GPU machine: the CPU, as asked
        ("cpu:gloo,cuda:gloo", True, "cpu"),
        ("nccl", False, "cpu"),
    ],
)
def test_the_device_follows_what_the_group_does_on_cuda_not_its_name(backend, cuda, want):
    from zerostack.world import device_type_of

    assert device_type_of(backend, cuda) == want


def test_a_local_rank_beyond_the_visible_gpus_takes_one_it_sees(caplog):
    from zerostack.world import local_device_index

    with caplog.at_level("WARNING", logger="zerostack"):
        assert local_device_index(3, 8) == 3
        assert not caplog.records
        assert local_device_index(5, 1) == 0  # Slurm --gpus-per-task=1: one GPU per process
        assert local_device_index(5, 4) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "LOCAL_RANK 5 but 1 visible GPU(s): using cuda:0 (one per process, as with Slurm's "
        "--gpus-per-task, is fine; otherwise check CUDA_VISIBLE_DEVICES)",
        "LOCAL_RANK 5 but 4 visible GPU(s): using cuda:1 (one per process, as with Slurm's "
        "--gpus-per-task, is fine; otherwise check CUDA_VISIBLE_DEVICES)",
    ]


def _mesh_device_of_a_gloo_nccl_group(rank, world):
    import zerostack.topology as topology

    seen = []
    real_mesh = topology.init_device_mesh

    def mesh(device_type, *args, **kwargs):
        seen.append(device_type)
        return real_mesh("cpu", *args, **kwargs)  # this machine has no GPU to build it on

    topology.init_device_mesh = mesh
    topology._bind_local_device = lambda: seen.append("bound")
    topology.torch.cuda.is_available = lambda: True
    # what init_process_group() reports on a GPU machine; get_backend() is not "nccl" there
    topology.dist.get_backend_config = lambda group=None: "cpu:gloo,cuda:nccl"
    Topology.build()
    return seen


@pytest.mark.distributed
def test_a_pre_initialised_gloo_and_nccl_group_builds_the_grid_on_the_gpu():
    assert run_distributed(_mesh_device_of_a_gloo_nccl_group, 1)[0] == ["bound", "cuda"]


def _sequence_axes(rank, world, cases):
    out = []
    for tp, sp, ring in cases:
        topo = Topology.build(tp=tp, sp=sp, ring=ring, timeout=TIMEOUT)
        facts = {"sizes": (topo.sp, topo.ring, topo.ulysses)}
        for axis in ("sp", "ulysses", "ring"):
            facts[axis] = (topo.rank(axis), topo.size(axis))
            if topo.size(axis) > 1:
                group = topo.group(axis)
                facts[axis] += (dist.get_process_group_ranks(group),)
                t = torch.tensor([1 << rank])
                Comm(topo).all_reduce(t, axis=axis)
                facts[axis] += (int(t),)
        out.append(facts)
    return out


SEQUENCE_CASES = [(1, 4, 2), (2, 4, 2), (1, 4, 4), (1, 4, 1), (1, 2, 2), (2, 2, 1)]


def _place(rank: int, tp: int, sp: int, ring: int) -> tuple[int, int, int, int]:
    """(run of sp dp ranks, ring rank, Ulysses rank, tp rank) of a global rank."""
    d, t = divmod(rank, tp)
    u = sp // ring
    return d // sp, (d % sp) // u, d % u, t


# the coordinates two ranks share on each axis: (run, ring, Ulysses, tp) positions
SHARED = {"sp": (0, 3), "ulysses": (0, 1, 3), "ring": (0, 2, 3)}


@pytest.mark.distributed
def test_ring_and_ulysses_axes_split_the_sp_ranks():
    """sp rank s of a batch is ring rank s // ulysses and Ulysses rank s % ulysses: the
    Ulysses groups are neighbours on dp, the ring groups the ranks ulysses apart; at ring 1 or
    ring = sp one of them is the sp group itself (8 ranks, with and without tp)."""
    per_rank = run_distributed(_sequence_axes, 8, args=(SEQUENCE_CASES,), timeout=120)
    for i, (tp, sp, ring) in enumerate(SEQUENCE_CASES):
        u = sp // ring
        places = [_place(r, tp, sp, ring) for r in range(8)]
        for rank, facts in enumerate(r[i] for r in per_rank):
            where = f"tp {tp} sp {sp} ring {ring} rank {rank}"
            _, g, j, _ = places[rank]
            assert facts["sizes"] == (sp, ring, u), where
            assert facts["ring"][:2] == (g, ring) and facts["ulysses"][:2] == (j, u), where
            assert facts["sp"][:2] == (g * u + j, sp), where
            for axis, shared in SHARED.items():
                members = [r for r in range(8)
                           if all(places[r][c] == places[rank][c] for c in shared)]  # fmt: skip
                assert len(members) == facts[axis][1], (where, axis)
                if len(members) > 1:
                    assert facts[axis][2:] == (members, sum(1 << m for m in members)), where


def _bad_ring(rank, world):
    try:
        Topology.build(sp=4, ring=3, timeout=TIMEOUT)
    except TopologyError as exc:
        return str(exc)


@pytest.mark.distributed
def test_a_ring_that_does_not_divide_sp_is_refused():
    for message in run_distributed(_bad_ring, 4, timeout=60):
        assert message == (
            "ring_parallel_size 3 does not divide sequence_parallel_size 4 (the sp ranks are "
            "ring groups of Ulysses ranks)"
        )
