"""DeepSpeed's OneCycle and LRRangeTest: each group's lr and betas step by step equal DeepSpeed
0.19.8's own classes' (tests/golden/lr_schedules.json, scripts/lr_schedules_golden.py), as
classes and as the config's ``scheduler`` driven by the engine."""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch

from zerostack.config import ConfigError
from zerostack.config.load import load_config
from zerostack.optim.lr_schedules import SCHEDULERS

from tests.support.ranks import run_distributed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
import lr_schedules_golden as golden  # noqa: E402

GOLDEN = json.load(open(os.path.join(os.path.dirname(__file__), "golden", "lr_schedules.json")))


@pytest.mark.parametrize("name", sorted(golden.CASES))
def test_lrs_and_betas_equal_deepspeeds_bit_for_bit(name):
    """The cycle up and down (in stairs too), the decay of lr and first beta after it, per-group
    bounds, an optimizer without betas (momentum off, with a warning), the range test
    continuous and in stairs: DeepSpeed's floats, exactly."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert golden.trace(SCHEDULERS, name) == GOLDEN["cases"][name]


def test_a_state_dict_resumes_the_cycle():
    """A schedule loaded from a state dict after 9 steps writes step 9's lr and betas, and goes
    on as the uninterrupted one."""
    kind, opt_kind, params = golden.CASES["onecycle_adamw_decay"]
    opt = golden.optimizer(opt_kind)
    sched = SCHEDULERS[kind](opt, **params)
    for _ in range(9):
        sched.step()
    fresh_opt = golden.optimizer(opt_kind)
    fresh = SCHEDULERS[kind](fresh_opt, **params)
    fresh.load_state_dict(sched.state_dict())
    want = GOLDEN["cases"]["onecycle_adamw_decay"]
    assert [[g["lr"], list(g["betas"])] for g in fresh_opt.param_groups] == want[9]
    fresh.step()
    assert [[g["lr"], list(g["betas"])] for g in fresh_opt.param_groups] == want[10]


def _engine(rank, world):
    import zerostack.compat.deepspeed as deepspeed

    _, _, params = golden.CASES["onecycle_adamw_decay"]
    cfg = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.5}},
           "scheduler": {"type": "OneCycle", "params": params}}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=torch.nn.Linear(2, 1), config=cfg)
    seen = []
    for _ in range(golden.STEPS):
        engine.backward(engine(torch.ones(1, 2)).sum())
        engine.step()
        group = engine.optimizer.param_groups[0]
        seen.append([group["lr"], list(group["betas"])])
    return seen


@pytest.mark.distributed
def test_the_configs_scheduler_steps_with_the_engine():
    """``scheduler: {type: OneCycle}`` in the config: after each engine step the optimizer's
    lr and betas are DeepSpeed's."""
    (seen,) = run_distributed(_engine, world=1)
    assert seen == [step[0] for step in GOLDEN["cases"]["onecycle_adamw_decay"][1:]]


def test_config_checks_name_the_key():
    with pytest.raises(ConfigError, match="scheduler.params.cycle_max_lr: required key is missing"):
        load_config({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}})
    with pytest.raises(ConfigError, match="scheduler.params.lr_range_test_step_size"):
        load_config({"scheduler": {"type": "LRRangeTest",
                                   "params": {"lr_range_test_step_size": 0}}})  # fmt: skip
