"""``torch_autocast``: the engine's forward under ``torch.autocast``, with DeepSpeed 0.19.8's
losses (tests/golden/torch_autocast.json, scripts/torch_autocast_golden.py), and the
combinations zerostack does not serve refused naming why.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from zerostack.config import ConfigError

from tests.support.ranks import run_distributed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
import torch_autocast_golden as golden  # noqa: E402

GOLDEN = json.load(open(os.path.join(os.path.dirname(__file__), "golden", "torch_autocast.json")))


def _run(rank, world, name, native):
    import zerostack
    import zerostack.compat.deepspeed as deepspeed

    init = zerostack.initialize if native else deepspeed.initialize
    engine, *_ = init(model=golden.model(), config=golden.config(name))
    return golden.train(engine)


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(golden.CASES))
def test_losses_equal_deepspeeds(name):
    """The bf16 block at ZeRO-3 (AdamW, DeepSpeedExamples' bf16_master_weight config with
    autocast) and ZeRO-1 (SGD), fp32 weights at stage 0 (SGD), and the first without autocast:
    DeepSpeed's loss at every step (layer norm, softmax and the loss in fp32 under autocast,
    bf16 without)."""
    (got,) = run_distributed(_run, world=1, args=(name, False))
    assert got == pytest.approx(GOLDEN["cases"][name], rel=1e-5, abs=0)


@pytest.mark.distributed
def test_native_initialize_serves_it_too():
    (got,) = run_distributed(_run, world=1, args=("fp32_zero0_sgd", True))
    assert got == pytest.approx(GOLDEN["cases"]["fp32_zero0_sgd"], rel=1e-5, abs=0)


def test_an_enclosing_autocast_is_overridden_by_the_config():
    """As DeepSpeed's engine: its autocast (bf16) replaces an enclosing one (here disabled)."""
    from zerostack.config.load import load_config
    from zerostack.core.precision import forward_autocast

    cfg = load_config({"train_batch_size": 1, "torch_autocast": {"enabled": True}})
    with torch.autocast("cpu", enabled=False), forward_autocast(cfg, torch.device("cpu")):
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.bfloat16
    off = load_config({"train_batch_size": 1})
    with forward_autocast(off, torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu")


def _refused(rank, world, update):
    import zerostack.compat.deepspeed as deepspeed

    cfg = golden.config("fp32_zero0_sgd")
    for key, value in update.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    try:
        deepspeed.initialize(model=golden.model(), config=cfg)
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.distributed
@pytest.mark.parametrize(
    "update, message",
    [
        ({"torch_autocast": {"dtype": "fp16"}},
         "torch_autocast.dtype fp16: DeepSpeed scales the loss with torch's GradScaler"),
        ({"fp16": {"enabled": True}}, "torch_autocast.dtype bf16 with fp16.enabled"),
        ({"zero_optimization": {"stage": 2}},
         "torch_autocast with fp32 weights at zero_optimization.stage 2: DeepSpeed reduces"),
        ({"communication_data_type": "fp32"}, "torch_autocast with communication_data_type"),
        ({"torch_autocast": {"lower_precision_safe_modules": ["torch.nn.Linea"]}},
         "torch_autocast.lower_precision_safe_modules: cannot import 'torch.nn.Linea'"),
    ],
)  # fmt: skip
def test_combinations_not_served_are_refused(update, message):
    (got,) = run_distributed(_refused, world=1, args=(update,))
    assert got is not None and got.startswith(message)
