"""zerostack.initialize: DeepSpeed's arguments and return values, parameter groups, errors."""

from __future__ import annotations

import types

import pytest
import torch

import zerostack
from zerostack import ConfigError

from tests.support.models import batch, max_rel_diff, tiny_gpt
from tests.support.ranks import run_distributed

OPT = {"type": "AdamW", "params": {"lr": 1e-3}}


def _groups(model):
    """Decay on matrices; no decay, a higher lr on norms (DeepSpeed/HF fine-tuning style)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3},
    ]


def _reference_groups(steps, frozen=False):
    model = tiny_gpt()
    if frozen:
        model.blocks[0].requires_grad_(False)
    opt = torch.optim.AdamW(_groups(model), lr=1e-3)
    for step in range(steps):
        x, y = batch(step, 8)
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _train_groups(rank, world, how, frozen=False, stage=0):
    model = tiny_gpt()
    if frozen:
        model.blocks[0].requires_grad_(False)
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    cfg = {
        "train_micro_batch_size_per_gpu": 8 // world,
        "gradient_clipping": 0.0,  # the reference does not clip
        "zero_optimization": zero,
    }
    if how == "model_parameters":
        engine, opt, _, _ = zerostack.initialize(
            model=model, model_parameters=_groups(model), config={**cfg, "optimizer": OPT}
        )
    elif how == "optimizer":
        user_opt = torch.optim.AdamW(_groups(model), lr=1e-3)
        engine, opt, _, _ = zerostack.initialize(model=model, optimizer=user_opt, config=cfg)
        assert opt is user_opt  # the user's object, now stepping flat fp32 tensors
    else:
        factory = lambda groups: torch.optim.AdamW(groups, lr=1e-3)  # noqa: E731
        engine, opt, _, _ = zerostack.initialize(
            model=model, model_parameters=_groups(model), optimizer=factory, config=cfg
        )
    assert [len(g["params"]) for g in opt.param_groups] == [1, 1]
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 3e-3]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    initial = dict(tiny_gpt().named_parameters())
    n = 8 // world
    for step in range(4):
        x, y = batch(step, 8)
        engine.backward(engine(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]))
        engine.step()
    state = engine.full_state_dict()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, f"{name}: a frozen parameter got a gradient buffer"
            assert torch.equal(state[name], initial[name]), f"{name}: a frozen parameter changed"
            if stage == 3:
                assert p.numel() == 0, f"{name}: a frozen parameter is not sharded at stage 3"
    if frozen:
        assert engine.memory_breakdown()["grads"] < 4 * sum(
            p.numel() for p in initial.values()
        ) // (world if stage >= 2 else 1), "frozen parameters got gradient storage"
    return state


@pytest.mark.distributed
@pytest.mark.parametrize(
    "how,stage",
    [("model_parameters", 0), ("optimizer", 1), ("callable", 2), ("optimizer", 3), ("callable", 3)],
)
def test_parameter_groups_keep_their_options(how, stage):
    ref = _reference_groups(4)
    got = run_distributed(_train_groups, 2, args=(how,), kwargs={"stage": stage})[0]
    diff, name = max_rel_diff(got, ref)
    assert diff <= 1e-5, f"{name}: relative difference {diff:.2e}"


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_frozen_layers_stay_frozen_and_the_rest_matches(stage):
    ref = _reference_groups(4, frozen=True)
    kwargs = {"frozen": True, "stage": stage}
    got = run_distributed(_train_groups, 2, args=("model_parameters",), kwargs=kwargs)[0]
    diff, name = max_rel_diff(got, ref)
    assert diff <= 1e-5, f"{name}: relative difference {diff:.2e}"


def _loader_indices(rank, world):
    data = [torch.tensor([i]) for i in range(40)]
    args = types.SimpleNamespace(deepspeed_config=None)
    cfg = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "optimizer": OPT}
    args.deepspeed_config = cfg  # DeepSpeed's args.deepspeed_config route
    engine, _, loader, sched = zerostack.initialize(args=args, model=tiny_gpt(), training_data=data)
    assert sched is None
    assert engine.train_micro_batch_size_per_gpu() == 8 // (2 * world)
    assert engine.train_batch_size() == 8 and engine.gradient_accumulation_steps() == 2
    sizes = {len(b) for b in loader}
    return sizes, [int(i) for b in loader for i in b.view(-1)]


@pytest.mark.distributed
def test_dataloader_shards_the_data_over_dp_ranks():
    (sizes0, idx0), (sizes1, idx1) = run_distributed(_loader_indices, 2)
    assert sizes0 == sizes1 == {2}
    assert not set(idx0) & set(idx1)
    assert sorted(idx0 + idx1) == list(range(40))


@pytest.mark.distributed
def test_scheduler_from_config_steps_with_the_engine():
    cfg = {
        "train_batch_size": 2,
        "optimizer": OPT,
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"},
        },
    }
    got = run_distributed(_lrs, 1, args=(cfg,))[0]
    assert got == pytest.approx([0.0, 0.0, 0.0025, 0.005, 0.0075, 0.01, 0.01])


def _lrs(rank, world, cfg):
    engine, opt, _, sched = zerostack.initialize(model=tiny_gpt(), config=cfg)
    assert sched is engine.lr_scheduler and opt is engine.optimizer
    lrs = [engine.get_lr()[0]]
    for step in range(6):
        x, y = batch(step, 2)
        engine.backward(engine(x, y))
        engine.step()
        lrs.append(engine.get_lr()[0])
    return lrs


def test_optimizer_twice_is_an_error():
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="^optimizer: given both"):
        zerostack.initialize(
            model=model, optimizer=opt, config={"train_batch_size": 2, "optimizer": OPT}
        )


def _forward_only(rank, world, stage, root):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    sgd = {"type": "SGD", "params": {"lr": 0.5}}
    trained, *_ = zerostack.initialize(model=tiny_gpt(), config={**cfg, "optimizer": sgd})
    x, y = batch(0, 4)
    for _ in range(2):
        trained.backward(trained(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
        trained.step()
    with torch.no_grad():
        want = trained(x, y).item()
    trained.save_checkpoint(root)
    engine, optimizer, _, scheduler = zerostack.initialize(model=tiny_gpt(seed=5), config=cfg)
    engine.load_checkpoint(root)
    with torch.no_grad():
        got = engine(x, y).item()
    memory = engine.memory_breakdown()
    refusals = []
    for call in (lambda: engine.backward(engine(x, y)), engine.step):
        try:
            call()
        except RuntimeError as exc:
            refusals.append(str(exc))
    full = sum(p.numel() * 4 for p in tiny_gpt().parameters())
    return want, got, optimizer, scheduler, memory, full, refusals, engine.get_lr()


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 3])
def test_no_optimizer_is_a_forward_only_engine(stage, tmp_path):
    """DeepSpeed's inference engine (Lightning's and Transformers' evaluation without training):
    no optimizer anywhere gives an engine that shards as its stage says, holds no gradients or
    masters, reads a training checkpoint's weights, and refuses backward and step."""
    for want, got, opt, sched, memory, full, refusals, lr in run_distributed(
        _forward_only, 2, args=(stage, str(tmp_path))
    ):
        assert got == want  # the trained weights, bit for bit
        assert opt is None and sched is None and lr == []
        assert memory == {
            "params": full // 2 if stage == 3 else full,
            "grads": 0,
            "master": 0,
            "scratch": 0,
            "optimizer": 0,
        }
        forward_only = "this engine runs forward only (initialize was given no optimizer and "
        assert refusals == [
            f"engine.backward(): {forward_only}the config has no optimizer block)",
            f"engine.step(): {forward_only}the config has no optimizer block)",
        ]


def test_scheduler_without_optimizer_is_an_error():
    config = {"train_batch_size": 2, "scheduler": {"type": "WarmupLR", "params": {}}}
    with pytest.raises(ConfigError, match="^scheduler: given without an optimizer"):
        zerostack.initialize(model=tiny_gpt(), config=config)


def test_foreign_parameter_is_an_error():
    stray = torch.nn.Parameter(torch.zeros(3, 5))
    with pytest.raises(ValueError, match=r"model_parameters\[0\]: a parameter of shape \(3, 5\)"):
        zerostack.initialize(
            model=tiny_gpt(),
            model_parameters=[stray],
            config={"train_batch_size": 2, "optimizer": OPT},
        )


def test_missing_model_is_an_error():
    with pytest.raises(ValueError, match="^model: "):
        zerostack.initialize(config={"train_batch_size": 2})


def _strategies(rank, world):
    from zerostack.zero.strategy import Pieces, WholeGrads, ZeroStrategy

    out = {}
    for stage in range(4):
        cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": OPT}
        cfg["zero_optimization"] = {"stage": stage}
        engine, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
        kinds = [isinstance(engine.zero, k) for k in (ZeroStrategy, WholeGrads, Pieces)]
        out[stage] = (*kinds, engine.zero.stage)
    return out


@pytest.mark.distributed
def test_every_stage_is_a_declared_strategy():
    """The engine holds each stage through the one interface zero/strategy.py declares, with
    its family's extras: flat buffers at stages 0-2, pieces at stage 3."""
    got = run_distributed(_strategies, 1)[0]
    assert got == {s: (True, s < 3, s == 3, s) for s in range(4)}


def _start_alike(rank, world, precision):
    from zerostack.utils import safe_get_full_fp32_param

    out = {}
    for stage in range(4):
        model = tiny_gpt(seed=rank)  # every rank draws different weights
        cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": OPT}
        cfg["zero_optimization"] = {"stage": stage, "stage3_param_persistence_threshold": 0}
        if precision:
            cfg[precision] = {"enabled": True}
        engine, *_ = zerostack.initialize(model=model, config=cfg)
        names = dict(engine.module.named_parameters())
        out[stage] = {n: safe_get_full_fp32_param(p).cpu() for n, p in names.items()}
        if stage < 3:  # whole parameters in the compute dtype
            out[stage]["compute"] = {n: p.detach().clone() for n, p in names.items()}
        engine.destroy()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("precision", [None, "bf16"])
def test_every_rank_starts_from_dp_rank_0s_weights(precision):
    """Ranks that drew different weights train one model, dp rank 0's, at every stage: its fp32
    values as masters, exactly, and cast as the parameters the forward uses."""
    ref = dict(tiny_gpt(seed=0).named_parameters())
    dtype = torch.bfloat16 if precision else torch.float32
    for got in run_distributed(_start_alike, 2, args=(precision,)):
        for stage, values in got.items():
            compute = values.pop("compute", {})
            assert values.keys() == ref.keys()
            for n, v in values.items():
                assert torch.equal(v, ref[n].detach()), (stage, n)
            for n, v in compute.items():
                assert torch.equal(v, ref[n].detach().to(dtype)), (stage, n)
