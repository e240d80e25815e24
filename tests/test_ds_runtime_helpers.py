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
