"""Tiny Hugging Face causal LMs (GPT-2, Llama; built from a config, nothing downloaded) and their
single-process reference training, shared by test_hf.py and the example's test."""

from __future__ import annotations

import functools
import logging

import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from tests.support.parity import global_norm

logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB, SEQ = 64, 16
CONFIGS = {
    # 4 heads and a 64-wide MLP so tp = 2 splits both; no dropout, so ranks and reference agree
    "gpt2": dict(
        cls=GPT2Config,
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "llama": dict(
        cls=LlamaConfig,
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    ),
}
STEPS, B, GAS = 3, 8, 2  # B sequences per micro-step window over all dp ranks
SGD_LR = 0.5  # plain SGD: a wrong factor in the gradient moves the weights by that factor


def hf_config(arch: str):
    kwargs = dict(CONFIGS[arch])
    return kwargs.pop("cls")(**kwargs)


def hf_model(arch: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_config(arch))


def tokens(step: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g)


@functools.cache
def reference(arch: str):
    """Single-process fp32 training on each whole global batch: per step (weights, grad norm)."""
    model = hf_model(arch)
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    out = []
    for step in range(STEPS):
        x = tokens(step, B * GAS)
        model(input_ids=x, labels=x).loss.backward()
        norm = global_norm([p.grad for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(({k: v.detach().clone() for k, v in model.named_parameters()}, norm))
    return out
