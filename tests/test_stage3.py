"""ZeRO stage 3 specifics: zero.Init, GatheredParameters, a module called twice, prefetch, the
3 psi communication volume, and 16-bit training. Parity tolerance as in test_data_parallel."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerostack
from zerostack.models import GPT

from tests.support.models import TINY, batch, max_rel_diff, reference_train, tiny_gpt
from tests.support.ranks import run_distributed

pytestmark = pytest.mark.distributed  # every test here starts ranks

OPT = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}


def _config(world, **zero):
    return {
        "train_micro_batch_size_per_gpu": 8 // world,
        "gradient_clipping": 0.5,
        "optimizer": OPT,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }


def _steps(engine, rank, world, steps=5, size=8):
    n = size // world
    losses = []
    for step in range(steps):
        x, y = batch(step, size)
        loss = engine(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


# ------------------------------------------------------------------------------ zero.Init
# Six blocks, so that no single module is a large part of the model (the embedding is ~10%).
DEEP = dataclasses.replace(TINY, n_layer=6)
PREFETCH = 3000


def _init_and_train(rank, world):
    with zerostack.zero.Init() as init:
        torch.manual_seed(0)
        model = GPT(DEEP)
    full = sum(p._zs.numel for p in model.parameters()) * 4
    largest = max(
        sum(p._zs.numel for p in m.parameters(recurse=False)) * 4 for m in model.modules()
    )
    assert all(p.numel() == 0 for p in model.parameters()), "a parameter stayed whole"
    assert not hasattr(torch.nn.Linear.__init__, "__wrapped__"), "Init did not restore __init__"
    build_peak = init.meter.peak
    cfg = _config(world, stage3_prefetch_bucket_size=PREFETCH)
    engine, *_ = zerostack.initialize(model=model, config=cfg)
    _steps(engine, rank, world)
    return engine.full_state_dict(), build_peak, engine.zero.meter.peak, full, largest


@pytest.mark.slow
def test_zero_init_never_holds_the_model_and_trains_the_same():
    ref = reference_train(5, 8, clip=0.5, cfg=DEEP)
    for state, build_peak, train_peak, full, largest in run_distributed(_init_and_train, 4):
        diff, name = max_rel_diff(state, ref)
        assert diff <= 1e-5, f"{name}: relative difference {diff:.2e}"
        pad = 4 * 3 * 80  # at most 3 padding elements per parameter
        # Building: the shards so far plus the one module being built.
        assert build_peak <= full / 4 + largest + pad, (build_peak, full)
        # Training: the shards, plus the module in use, the tied embedding/head held across the
        # forward, and the prefetch window (which may overrun its budget by one module).
        bound = full / 4 + 3 * largest + PREFETCH * 4 + pad
        assert train_peak <= bound, f"held {train_peak} bytes; bound {bound:.0f}, model {full}"
        assert bound < 0.7 * full  # the bound is meaningful: well below the whole model


# ------------------------------------------------------------------------------ GatheredParameters
def _gathered(rank, world):
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(world))
    w = engine.module.wpe.weight
    assert w.numel() == 0
    with zerostack.zero.GatheredParameters(w):
        seen = w.detach().clone()  # every rank reads the whole parameter
    assert w.numel() == 0
    with zerostack.zero.GatheredParameters(w, modifier_rank=1):
        if rank == 1:
            w.data.fill_(0.5)
    after = engine.full_state_dict()["wpe.weight"]
    _steps(engine, rank, world, steps=1)  # the write reached the fp32 master the optimizer steps
    moved = engine.full_state_dict()["wpe.weight"]
    return seen, after, moved


def test_gathered_parameters_read_and_write_back():
    ref = tiny_gpt().wpe.weight.detach()
    for seen, after, moved in run_distributed(_gathered, 2):
        assert torch.equal(seen, ref)
        assert torch.equal(after, torch.full_like(ref, 0.5))
        assert (moved - 0.5).abs().max() <= 1.1e-3  # one AdamW step of lr 1e-3 from 0.5


# ------------------------------------------------------------------------------ module used twice
class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 8)
        self.shared = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x, y):
        h = torch.tanh(self.shared(torch.tanh(self.inp(x))))
        return F.mse_loss(self.out(torch.tanh(self.shared(h))), y)


def _twice_data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)


def _twice(rank, world):
    model = Twice()
    engine, *_ = zerostack.initialize(model=model, config=_config(world))
    n = 8 // world
    for step in range(5):
        x, y = _twice_data(step)
        engine.backward(engine(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]))
        engine.step()
    return engine.full_state_dict()


def test_module_called_twice_in_one_forward():
    model = Twice()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for step in range(5):
        model(*_twice_data(step)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    ref = {k: v.detach() for k, v in model.named_parameters()}
    for got in run_distributed(_twice, 2):
        diff, name = max_rel_diff(got, ref)
        assert diff <= 1e-5, f"{name}: relative difference {diff:.2e}"


# ------------------------------------------------------------------------------ comm volume
def _comm(rank, world):
    engine, *_ = zerostack.initialize(
        model=tiny_gpt(), config=_config(world, stage3_prefetch_bucket_size=2000)
    )
    _steps(engine, rank, world, steps=3)
    psi = sum(p._zs.numel for p in engine.module.parameters())
    tied = engine.module.wte.weight._zs.numel
    return psi, tied, [engine.comm.log.step_summary(s) for s in range(3)], engine.zero.prefetched


@pytest.mark.parametrize("world", [2, 4])
def test_stage3_moves_three_psi_and_prefetches(world):
    """Forward gathers psi, backward gathers psi, gradients reduce-scatter psi. The tied
    embedding/head weight is gathered twice in forward (its two uses are a whole model apart and
    it is freed in between), so it adds its size once; the norm adds one 4-byte all-reduce."""
    for psi, tied, summaries, prefetched in run_distributed(_comm, world):
        for summary in summaries:
            total = sum(v["bytes"] for v in summary.values())
            assert total <= (3 * psi + tied) * 4 * 1.05, f"{total} bytes moved for psi = {psi}"
            assert summary["all_gather"]["bytes"] >= (2 * psi + tied) * 4
            assert summary["reduce_scatter"]["bytes"] >= psi * 4
        assert prefetched > 0, "no gather was prefetched after the first step"


# ------------------------------------------------------------------------------ 16-bit
def _half(rank, world, precision):
    cfg = _config(world)
    cfg[precision] = {"enabled": True}
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 3e-3}}
    if precision == "fp16":
        cfg["fp16"].update(initial_scale_power=8)
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
    return _steps(engine, rank, world, steps=30), engine.skipped_steps


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.slow
def test_stage3_16_bit_trains(precision):
    losses, skipped = run_distributed(_half, 2, args=(precision,))[0]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, f"{precision}: loss {first:.3f} -> {last:.3f}"
    assert skipped <= 3


def _norm_ops(rank, world, n_layer):
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = tiny_gpt(cfg=dataclasses.replace(TINY, n_layer=n_layer))
    engine, *_ = zerostack.initialize(model=model, config=_config(world))
    x, y = batch(0, 8)
    engine.backward(engine(x[:4], y[:4]))
    with Count() as count:
        sq = engine.zero.grad_norm_sq(set())
    params = len(list(model.parameters()))
    reference = sum(float(g.grad_shard.square().sum()) for g in engine.zero.groups)
    engine.destroy()
    return dict(count.ops), params, float(sq), reference


@pytest.mark.parametrize("n_layer", [1, 3])
def test_the_norm_takes_one_multi_tensor_kernel_not_three_per_parameter(n_layer):
    """Stage 3's gradient norm: one ``_foreach_norm`` over every piece, whatever the parameter
    count (a GPU ran three tiny kernels per parameter before the host's one read)."""
    ops, params, sq, reference = run_distributed(_norm_ops, world=2, args=(n_layer,))[0]
    assert params > 6 * n_layer  # each layer has six or more
    assert ops["aten._foreach_norm.Scalar"] == 1 and "aten.linalg_vector_norm.default" not in ops
    assert sum(ops.values()) <= 5, ops
    assert sq == pytest.approx(reference, rel=1e-5)
