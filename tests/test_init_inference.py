"""``deepspeed.init_inference`` as DeepSpeed's tutorials call it (automatic tensor parallelism,
inference, MoE inference): a tiny Hugging Face Llama and GPT-2, alone and split over 2 tp ranks,
give the plain model's logits (1e-5 relative: the split sums a row-parallel product in two
halves) and its greedy tokens; the settings zerostack cannot honour are refused naming them."""

from __future__ import annotations

import logging

import pytest
import torch

import zerostack.compat.deepspeed as deepspeed

from tests.support.hf import hf_model, tokens
from tests.support.ranks import run_distributed


def _greedy(model, x):
    return model.generate(input_ids=x, max_new_tokens=4, do_sample=False, pad_token_id=0)


def test_one_rank_is_the_plain_model_in_the_dtype_asked(caplog):
    plain, x = hf_model("llama").eval(), tokens(0, 2)[:, :8]
    with caplog.at_level(logging.WARNING, logger="zerostack"):
        engine = deepspeed.init_inference(
            hf_model("llama"), dtype=torch.float, replace_with_kernel_inject=True
        )
    assert "replace_with_kernel_inject: zerostack has no fused inference kernels" in caplog.text
    with torch.no_grad():
        assert torch.equal(engine(input_ids=x).logits, plain(input_ids=x).logits)
    assert torch.equal(_greedy(engine, x), _greedy(plain, x))
    assert engine.config is engine.module.config  # what a pipeline reads of its model
    half = deepspeed.init_inference(hf_model("llama"), config={"dtype": "bf16"})
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in deepspeed.init_inference(hf_model("llama")).parameters()} == {
        torch.float16  # DeepSpeed's default dtype
    }


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"dtype": torch.int8}, ValueError, "dtype int8: zerostack has no quantized inference"),
        ({"checkpoint": "ckpt.json"}, ValueError, "'checkpoint' is not supported"),
        ({"config": {"dtype": "fp16"}, "dtype": "bf16"}, ValueError, "Conflicting argument"),
        ({"injection_policy": {"LlamaDecoderLayer": ("mlp.down_proj",)}}, ValueError, "no module"),
        ({"tensor_parallel": {"tp_size": 2, "tp_group": object()}}, ValueError, "tp_group"),
    ],
)
def test_what_cannot_be_honoured_is_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        deepspeed.init_inference(hf_model("llama"), **kwargs)


def test_generate_keeps_deepspeeds_limits():
    engine = deepspeed.init_inference(hf_model("llama"), dtype=torch.float, max_tokens=4)
    x = tokens(0, 1)[:, :6]
    with pytest.raises(RuntimeError, match="exceeds maximum length of 4"):
        engine.generate(input_ids=x, max_new_tokens=2)
    with pytest.raises(NotImplementedError, match="num_beams"):
        engine.generate(input_ids=x[:, :3], num_beams=2)


def _split(rank, world, arch, how):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    settings = {
        "tp": {"tensor_parallel": {"tp_size": world}},
        "mp_size": {"mp_size": world},
        "policy": {
            "tensor_parallel": {"tp_size": world},
            "injection_policy": {LlamaDecoderLayer: ("self_attn.o_proj", "mlp.down_proj")},
        },
        "wrong": {
            "tensor_parallel": {"tp_size": world},
            "injection_policy": {LlamaDecoderLayer: ("self_attn.q_proj",)},
        },
    }[how]
    try:
        engine = deepspeed.init_inference(hf_model(arch), dtype=torch.float, **settings)
    except ValueError as exc:
        return str(exc)
    x = tokens(1, 2)[:, :8]
    with torch.no_grad():
        logits = engine(input_ids=x).logits
    shapes = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
    return logits, _greedy(engine, x), shapes


@pytest.mark.distributed
@pytest.mark.parametrize("arch, how", [("llama", "tp"), ("gpt2", "mp_size"), ("llama", "policy")])
def test_two_tp_ranks_give_the_plain_models_logits_and_tokens(arch, how):
    plain, x = hf_model(arch).eval(), tokens(1, 2)[:, :8]
    with torch.no_grad():
        want = plain(input_ids=x).logits
    out = run_distributed(_split, 2, (arch, how))
    for logits, greedy, shapes in out:
        assert (logits - want).abs().max() <= 1e-5 * want.abs().max()
        assert torch.equal(greedy, _greedy(plain, x))
        # the rank holds half of each split layer
        whole = dict(plain.named_parameters())
        halved = [n for n, s in shapes.items() if s != tuple(whole[n].shape)]
        assert halved and all(
            torch.Size(s).numel() * 2 == whole[n].numel() for n, s in shapes.items() if n in halved
        )


@pytest.mark.distributed
def test_an_injection_policy_that_is_not_the_cut_is_refused():
    out = run_distributed(_split, 2, ("llama", "wrong"))
    assert out == [
        "init_inference: injection_policy names 'self_attn.q_proj' row-parallel; zerostack's "
        "cut of llama all-reduces after self_attn.o_proj, mlp.down_proj"
    ] * 2
