"""DeepSpeed's ``deepspeed.module_inject.layers.GatherReplacedLayerParams`` as OpenRLHF calls it
to send weights to vLLM under AutoTP: on 2 tp ranks, inside the context each split parameter
of a Hugging Face Llama holds the unsplit model's whole value, bit for bit; on leaving, each rank
its slice again, of what was written inside."""

from __future__ import annotations

import pytest
import torch

from tests.support.hf import hf_model
from tests.support.ranks import run_distributed

pytestmark = pytest.mark.distributed  # every test here starts ranks


def _whole(rank, world):
    import zerostack.compat.deepspeed as deepspeed
    from zerostack.compat.deepspeed.module_inject.layers import GatherReplacedLayerParams

    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": world},
    }
    engine, *_ = deepspeed.initialize(model=hf_model("llama"), config=cfg)
    model = engine.module
    named = dict(model.named_parameters())
    sliced = {n: p.data.clone() for n, p in named.items()}
    out = {"inside": {}}
    for name, p in named.items():  # one at a time, as OpenRLHF syncs them
        with GatherReplacedLayerParams([p], model, enabled=True):
            out["inside"][name] = p.data.clone()
    with GatherReplacedLayerParams(named["model.layers.0.mlp.down_proj.weight"], model):
        named["model.layers.0.mlp.down_proj.weight"].data.fill_(0.5)
    with GatherReplacedLayerParams(list(named.values()), model, enabled=False):
        out["disabled"] = {n: tuple(p.shape) for n, p in named.items()}
    out["after"] = {n: torch.equal(p.data, sliced[n]) for n, p in named.items()}
    out["written"] = named["model.layers.0.mlp.down_proj.weight"].data.clone()
    out["sliced"] = {n: tuple(t.shape) for n, t in sliced.items()}
    return out


def test_split_parameters_are_whole_inside_and_sliced_after():
    plain = dict(hf_model("llama").named_parameters())
    for out in run_distributed(_whole, 2):
        assert out["inside"].keys() == plain.keys()
        for name, p in plain.items():
            assert torch.equal(out["inside"][name], p.detach()), name
        halved = [n for n, s in out["sliced"].items() if s != tuple(plain[n].shape)]
        assert len(halved) == 2 * 7  # q, k, v, o, gate, up, down in each of the 2 layers
        assert out["disabled"] == out["sliced"]
        assert out["after"] == {n: n != "model.layers.0.mlp.down_proj.weight" for n in plain}
        assert torch.equal(out["written"], torch.full_like(out["written"], 0.5))
