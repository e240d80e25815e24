"""Expert parallelism inside a Hugging Face MoE block (issue 53): the block's experts module
replaced by its ep rank's share (zerostack.moe.hf_experts.expert_parallel), the model's own
router and shared experts untouched, on 2 and 4 gloo ranks each holding a part of the batch.
The outputs are the whole block's on the whole batch, bit for bit; the experts' gradients are
its gradients for the experts each rank holds; the rest sum to its gradients over the ranks.
A routing that sends every token to one rank's experts leaves the others with no rows, and
every rank still takes part in each exchange."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds3
from transformers.models.gpt_oss import modeling_gpt_oss as oss
from transformers.models.mixtral import modeling_mixtral as mixtral

from zerostack.comm import functional as cf
from zerostack.moe.hf_experts import expert_parallel

from tests.support.ranks import run_distributed

H, F, E, K = 32, 24, 8, 2  # each rank: a batch of 2 sequences of 6 tokens
SMALL = {"hidden_size": H, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8}


def _block(name: str, skew: bool):
    if name == "mixtral":
        config = transformers.MixtralConfig(
            **SMALL, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K
        )
        block = mixtral.MixtralSparseMoeBlock(config)
    elif name == "deepseek_v3":  # sigmoid routing in groups, a correction bias, shared experts
        config = transformers.DeepseekV3Config(
            **SMALL, moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=K,
            n_group=2, topk_group=1, n_shared_experts=1,
        )  # fmt: skip
        block = ds3.DeepseekV3MoE(config)
    else:  # GPT-OSS: a router bias, interleaved gate/up with biases, clamped activation
        config = transformers.GptOssConfig(
            **SMALL, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K
        )
        block = oss.GptOssMLP(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.2)
        for b in block.buffers():
            b.normal_()
        if skew:  # every token's top k: experts 0 and 1 (rank 0's at ep 2 and 4)
            router = block.router if name == "gpt_oss" else block.gate
            router.weight[:K].zero_()
            router.weight[:K, 0] = 50.0
    x = torch.randn(2 * 8, 6, H)  # batches of 2 for up to 8 ranks
    x[..., 0] = x[..., 0].abs() + 1.0  # so the skewed rows all favour experts 0 and 1
    grad = torch.randn(2 * 8, 6, H)
    return block, x, grad


def _output(y):
    return y[0] if isinstance(y, tuple) else y


def _reference(name, world, skew):
    block, x, grad = _block(name, skew)
    x = x[: 2 * world].requires_grad_(True)
    y = _output(block(x))
    (y * grad[: 2 * world]).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


def _ranks(rank, world, name, skew):
    block, x, grad = _block(name, skew)
    whole = copy.deepcopy(block)
    part = block.experts
    block.experts = expert_parallel(part, cf.on_group(dist.group.WORLD, "ep"))
    mine = slice(2 * rank, 2 * rank + 2)
    x = x[mine].requires_grad_(True)
    y = _output(block(x))
    (y * grad[mine]).sum().backward()
    grads = {}
    for n, p in block.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if not n.startswith("experts."):
            dist.all_reduce(g)  # the replicated parameters: summed over the ranks
        grads[n] = g
    shapes = {n: tuple(p.shape) for n, p in whole.named_parameters()}
    return y.detach(), x.grad, grads, shapes, block.experts.num_experts


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_is_the_whole_block(name, world):
    want_y, want_dx, want_grads = _reference(name, world, skew=False)
    results = run_distributed(_ranks, world, args=(name, False))
    share = E // world
    for rank, (y, dx, grads, shapes, held) in enumerate(results):
        mine = slice(2 * rank, 2 * rank + 2)
        assert held == share
        assert torch.equal(y, want_y[mine]), rank
        torch.testing.assert_close(dx, want_dx[mine], rtol=1e-6, atol=1e-7)
        for n, g in grads.items():
            want = want_grads[n]
            if n.startswith("experts."):  # this rank's block of experts
                assert g.shape[0] == share and shapes[n][0] == E
                want = want[rank * share : (rank + 1) * share]
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: n + m)


@pytest.mark.distributed
def test_a_rank_whose_experts_get_no_rows_still_exchanges():
    """Every token to experts 0 and 1, both on rank 0 of 2: rank 1 runs no expert, its
    experts' gradients are zero, and the outputs are still the whole block's."""
    want_y, _, want_grads = _reference("mixtral", 2, skew=True)
    results = run_distributed(_ranks, 2, args=("mixtral", True))
    for rank, (y, *_) in enumerate(results):
        assert torch.equal(y, want_y[2 * rank : 2 * rank + 2])
    assert all(torch.count_nonzero(g) == 0 for n, g in results[1][2].items() if "experts" in n)
    assert torch.count_nonzero(want_grads["experts.down_proj"][4:]) == 0
