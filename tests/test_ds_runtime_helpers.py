"""``deepspeed.runtime.utils`` and ``deepspeed.runtime.dataloader`` as DeepSpeed's tutorials and
ALST scripts import them, served by zerostack: each behaves as DeepSpeed 0.19.8's does (read
from its source: runtime/utils.py, runtime/dataloader.py)."""

from __future__ import annotations

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
    from common import batch, tiny_gpt

    import zerostack.compat.deepspeed as deepspeed

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


def test_engine_accessors_answer_as_deepspeeds():
    from distributed import run_distributed

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

    from common import tiny_gpt

    import zerostack.compat.deepspeed as deepspeed

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepscale", "--deepscale_config", path])
    engine, *_ = deepspeed.initialize(args=args, model=tiny_gpt())
    return engine.train_micro_batch_size_per_gpu()


def test_add_config_arguments_and_initialize_reading_them(tmp_path):
    import argparse
    import json

    from distributed import run_distributed

    import zerostack.compat.deepspeed as deepspeed

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert (args.deepspeed, args.deepspeed_config, args.deepscale, args.deepscale_config) == (
        True, "ds.json", False, None,
    )
    assert parser.parse_args([]).deepspeed is False
    path = tmp_path / "ds.json"  # the deprecated spelling still names the config, as DeepSpeed's
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3}))
    assert run_distributed(_from_args, 1, args=(str(path),)) == [3]
