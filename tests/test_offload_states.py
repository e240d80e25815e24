"""``engine.offload_states()`` / ``reload_states()`` (DeepSpeed's, for RL colocation), on virtual
CUDA (tests/support/vcuda.py) at 2 ranks: the device bytes of the offloaded states, counted by the
census of live storages (tests/support/census.py), not by the engine, drop by at least 95%; the
allocator's figure drops with them; and after ``reload_states()`` training continues bit for
bit as a run that never offloaded."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

import zerostack
from zerostack.compat.deepspeed.runtime.zero.offload_config import (
    OffloadDeviceEnum,
    OffloadStateTypeEnum,
)
from zerostack.zero.offload.states import StateOffload

from tests.support.census import baseline, take
from tests.support.models import batch, tiny_gpt
from tests.support.ranks import run_distributed
from tests.support.vcuda import MEMORY, virtual_cuda

MICRO = 2
KINDS = ("params", "grads", "master", "optimizer")  # the census's categories of state


def _config(stage: int, precision: str = "bf16") -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _step(engine, rank: int, world: int, i: int) -> float:
    x, y = batch(i, MICRO * world)
    lo = rank * MICRO
    loss = engine(x[lo : lo + MICRO].to(engine.device), y[lo : lo + MICRO].to(engine.device))
    engine.backward(loss)
    engine.step()
    return loss.item()


def _engine(stage: int, precision: str = "bf16"):
    torch.manual_seed(0)
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(stage, precision))
    return engine


def _after(engine) -> dict:
    return {k: v.detach().cpu().clone() for k, v in engine.full_state_dict().items()}


def _round_trip(rank, world, stage):
    with virtual_cuda():
        reference = _engine(stage)
        want = [_step(reference, rank, world, i) for i in range(4)]
        want_state = _after(reference)
        reference.destroy()
        del reference

        before = baseline()
        engine = _engine(stage)
        got = [_step(engine, rank, world, i) for i in range(2)]
        torch.distributed.barrier()  # the steps' collectives done, their buffers let go
        gc.collect()  # and what they left in cycles freed now, not inside the measured window
        held = take(engine, exclude=before, settle=0).on("cuda")
        allocated = MEMORY.allocated
        engine.offload_states(non_blocking=True)
        freed = allocated - MEMORY.allocated  # the offload's own, before the census runs
        away = take(engine, exclude=before, settle=0).on("cuda")
        moved = dict(engine.states.moved)
        refused = []
        for call in (lambda: engine(torch.zeros(1, 4, dtype=torch.long)), engine.step):
            try:
                call()
            except RuntimeError as e:
                refused.append(str(e))
        engine.reload_states(non_blocking=True)
        back = take(engine, exclude=before, settle=0).on("cuda")
        got += [_step(engine, rank, world, i) for i in range(2, 4)]
        state = _after(engine)
        engine.destroy()
        before.release()
        return want, want_state, got, state, held, away, back, freed, moved, refused


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_states_leave_the_device_and_training_continues_bit_for_bit(stage):
    """bf16 at dp 2, all kinds offloaded after two steps (non-blocking, pinned), two more steps
    after the reload: the states' device bytes drop to nothing (the census, at most 5% left),
    the allocator's count drops by what the engine says it moved, forward and step are refused
    meanwhile, and the losses and final weights equal a run that never offloaded."""
    for result in run_distributed(_round_trip, world=2, args=(stage,)):
        want, want_state, got, state, held, away, back, freed, moved, refused = result
        assert got == want
        assert state.keys() == want_state.keys()
        for k in want_state:
            assert torch.equal(state[k], want_state[k]), k
        on_device = sum(held[k] for k in KINDS)
        assert on_device > 0 and held["optimizer"] > 0 and held["master"] > 0
        assert sum(away[k] for k in KINDS) <= 0.05 * on_device, (held, away)
        assert {k: back[k] for k in KINDS} == {k: held[k] for k in KINDS}
        assert freed == sum(moved.values()) >= 0.95 * on_device
        assert moved["optim_states"] == held["optimizer"]
        assert moved["hp_params"] == held["master"]
        assert refused[0].startswith("forward: the model's parameters (lp_params) are in host")
        assert refused[1] == (
            "engine.step(): the engine's states (contiguous_grad_buffer, hp_params, lp_grads, "
            "lp_params, optim_states) are in host memory after engine.offload_states(); call "
            "engine.reload_states() first"
        )


def _generate_meanwhile(rank, world, stage):
    """OpenRLHF's colocation: the optimizer's states and masters leave, the parameters stay
    for generation (forward without gradients), then training goes on."""
    with virtual_cuda():
        reference = _engine(stage)
        want = [_step(reference, rank, world, i) for i in range(3)]
        reference.destroy()
        del reference
        engine = _engine(stage)
        got = [_step(engine, rank, world, 0)]
        include = [
            OffloadStateTypeEnum.optim_states,
            OffloadStateTypeEnum.contiguous_grad_buffer,
            OffloadStateTypeEnum.hp_params,
        ]
        engine.offload_states(include=include, device=OffloadDeviceEnum.cpu, pin_memory=True)
        x, y = batch(7, MICRO)
        with torch.no_grad():
            sampled = engine(x.to(engine.device), y.to(engine.device)).item()
        try:
            engine.backward(torch.zeros((), requires_grad=True))
            refused = None
        except RuntimeError as e:
            refused = str(e)
        engine.reload_states()
        got += [_step(engine, rank, world, i) for i in range(1, 3)]
        moved = dict(engine.states.moved)
        engine.destroy()
        return want, got, sampled, refused, moved


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_the_parameters_stay_for_generation_when_only_the_optimizer_leaves(stage):
    for want, got, sampled, refused, moved in run_distributed(
        _generate_meanwhile, world=2, args=(stage,)
    ):
        assert got == want
        assert sampled == sampled and sampled > 0  # a finite loss from the resident weights
        assert refused.startswith("engine.backward(): the engine's states (contiguous_grad_")
        assert set(moved) == {"optim_states", "contiguous_grad_buffer", "hp_params"}
        assert moved["optim_states"] > 0 and moved["hp_params"] > 0


def _fp32_masters_are_the_parameters(rank, world):
    with virtual_cuda():
        engine = _engine(1, precision="fp32")
        _step(engine, rank, world, 0)
        engine.offload_states(include=["hp_params", "optim_states"])
        moved = dict(engine.states.moved)
        x, y = batch(3, MICRO)
        with torch.no_grad():
            loss = engine(x.to(engine.device), y.to(engine.device)).item()
        engine.reload_states()
        engine.destroy()
        return moved, loss


@pytest.mark.distributed
def test_fp32_masters_that_are_the_parameters_stay_with_them():
    """In fp32 at stage 1 a master is a view of the parameters' flat buffer: offloading
    ``hp_params`` alone leaves that storage (it is also ``lp_params``), and forward runs."""
    for moved, loss in run_distributed(_fp32_masters_are_the_parameters, world=2):
        assert moved["hp_params"] == 0 and moved["optim_states"] > 0
        assert loss == loss


def test_bad_requests_are_refused(caplog):
    engine = _engine(2)
    with pytest.raises(ValueError, match=r"^offload_states: unknown state 'adam' \(known: optim"):
        engine.offload_states(include=["adam"])
    with pytest.raises(ValueError, match="^offload_states: device 'nvme' is not supported"):
        engine.offload_states(device="nvme")
    with caplog.at_level(logging.WARNING, logger="zerostack"):
        engine.offload_states(device=OffloadDeviceEnum.none)
    assert "offload_states: device 'none': nothing moved" in caplog.text
    assert not engine.states.parked
    engine.offload_states()  # a CPU run: every state is in host memory already
    assert sum(engine.states.moved.values()) == 0
    engine.reload_states()
    engine.destroy()
    forward_only, *_ = zerostack.initialize(model=tiny_gpt(), config={"train_batch_size": 2})
    with pytest.raises(RuntimeError, match="^offload_states: this engine has no optimizer"):
        forward_only.offload_states()
    forward_only.destroy()


class _OneBuffer:
    """A strategy whose parameters and masters share one device storage."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf

    def state_tensors(self):
        yield "params", self.buf[:4]
        yield "master", self.buf[4:]


def test_a_storage_moves_only_when_every_kind_on_it_is_asked_for():
    with virtual_cuda():
        buf = torch.arange(8.0, device="cuda")
        states = StateOffload(torch.nn.Linear(1, 1), _OneBuffer(buf), optimizer=None)
        states.offload(include=["hp_params"])
        assert states.moved == {"hp_params": 0} and buf.untyped_storage().nbytes() == 32
        states.offload(include=["hp_params", OffloadStateTypeEnum.lp_params])
        assert states.moved == {"hp_params": 32, "lp_params": 32}
        assert buf.untyped_storage().nbytes() == 0
        states.reload()
        assert torch.equal(buf.cpu(), torch.arange(8.0))
