"""zerostack's CUDA + NCCL path, run here on virtual CUDA (tests/vcuda.py): every tensor carries
the device CUDA would give it, ops that mix devices fail as on a GPU, and every tensor handed to
torch.distributed must be a contiguous cuda tensor, as NCCL requires. Each path runs on two gloo
ranks twice, once plainly on the CPU and once with ``Topology.device`` = cuda:0, and must end with
the same weights bit for bit (the same ops on the same host memory: the devices change nothing
but where things would live)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from common import TINY, batch, tiny_gpt
from distributed import run_distributed
from vcuda import virtual_cuda

import zerostack
from zerostack.models import GPTConfig

STEPS, MICRO, GAS = 2, 2, 2


def _config(stage: int, **extra) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    zero.update(extra.pop("zero", {}))
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 1000,
    }
    cfg.update(extra)
    return cfg


def _loop(engine, rank: int, world: int, steps=range(STEPS)) -> list[float]:
    """The DeepSpeed loop, batches moved to ``engine.device`` as a user moves them."""
    losses = []
    for step in steps:
        x, y = batch(step, MICRO * GAS * world)
        for m in range(GAS):
            lo = (m * world + rank) * MICRO
            xb, yb = x[lo : lo + MICRO].to(engine.device), y[lo : lo + MICRO].to(engine.device)
            loss = engine(xb, yb)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _host(state: dict) -> dict:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


# ---------------------------------------------------------------------- the paths
def _zero(rank, world, root, stage, model_cfg=TINY, **extra):
    torch.manual_seed(0)
    model = tiny_gpt(cfg=model_cfg)
    engine, *_ = zerostack.initialize(model=model, config=_config(stage, **extra))
    assert engine.device.type == ("cuda" if _VIRTUAL else "cpu")
    losses = _loop(engine, rank, world)
    return _host(engine.full_state_dict()), losses


def _offload_param(rank, world, root, device):
    nvme = {}
    if device == "nvme":
        nvme = {"nvme_path": os.path.join(root, f"swap{rank}")}
        os.makedirs(nvme["nvme_path"], exist_ok=True)
    zero = {
        "offload_param": {"device": device, **nvme},
        "offload_optimizer": {"device": device, **nvme},
    }
    return _zero(rank, world, root, 3, zero=zero)


def _zero_init(rank, world, root):
    torch.manual_seed(0)
    cfg = _config(3)
    with zerostack.zero.Init(config_dict_or_path=cfg):
        model = tiny_gpt()
    engine, *_ = zerostack.initialize(model=model, config=cfg)
    with zerostack.zero.GatheredParameters(list(engine.module.parameters())):
        first = _host({"wte": engine.module.wte.weight})
    losses = _loop(engine, rank, world)
    return _host(engine.full_state_dict()) | {"gathered.wte": first["wte"]}, losses


def _resume(rank, world, root, stage, model_cfg=TINY):
    """Save after a step, load into a fresh engine, step again: the run without the break."""
    torch.manual_seed(0)
    engine, *_ = zerostack.initialize(model=tiny_gpt(cfg=model_cfg), config=_config(stage))
    losses = _loop(engine, rank, world, range(1))
    engine.save_checkpoint(os.path.join(root, "ckpt"))
    torch.manual_seed(1)  # the restored generators, not these, must draw the dropout masks
    fresh, *_ = zerostack.initialize(model=tiny_gpt(seed=1, cfg=model_cfg), config=_config(stage))
    fresh.load_checkpoint(os.path.join(root, "ckpt"))
    losses += _loop(fresh, rank, world, range(1, STEPS))
    return _host(fresh.full_state_dict()), losses


def _cpu_adam(rank, world, root):
    """A user's own CPUAdam without offload, as DeepSpeed allows."""
    from zerostack.optim.cpu_adam import CPUAdam

    torch.manual_seed(0)
    model = tiny_gpt()
    cfg = _config(2)
    del cfg["optimizer"]
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.01, adamw_mode=True)
    engine, *_ = zerostack.initialize(model=model, optimizer=opt, config=cfg)
    losses = _loop(engine, rank, world)
    return _host(engine.full_state_dict()), losses


PIPE = GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=4, d_model=32, bias=False)


def _pipeline(rank, world, root, schedule, chunks):
    from zerostack import Topology
    from zerostack.models.gpt_pipe import GPTLoss, gpt_layers, load_plain_state
    from zerostack.pipeline import PipelineModule

    topo = Topology.build(pp=2)
    model = PipelineModule(
        gpt_layers(PIPE, topology=topo),
        topology=topo,
        loss_fn=GPTLoss(topo),
        partition_method="type:Block",
        virtual_stages=chunks,
    )
    load_plain_state(model, tiny_gpt(cfg=PIPE).state_dict(), PIPE)
    cfg = _config(1, pipeline={"schedule": schedule, "virtual_stages": chunks})
    engine, *_ = zerostack.initialize(model=model, config=cfg)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, MICRO * GAS)
        micro = [
            (x[m * MICRO : (m + 1) * MICRO], y[m * MICRO : (m + 1) * MICRO]) for m in range(GAS)
        ]
        losses.append(engine.train_batch(iter(micro)).item())
    return _host(engine.full_state_dict()), losses


def _tensor_parallel(rank, world, root, stage):
    from zerostack import Topology
    from zerostack.models import GPT

    topo = Topology.build(tp=2)
    torch.manual_seed(0)
    model = GPT(TINY, topology=topo, sequence_parallel=True)
    engine, *_ = zerostack.initialize(model=model, config=_config(stage))
    losses = []
    for step in range(STEPS):
        x, y = batch(step, MICRO * GAS)
        for m in range(GAS):
            xb, yb = x[m * MICRO : (m + 1) * MICRO], y[m * MICRO : (m + 1) * MICRO]
            loss = engine(xb.to(engine.device), yb.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return _host(engine.full_state_dict()), losses


CASES = {
    "stage0": (_zero, (0,)),
    "stage1": (_zero, (1,)),
    "stage2": (_zero, (2,)),
    "stage3": (_zero, (3,)),
    "stage3-bf16": (_zero, (3,), {"bf16": {"enabled": True}}),
    "stage2-fp16": (_zero, (2,), {"fp16": {"enabled": True, "initial_scale_power": 8}}),
    "stage2-offload": (_zero, (2,), {"zero": {"offload_optimizer": {"device": "cpu"}}}),
    "stage1-offload-pinned": (
        _zero,
        (1,),
        {"zero": {"offload_optimizer": {"device": "cpu", "pin_memory": True}}},
    ),
    "stage3-offload-param-cpu": (_offload_param, ("cpu",)),
    "stage3-offload-param-nvme": (_offload_param, ("nvme",)),
    "stage3-zero-init": (_zero_init, ()),
    "stage2-resume": (_resume, (2,)),
    "stage3-resume": (_resume, (3,)),
    "cpu-adam": (_cpu_adam, ()),
    "pipeline-1f1b": (_pipeline, ("1f1b", 1)),
    "pipeline-interleaved": (_pipeline, ("interleaved", 2)),
    "tp2-sp-stage1": (_tensor_parallel, (1,)),
}
DROPOUT = dataclasses.replace(TINY, dropout=0.1)
# compared with another case on virtual CUDA, not with the CPU run: dropout draws from the
# device's generator there
AGAINST = {
    "dropout": (_zero, (2,), {"model_cfg": DROPOUT}),
    "activation-checkpointing-dropout": (
        _zero,
        (2,),
        {
            "model_cfg": dataclasses.replace(DROPOUT, checkpoint_every=1),
            "activation_checkpointing": {"partition_activations": True},
        },
        "dropout",
    ),
    "resume-dropout": (_resume, (2,), {"model_cfg": DROPOUT}, "dropout"),
}

_VIRTUAL = False


def _run(rank, world, root, name, virtual):
    global _VIRTUAL
    fn, args, *extra = CASES.get(name) or AGAINST[name]
    kwargs = extra[0] if extra else {}
    _VIRTUAL = virtual
    if not virtual:
        return fn(rank, world, os.path.join(root, "cpu"), *args, **kwargs)
    with virtual_cuda():
        return fn(rank, world, os.path.join(root, "cuda"), *args, **kwargs)


def _same(reference, results) -> None:
    for (want, want_losses), (got, got_losses) in zip(reference, results, strict=True):
        assert got_losses == want_losses
        assert want.keys() == got.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("name", list(CASES))
def test_the_cuda_path_runs_and_matches_the_cpu_run(tmp_path, name):
    plain = run_distributed(_run, world=2, args=(str(tmp_path), name, False))
    _same(plain, run_distributed(_run, world=2, args=(str(tmp_path), name, True)))


@pytest.mark.parametrize("name", [n for n in AGAINST if len(AGAINST[n]) > 3])
def test_with_dropout_on_the_device_generator(tmp_path, name):
    """Activation checkpointing recomputes with the same device masks; a resumed run draws
    the masks the uninterrupted one draws (the device generator is checkpointed)."""
    reference = run_distributed(_run, world=2, args=(str(tmp_path / "ref"), AGAINST[name][3], True))
    _same(reference, run_distributed(_run, world=2, args=(str(tmp_path), name, True)))
