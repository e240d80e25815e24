"""ZeRO-Offload and ZeRO-Infinity: the optimizer state in host memory or in files, same results.

Each rank trains the same model twice in one process, without and with offload, and compares the
parameters: the offloaded step runs the same arithmetic on the same fp32 values (on this machine
host and device are both the CPU, and the same code path copies between them) with the same Adam
kernel (torch's fused AdamW, which CPUAdam calls), so they must agree bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

import zerostack

from tests.support.models import TINY, batch, tiny_gpt
from tests.support.ranks import run_distributed

STEPS, B = 5, 8


def _config(world, stage, offload=None, **zero):
    zcfg = {"stage": stage, "reduce_bucket_size": 5000, "stage3_param_persistence_threshold": 0}
    if offload is not None:
        zcfg["offload_optimizer"] = offload
    return {
        "train_micro_batch_size_per_gpu": B // world,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {**zcfg, **zero},
    }


def _step(engine, rank, world, step):
    """One optimizer step: two micro-batches of B sequences, this rank's share of each."""
    x, y = batch(step, 2 * B)
    per = B // world
    for m in range(2):
        lo = m * B + rank * per
        engine.backward(engine(x[lo : lo + per], y[lo : lo + per]))
        engine.step()


def _run(rank, world, cfg):
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
    seen = {"files": 0, "host_peak": 0}
    for step in range(STEPS):
        _step(engine, rank, world, step)
        swapper = getattr(engine.zero.store, "swapper", None)
        if swapper is not None:
            seen["files"] = max(seen["files"], len(os.listdir(swapper.store.dir)))
            seen["dir"] = swapper.store.dir
            sizes = [n * 4 * 3 for n in swapper.numel.values()]  # fp32 master + two moments
            seen["sub_groups"], seen["largest"], seen["total"] = len(sizes), max(sizes), sum(sizes)
    seen["host_peak"] = engine.zero.host_meter.peak
    state = engine.full_state_dict()
    engine.destroy()
    return state, seen, engine.optimizer.__class__.__name__


def _compare(rank, world, stage, device, nvme_root):
    base, _, _ = _run(rank, world, _config(world, stage))
    offload = {"device": device}
    if device == "nvme":
        offload.update(nvme_path=nvme_root, buffer_count=3)
    # sub-groups of 1/8 of the parameters (whole parameters each, so a large one stands alone)
    sub = sum(p.numel() for p in tiny_gpt().parameters()) // 8
    got, seen, opt = _run(rank, world, _config(world, stage, offload, sub_group_size=sub))
    same = all(torch.equal(got[k], base[k]) for k in base)
    worst = max(float((got[k] - base[k]).norm() / base[k].norm()) for k in base)
    return same, worst, seen, opt


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.slow
def test_offloaded_training_matches(stage, device, world, tmp_path):
    results = run_distributed(_compare, world, args=(stage, device, str(tmp_path)))
    for rank, (same, worst, seen, opt) in enumerate(results):
        assert same, f"rank {rank}: {opt} differs from the run without offload by {worst:.2e}"
        assert opt == "CPUAdam"  # offloaded AdamW steps with zerostack's CPU Adam
        if device == "nvme":
            # files existed during training, one per sub-group (and at stage 3 one per parameter's
            # gradient: stage 3 keeps its fp32 gradients in files too), gone after destroy()
            grads = sum(1 for _ in tiny_gpt().parameters()) if stage == 3 else 0
            assert seen["files"] == seen["sub_groups"] + grads and seen["sub_groups"] >= 4, seen
            assert not os.path.exists(seen["dir"])
            # host memory for the state: at most buffer_count (3) sub-groups at once, well
            # below the whole state
            assert 0 < seen["host_peak"] <= 3 * seen["largest"], seen
            assert seen["host_peak"] < 0.8 * seen["total"], seen
    assert os.listdir(tmp_path) == []


def _params_offloaded(rank, world, device, nvme_root):
    base, _, _ = _run(rank, world, _config(world, 3))
    place = {"device": device}
    if device == "nvme":
        place["nvme_path"] = nvme_root
    both = {"device": "nvme", "nvme_path": nvme_root, "buffer_count": 3}
    sub = sum(p.numel() for p in tiny_gpt().parameters()) // 8
    out = {}
    for name, opt in (("params", None), ("params+optimizer", both)):
        cfg = _config(world, 3, opt, sub_group_size=sub, offload_param=place)
        engine, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
        files = len(os.listdir(engine.zero.param_swapper.store.dir)) if device == "nvme" else 0
        resident = engine.memory_breakdown()["params"]
        for step in range(STEPS):
            _step(engine, rank, world, step)
        got = engine.full_state_dict()
        engine.destroy()
        out[name] = (all(torch.equal(got[k], base[k]) for k in base), files, resident)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.slow
def test_stage3_parameters_offloaded(device, world, tmp_path):
    """offload_param: each rank's parameter pieces in files (or host memory), read in for each
    gather; alone and with the optimizer on NVMe too, the run is the run without offload."""
    n_params = sum(1 for _ in tiny_gpt().parameters())
    for rank, out in enumerate(
        run_distributed(_params_offloaded, world, args=(device, str(tmp_path)))
    ):
        for name, (same, files, resident) in out.items():
            assert same, f"rank {rank}, {name}: differs from the run without offload"
            assert resident == 0, f"{name}: {resident} bytes of parameter pieces stay in memory"
            if device == "nvme":
                assert files == n_params  # one file per parameter piece
    assert os.listdir(tmp_path) == []


def _infinity(rank, world, nvme_root):
    base, _, _ = _run(rank, world, _config(world, 3))
    nvme = {"device": "nvme", "nvme_path": nvme_root, "buffer_count": 3}
    sub = sum(p.numel() for p in tiny_gpt().parameters()) // 8
    cfg = _config(world, 3, nvme, sub_group_size=sub, offload_param=nvme)
    with zerostack.zero.Init(remote_device="nvme", config_dict_or_path=cfg) as init:
        model = tiny_gpt()
    in_memory = sum(p._zs.piece.untyped_storage().nbytes() for p in model.parameters())
    files_at_init = len(os.listdir(init.swapper.store.dir))
    engine, *_ = zerostack.initialize(model=model, config=cfg)
    for step in range(STEPS):
        _step(engine, rank, world, step)
    got = engine.full_state_dict()
    engine.destroy()
    return all(torch.equal(got[k], base[k]) for k in base), in_memory, files_at_init


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
def test_zero_init_straight_to_nvme(world, tmp_path):
    """zero.Init(remote_device="nvme"): pieces go to files as the model is built (a byte per
    piece stays in memory, the stride-0 placeholder), and the engine trains from those files."""
    n_params = sum(1 for _ in tiny_gpt().parameters())
    for same, in_memory, files in run_distributed(_infinity, world, args=(str(tmp_path),)):
        assert same
        assert in_memory <= 4 * n_params and files == n_params
    assert os.listdir(tmp_path) == []


SKIP = 2  # the step whose passes skip the last block (an order other than the recorded one)


def _train_skipping(engine, rank, world, after_step=lambda: None):
    block = engine.module.blocks[-1]
    for step in range(STEPS):
        if step == SKIP:
            block.forward = lambda x: x
        _step(engine, rank, world, step)
        if step == SKIP:
            del block.forward
        after_step()


def _reads_off_the_training_thread(rank, world, nvme_root):
    """Stage 3 with its pieces in files: which thread read each file; per step how many pieces
    were read ahead of their gather and how many at it, and the host bytes still held after it.
    At step SKIP both runs skip the last block, so reads made ahead for it go unused."""
    import threading

    # the prefetch one module deep (the largest's size, the head's), so each pass's first gather
    # is its first module and one more: the counts below
    plain = _config(world, 3, stage3_prefetch_bucket_size=8192)
    plain["gradient_clipping"] = 0.0
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=plain)
    _train_skipping(engine, rank, world)
    base = engine.full_state_dict()
    engine.destroy()
    nvme = {"device": "nvme", "nvme_path": nvme_root}
    cfg = {**plain, "zero_optimization": {**plain["zero_optimization"], "offload_param": nvme}}
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
    swapper = engine.zero.param_swapper
    threads, read_into = set(), swapper.store.read_into

    def watched(key, tensors):
        threads.add(threading.current_thread().name)
        return read_into(key, tensors)

    swapper.store.read_into = watched
    passes, held, seen = [], [], [0, 0]

    def after_step():
        early, demand = swapper.read_early, swapper.read_on_demand
        passes.append((early - seen[0], demand - seen[1]))
        seen[:] = early, demand
        held.append(engine.zero.host_meter.live)

    _train_skipping(engine, rank, world, after_step)
    got = engine.full_state_dict()
    units = [len(u) for u in engine.zero.coord.units]
    engine.destroy()
    same = all(torch.equal(got[k], base[k]) for k in base)
    return same, threads, passes, held, units


@pytest.mark.distributed
def test_nvme_pieces_are_read_ahead_off_the_training_thread(tmp_path):
    """ZeRO-Infinity's parameter reads run on the swapper's thread, never on the training
    thread, and once the order is recorded each unit's pieces are read while an earlier unit
    computes: only the first gathers of each pass wait for the disk. Reads ahead that a pass
    did not use (it took another order) are dropped as it ends, not used after the step."""
    for same, threads, passes, held, units in run_distributed(
        _reads_off_the_training_thread, 2, args=(str(tmp_path),)
    ):
        assert same
        assert threads and all(t.startswith("zerostack-nvme") for t in threads), threads
        assert held == [0] * STEPS  # no piece, read ahead or not, is held between steps
        # a step is two passes (micro-steps); each reads every piece it gathers once
        per_pass = sum(passes[-1]) // 2
        steady = [p for i, p in enumerate(passes) if i != SKIP]
        assert per_pass >= sum(units) and all(sum(p) == 2 * per_pass for p in steady), passes
        # the first pass records the order, so it reads at each gather; the second, like each
        # pass after it, waits only at its first gather (the first unit and the one prefetched
        # with it): every later piece was read while an earlier unit computed
        assert passes[0] == (per_pass - 2, per_pass + 2), passes
        assert all(p == (2 * per_pass - 4, 4) for p in steady[1:]), passes
    assert os.listdir(tmp_path) == []


def _bad_path(rank, world, path):
    cfg = _config(1, 2, {"device": "nvme", "nvme_path": path})
    try:
        zerostack.initialize(model=tiny_gpt(), config=cfg)
    except zerostack.ConfigError as exc:
        return str(exc)


@pytest.mark.distributed
def test_missing_nvme_path_is_a_clear_error(tmp_path):
    missing = str(tmp_path / "nope")
    msg = run_distributed(_bad_path, 1, args=(missing,))[0]
    assert msg == f"zero_optimization.offload_optimizer.nvme_path: {missing!r} is not a directory"


def test_tiny_is_what_the_parity_tests_use():
    assert TINY.bias is False  # see tests/support/models.py: keeps Adam's updates well conditioned
