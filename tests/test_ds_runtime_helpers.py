"""``deepspeed.runtime.utils`` and ``deepspeed.runtime.dataloader`` as DeepSpeed's tutorials and
ALST scripts import them, served by zerostack: each behaves as DeepSpeed 0.19.8's does (read
from its source: runtime/utils.py, runtime/dataloader.py)."""

from __future__ import annotations

import pytest
import torch

from zerostack.compat.deepspeed.runtime.dataloader import RepeatingLoader
from zerostack.compat.deepspeed.runtime.utils import move_to_device, see_memory_usage


def test_move_to_device_walks_lists_tuples_and_dicts():
    ids = torch.ones(2, 3, dtype=torch.long)
    batch = {"input_ids": ids, "pair": (torch.zeros(1), [torch.ones(1)])}
    moved = move_to_device(batch, torch.device("meta"))
    assert moved["input_ids"].device.type == "meta" and moved["input_ids"].dtype == torch.long
    assert isinstance(moved["pair"], tuple) and isinstance(moved["pair"][1], list)
    assert moved["pair"][0].device.type == "meta" and moved["pair"][1][0].device.type == "meta"
    assert batch["input_ids"].device.type == "cpu"  # new tensors; the caller's stay
    assert move_to_device({"n": 3, "s": "x"}, "cpu") == {"n": 3, "s": "x"}


def test_move_to_device_moves_in_place_what_the_criterion_accepts():
    t = torch.arange(3.0)
    out = move_to_device(t, torch.float64, criterion_func=lambda x: isinstance(x, torch.Tensor))
    assert out is t and t.dtype == torch.float64  # its .data replaced, as DeepSpeed's


def test_see_memory_usage_prints_only_when_forced(capsys):
    see_memory_usage("before")
    assert capsys.readouterr().out == ""
    see_memory_usage("after the step", force=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "after the step"
    assert lines[-1].startswith("CPU Virtual Memory:  used = ") and " GB, percent = " in lines[-1]


def test_repeating_loader_starts_again_when_the_loader_ends():
    loader = torch.utils.data.DataLoader(list(range(5)), batch_size=2)
    it = RepeatingLoader(loader)
    assert iter(it) is it
    got = [next(it).tolist() for _ in range(5)]
    assert got == [[0, 1], [2, 3], [4], [0, 1], [2, 3]]


# --- the engine accessors DeepSpeed's users read (scripts/census/deepspeed_census.json) ---------


def _accessors(rank, world):
    import zerostack.compat.deepspeed as deepspeed

    from tests.support.models import batch, tiny_gpt

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = deepspeed.initialize(model=tiny_gpt(), config=cfg)
    overflow = [engine.optimizer.overflow]
    for step, scale in enumerate([1.0, float("nan"), 1.0]):  # the second step is skipped
        x, y = batch(step, 2 * world)
        loss = engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]) * scale
        engine.backward(loss)
        engine.step()
        overflow.append(engine.optimizer.overflow)
    full = engine._consolidated_16bit_state_dict()
    out = {
        "dp_rank": engine.get_data_parallel_rank(),
        "dp_group_size": torch.distributed.get_world_size(engine.data_parallel_group),
        "sp_group": engine.get_sequence_parallel_group(),
        "tp": (engine.mp_world_size, engine.get_tensor_parallel_rank()),
        "mom": engine.get_mom(),
        "clip": engine.gradient_clipping(),
        "optimizer_name": engine.optimizer_name(),
        "offload": (engine.zero_offload_optimizer(), engine.zero_offload_param()),
        "overflow": overflow,
        "full": None if full is None else {k: tuple(v.shape) for k, v in full.items()},
        "shapes": {k: tuple(p.ds_shape) for k, p in engine.module.named_parameters()},
    }
    return out


@pytest.mark.distributed
def test_engine_accessors_answer_as_deepspeeds():
    from tests.support.ranks import run_distributed

    for rank, out in enumerate(run_distributed(_accessors, 2)):
        assert out["dp_rank"] == rank and out["dp_group_size"] == 2
        assert out["sp_group"] is None and out["tp"] == (1, 0)
        assert out["mom"] == [0.9] and out["clip"] == 0.5 and out["optimizer_name"] == "sgd"
        assert out["offload"] == (None, None)
        assert out["overflow"] == [False, False, True, False]
        if rank == 0:  # the whole weights on rank 0, None elsewhere
            assert out["full"] is not None
            assert {k: out["full"][k] for k in out["shapes"]} == out["shapes"]
        else:
            assert out["full"] is None


def _from_args(rank, world, path):
    import argparse

    import zerostack.compat.deepspeed as deepspeed

    from tests.support.models import tiny_gpt

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepscale", "--deepscale_config", path])
    engine, *_ = deepspeed.initialize(args=args, model=tiny_gpt())
    return engine.train_micro_batch_size_per_gpu()


@pytest.mark.distributed
def test_add_config_arguments_and_initialize_reading_them(tmp_path):
    import argparse
    import json

    import zerostack.compat.deepspeed as deepspeed

    from tests.support.ranks import run_distributed

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert (args.deepspeed, args.deepspeed_config, args.deepscale, args.deepscale_config) == (
        True,
        "ds.json",
        False,
        None,
    )
    assert parser.parse_args([]).deepspeed is False
    path = tmp_path / "ds.json"  # the deprecated spelling still names the config, as DeepSpeed's
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3}))
    assert run_distributed(_from_args, 1, args=(str(path),)) == [3]


# --- the rest of the census's names: config, monitor, groups, seeds, the engine's fallbacks ---


def _scales(rank, world):
    import zerostack.compat.deepspeed as deepspeed

    from tests.support.models import batch, tiny_gpt

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "fp16": {
            "enabled": True,
            "initial_scale_power": 4,
            "loss_scale_window": 100,
            "hysteresis": 1,
        },
    }
    engine, *_ = deepspeed.initialize(model=tiny_gpt(), config=cfg)
    scales = [engine.optimizer.cur_scale]
    for step, factor in enumerate([1.0, float("inf")]):  # the second overflows: scale halves
        x, y = batch(step, 2 * world)
        engine.backward(engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]) * factor)
        engine.step()
        scales.append(engine.optimizer.cur_scale)
    return scales


@pytest.mark.distributed
def test_the_optimizers_cur_scale_is_the_loss_scale_now():
    """DeepSpeed's Megatron tutorial logs ``optimizer.cur_scale``."""
    from tests.support.ranks import run_distributed

    assert run_distributed(_scales, 2) == [[16.0, 16.0, 8.0]] * 2


def test_deepspeed_config_resolves_the_batch_as_initialize_does():
    from zerostack.compat.deepspeed.runtime.config import LAMB_OPTIMIZER, DeepSpeedConfig

    cfg = DeepSpeedConfig(
        {
            "train_batch_size": 12,
            "gradient_accumulation_steps": 3,
            "optimizer": {"type": "adamw", "params": {"lr": 3e-4}},
            "zero_optimization": {"stage": 2},
            "bf16": {"enabled": True},
            "not_a_deepspeed_key": 1,  # ignored with a warning, as deepspeed.initialize does
        }
    )
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (12, 4)
    assert cfg.gradient_accumulation_steps == 3 and LAMB_OPTIMIZER == "lamb"
    assert (cfg.zero_enabled, cfg.zero_optimization_stage) == (True, 2)
    assert (cfg.fp16_enabled, cfg.bfloat16_enabled) == (False, True)
    assert cfg.optimizer_name == "adamw" and cfg.optimizer_params["lr"] == 3e-4
    assert cfg.scheduler_name is None and cfg.typed.ignored_keys == ("not_a_deepspeed_key",)

    class Mpu:  # an mpu's data-parallel size decides, as in DeepSpeed
        def get_data_parallel_world_size(self):
            return 3

    on_three = DeepSpeedConfig({"train_batch_size": 12, "gradient_accumulation_steps": 2}, Mpu())
    assert on_three.train_micro_batch_size_per_gpu == 2


def test_monitor_master_writes_a_scripts_events_where_the_config_says(tmp_path):
    """DeepSpeed's monitor tutorial: MonitorMaster(DeepSpeedConfig(...).monitor_config)."""
    from zerostack.compat.deepspeed.monitor.monitor import MonitorMaster
    from zerostack.compat.deepspeed.runtime.config import DeepSpeedConfig

    csv = {"enabled": True, "output_path": str(tmp_path), "job_name": "cifar"}
    monitor = MonitorMaster(
        DeepSpeedConfig({"train_batch_size": 4, "csv_monitor": csv}).monitor_config
    )
    monitor.write_events([("Train/Samples/loss", 2.5, 8), ("Train/Samples/loss", 2.0, 16)])
    monitor.close()
    rows = (tmp_path / "cifar" / "Train_Samples_loss.csv").read_text().splitlines()
    assert rows[1:] == ["8,2.5", "16,2.0"]
    assert not MonitorMaster(DeepSpeedConfig({"train_batch_size": 4}).monitor_config).enabled


def test_groups_initialize_is_deprecated_and_does_nothing():
    from zerostack.compat.deepspeed.utils import groups

    assert groups.initialize(ep_size=2) is None
    import pytest

    with pytest.raises(ValueError, match="ep_size must be an integer >= 1, got 0"):
        groups.initialize(ep_size=0)


def test_set_random_seed_seeds_python_numpy_and_torch():
    import random

    import numpy

    from zerostack.compat.deepspeed.runtime.utils import set_random_seed

    def draw():
        return random.random(), float(numpy.random.rand()), float(torch.rand(()))

    set_random_seed(2**40 + 7)  # above numpy's 32 bits: reduced, as DeepSpeed does
    first = draw()
    set_random_seed(2**40 + 7)
    assert draw() == first


def _through(rank, world):
    import zerostack.compat.deepspeed as deepspeed

    from tests.support.models import tiny_gpt

    model = tiny_gpt()
    model.describe = lambda: "the module's own method"
    engine, *_ = deepspeed.initialize(model=model, config={"train_batch_size": 2 * world})
    try:
        _ = engine.no_such_thing
    except AttributeError as e:
        missing = str(e)
    return engine.describe(), engine.cfg is model.cfg, engine.train_batch_size(), missing


@pytest.mark.distributed
def test_what_the_engine_lacks_is_its_modules():
    """DeepSpeed's engine hands unknown attributes to its module (DeepSpeed-Chat calls
    ``engine.gradient_checkpointing_enable()``); its own come first."""
    from tests.support.ranks import run_distributed

    for said, same, tbs, missing in run_distributed(_through, 2):
        assert said == "the module's own method" and same and tbs == 4
        assert (
            missing
            == "'DeepSpeedEngine' object has no attribute 'no_such_thing', nor has its module"
        )


def test_deepspeed_version_is_a_version():
    from packaging.version import Version

    import zerostack.compat.deepspeed as deepspeed

    assert Version(deepspeed.version) >= Version("0.19.8")


def test_recursive_getattr_and_setattr_reach_a_submodule_by_its_dotted_name():
    """DeepSpeed-Chat's LoRA conversion reads and replaces a model's linear layers by name
    (imported from the deprecated deepspeed.compression.helper, which warns)."""
    import importlib
    import sys

    sys.modules.pop("zerostack.compat.deepspeed.compression.helper", None)
    with pytest.warns(FutureWarning, match="deepspeed.utils.module_utils"):
        helper = importlib.import_module("zerostack.compat.deepspeed.compression.helper")
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.ReLU())
    assert helper.recursive_getattr(model, "0.0.weight") is model[0][0].weight
    new = torch.nn.Linear(2, 3)
    helper.recursive_setattr(model, "0.0", new)
    assert model[0][0] is new and helper.recursive_getattr(model, "1") is model[1]
    helper.recursive_setattr(model, "1", torch.nn.Tanh())
    assert isinstance(model[1], torch.nn.Tanh)
    with pytest.raises(AttributeError):
        helper.recursive_getattr(model, "0.2")
