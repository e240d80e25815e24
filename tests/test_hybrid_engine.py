"""DeepSpeed-Chat's ``hybrid_engine`` at ZeRO-3 on 2 gloo ranks: the actor's
``engine.module.generate`` (as DeepSpeed-Chat's PPO trainer calls it) gives the plain model's
greedy tokens, with the model gathered once for the whole generation instead of module by
module at every token (the CommLog's all-gathers counted); then it trains on."""

from __future__ import annotations

import pytest
import torch

from zerostack import ConfigError, load_config

from tests.support.hf import hf_model, tokens
from tests.support.ranks import run_distributed


def _config(enabled: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "hybrid_engine": {"enabled": enabled, "max_out_tokens": 512, "inference_tp_size": 1},
    }


def _generate(rank, world):
    import zerostack.compat.deepspeed as deepspeed

    out = {}
    for enabled in (False, True):
        engine, *_ = deepspeed.initialize(model=hf_model("llama"), config=_config(enabled))
        engine.eval()
        log = engine.comm.log
        first = len(log.records)
        with torch.no_grad():
            seq = engine.module.generate(
                input_ids=tokens(0, 2)[:, :6], max_new_tokens=5, do_sample=False, pad_token_id=0
            )
        gathers = sum(r.op == "all_gather" for r in log.records[first:])
        engine.train()
        x = tokens(1, 2)[rank : rank + 1]
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        out[enabled] = (seq, gathers, engine.global_steps)
        engine.destroy()
    return out


@pytest.mark.distributed
def test_generate_gathers_the_model_once_and_gives_the_plain_models_tokens():
    plain = hf_model("llama").eval()
    want = plain.generate(
        input_ids=tokens(0, 2)[:, :6], max_new_tokens=5, do_sample=False, pad_token_id=0
    )
    modules = sum(1 for m in plain.modules() if list(m.parameters(recurse=False)))
    for out in run_distributed(_generate, 2):
        (per_module, hooks, steps), (seq, once, trained) = out[False], out[True]
        assert torch.equal(per_module, want) and torch.equal(seq, want)
        assert hooks >= 5 * modules  # without: every module's at every token
        assert 0 < once <= 2  # with: the whole model before the first token
        assert steps == trained == 1


def test_generation_tensor_parallelism_is_refused():
    cfg = _config(True)
    cfg["hybrid_engine"]["inference_tp_size"] = 2
    with pytest.raises(ConfigError, match="inference_tp_size: splits the model for generation"):
        load_config(cfg)
