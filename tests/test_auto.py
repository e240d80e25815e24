"""``"auto"`` resolved at ``initialize``: the lowest ZeRO stage that fits, the largest
micro-batch that fits, logged; "auto" batch keys keep DeepSpeed's "not given" when the model
cannot be described."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import zerostack
from zerostack.config import ConfigError, load_config
from zerostack.estimate import Layout, count_parameters, model_states
from zerostack.plan.auto import _bytes, describe_module, resolve

from tests.support.models import TINY, tiny_gpt
from tests.support.ranks import run_distributed

TOPO = SimpleNamespace(dp=4, tp=1, pp=1, ep=1, world_size=4, device=torch.device("cpu"))


def _cfg(**extra):
    return load_config({"train_batch_size": 32, "zero_optimization": {"stage": "auto"}, **extra})


def test_the_lowest_stage_that_fits():
    """With room for every stage, stage 0; with room for stage 3 but not stage 2, stage 3 (the
    bytes: the model states of each stage plus the same activations); with room for none, the
    error names what stage 3 needs."""
    model, desc = tiny_gpt(), describe_module(tiny_gpt())
    trained, _, _ = count_parameters(model)
    assert resolve(_cfg(), model, TOPO, memory_bytes=1e12).zero_optimization.stage == 0
    b3 = _bytes(count_parameters(model), desc, _cfg(), TOPO, 3, 1, 1)
    b2 = _bytes(count_parameters(model), desc, _cfg(), TOPO, 2, 1, 1)
    states = {s: model_states(trained, Layout(dp=4, stage=s)).device for s in (2, 3)}
    assert b2 - b3 == states[2] - states[3] > 0
    budget = (b3 + (b2 - b3) / 2) / 0.9
    assert resolve(_cfg(), model, TOPO, memory_bytes=budget).zero_optimization.stage == 3
    with pytest.raises(ConfigError, match="zero_optimization.stage: auto finds no stage"):
        resolve(_cfg(), model, TOPO, memory_bytes=1000)
    # under a pipeline and with expert parallelism every stage is a choice alike
    for grid in ({"pp": 2, "dp": 2}, {"ep": 2, "dp": 2}):
        topo = SimpleNamespace(**{**vars(TOPO), **grid})
        need = {s: _bytes(count_parameters(model), desc, _cfg(), topo, s, 1, 1) for s in (2, 3)}
        between = (need[3] + (need[2] - need[3]) / 2) / 0.9
        assert resolve(_cfg(), model, topo, memory_bytes=between).zero_optimization.stage == 3
        roomy = need[2] / 0.9 + 1
        assert resolve(_cfg(), model, topo, memory_bytes=roomy).zero_optimization.stage == 2


def test_offload_narrows_the_stages():
    cfg = _cfg(zero_optimization={"stage": "auto", "offload_optimizer": {"device": "cpu"}})
    assert resolve(cfg, tiny_gpt(), TOPO, memory_bytes=1e12).zero_optimization.stage == 1
    cfg = _cfg(zero_optimization={"stage": "auto", "offload_param": {"device": "cpu"}})
    assert resolve(cfg, tiny_gpt(), TOPO, memory_bytes=1e12).zero_optimization.stage == 3


def test_the_largest_micro_batch_that_fits():
    """32 sequences over dp 4: 8 per rank; the budget admits activations of 2 sequences."""
    model = tiny_gpt()
    cfg = load_config(
        {
            "train_batch_size": 32,
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
        }
    )
    assert cfg.planned_batch == {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}
    roomy = resolve(cfg, model, TOPO, memory_bytes=1e12)
    assert roomy.resolve_batch(4) == (32, 8, 1)
    two = _bytes(count_parameters(model), describe_module(model), cfg, TOPO, 0, 2, 4)
    three_or_more = _bytes(count_parameters(model), describe_module(model), cfg, TOPO, 0, 4, 2)
    tight = resolve(cfg, model, TOPO, memory_bytes=(two + three_or_more) / 2 / 0.9)
    assert tight.resolve_batch(4) == (32, 2, 4)
    assert tight.zero_optimization.stage == 0  # not "auto": left as given


def test_auto_batch_means_not_given_for_a_model_it_cannot_describe():
    cfg = load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto"})
    plain = torch.nn.Linear(4, 4)
    assert describe_module(plain) is None
    assert resolve(cfg, plain, TOPO, memory_bytes=1e12).resolve_batch(4) == (32, 8, 1)
    assert describe_module(tiny_gpt()).params == TINY.num_params


def _initialize(rank, world, caplog_level):
    logging.getLogger("zerostack").setLevel(caplog_level)
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("zerostack").addHandler(handler)
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": "auto"},
    }
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=config)
    return (
        engine.config.zero_optimization.stage,
        engine.train_micro_batch_size_per_gpu(),
        engine.gradient_accumulation_steps(),
        records,
    )


@pytest.mark.distributed
def test_initialize_resolves_and_logs():
    stage, micro, gas, records = run_distributed(_initialize, 2, args=(logging.INFO,))[0]
    assert (stage, micro, gas) == (0, 4, 1)  # a tiny model on a roomy host
    assert any(r.startswith("zero_optimization.stage: auto -> 0 (") for r in records), records
    assert (
        "train_micro_batch_size_per_gpu: auto -> 4, gradient_accumulation_steps: auto -> 1"
        in records
    )


@pytest.mark.parametrize(
    "optimizer, kept",
    [
        ({"type": "SGD", "params": {"lr": 0.1}}, "sgd"),
        ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, "momentum"),
        ({"type": "Lion"}, "lion"),
        ({"type": "Adagrad"}, "adagrad"),
        ({"type": "AdamW"}, "adamw"),
    ],
)
def test_the_optimizer_state_counted_is_the_configs(optimizer, kept):
    """The automatic stage counts what the configured optimizer keeps per parameter: SGD a
    momentum buffer only with momentum, Lion and Adagrad one fp32 tensor, Adam two."""
    from zerostack.plan.auto import _layout

    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": optimizer})
    assert _layout(cfg, SimpleNamespace(dp=2), 2).optimizer == kept
