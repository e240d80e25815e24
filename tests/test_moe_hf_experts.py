"""zerostack.moe.hf_experts against Hugging Face's own experts modules (Transformers 5.24):
the rows routed to a model's experts, run one (token, expert) pair at a row through the model's
own module, give its output bit for bit; cut into 2 or 4 slices by expert (what expert
parallelism holds per rank) they give it again as the slices' sum, and the slices' tensors,
concatenated, are the model's (issue 53: experts saved in the model's own layout)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds3
from transformers.models.glm4_moe import modeling_glm4_moe as glm
from transformers.models.gpt_oss import modeling_gpt_oss as oss
from transformers.models.mixtral import modeling_mixtral as mixtral
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen35
from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3

from zerostack.moe.hf_experts import ExpertsError, expert_slice, run_experts
from zerostack.moe.routing import Routing, route

H, F, E, K = 32, 24, 16, 4
SMALL = {"hidden_size": H, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8}
GROUPED = {"n_routed_experts": E, "num_experts_per_tok": K, "n_group": 4, "topk_group": 2}


def _cases():
    return {
        "mixtral": (transformers.MixtralConfig(**SMALL, intermediate_size=F, num_local_experts=E,
                    num_experts_per_tok=K), mixtral.MixtralExperts),
        "qwen3_moe": (transformers.Qwen3MoeConfig(**SMALL, moe_intermediate_size=F, num_experts=E,
                      num_experts_per_tok=K), qwen3.Qwen3MoeExperts),
        "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig(**SMALL, moe_intermediate_size=F,
                        num_experts=E, num_experts_per_tok=K), qwen35.Qwen3_5MoeExperts),
        "deepseek_v2": (transformers.DeepseekV2Config(**SMALL, **GROUPED, moe_intermediate_size=F,
                        topk_method="group_limited_greedy"), ds2.DeepseekV2Experts),
        "deepseek_v3": (transformers.DeepseekV3Config(**SMALL, **GROUPED, moe_intermediate_size=F),
                        ds3.DeepseekV3Experts),
        "glm4_moe": (transformers.Glm4MoeConfig(**SMALL, **GROUPED, moe_intermediate_size=F),
                     glm.Glm4MoeExperts),
        "gpt_oss": (transformers.GptOssConfig(**SMALL, intermediate_size=F, num_local_experts=E,
                    num_experts_per_tok=K), oss.GptOssExperts),
    }  # fmt: skip


def _setup(name):
    config, cls = _cases()[name]
    torch.manual_seed(0)
    experts = cls(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(std=0.2)
    x = torch.randn(48, H)
    r = Routing.from_hf_config(config)
    logits = torch.randn(48, E)
    weights, chosen = route(logits, r, torch.zeros(E) if r.bias else None)
    return experts, x, chosen, weights


@pytest.mark.parametrize("name", list(_cases()))
def test_the_routed_rows_give_the_models_experts_output(name):
    experts, x, chosen, weights = _setup(name)
    want = experts(x, chosen, weights)
    assert torch.equal(run_experts(experts, x, chosen, weights), want)
    for ep in (2, 4):
        share = E // ep
        parts = [expert_slice(experts, r * share, share) for r in range(ep)]
        for r, part in enumerate(parts):
            assert part.num_experts == share and type(part) is type(experts)
            for (n, p), (m, q) in zip(
                part.named_parameters(), experts.named_parameters(), strict=True
            ):
                assert n == m and torch.equal(p, q[r * share : (r + 1) * share])
        for n, p in experts.named_parameters():  # the slices, concatenated, are the model's
            assert torch.equal(torch.cat([dict(q.named_parameters())[n] for q in parts]), p)
        got = sum(run_experts(q, x, chosen, weights, r * share) for r, q in enumerate(parts))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_gradients_reach_only_the_slices_experts_that_ran():
    """Backward through a slice: the experts that received rows get the model's gradient for
    them, the rest exactly zero (none)."""
    experts, x, chosen, weights = _setup("mixtral")
    x.requires_grad_(True)
    experts(x, chosen, weights).square().sum().backward()
    whole = {n: p.grad.clone() for n, p in experts.named_parameters()}
    part = expert_slice(experts, 8, 8)
    y = x.detach().requires_grad_(True)
    run_experts(part, y, chosen, weights, 8).square().sum().backward()
    hit = set(chosen.unique().tolist()) & set(range(8, 16))
    for n, p in part.named_parameters():
        for e in range(8):
            if e + 8 in hit:
                assert torch.count_nonzero(p.grad[e]) > 0, (n, e)
            else:
                assert p.grad is None or torch.count_nonzero(p.grad[e]) == 0
    assert hit and whole


def test_bad_slices_and_routes_are_named():
    experts, x, chosen, weights = _setup("mixtral")
    with pytest.raises(ExpertsError, match=r"experts 12\.\.19 are not within 0\.\.15"):
        expert_slice(experts, 12, 8)
    with pytest.raises(ExpertsError, match=r"chosen \(48, 4\) and weights \(48, 3\)"):
        run_experts(experts, x, chosen, weights[:, :3])
    with pytest.raises(ExpertsError, match="Linear: no num_experts to cut by"):
        expert_slice(torch.nn.Linear(2, 2), 0, 1)


def test_an_exchange_whose_counts_do_not_add_up_is_named():
    """comm.functional.exchange checks its counts before any rank posts a collective."""
    from types import SimpleNamespace

    from zerostack.comm.functional import exchange

    axis = SimpleNamespace(name="ep", size=2)
    with pytest.raises(ValueError, match=r"ep: send \[2, 1\] and receive \[1, 1\] for 4 rows"):
        exchange(torch.zeros(4, 3), [2, 1], [1, 1], axis)
    with pytest.raises(ValueError, match="over 2 ranks"):
        exchange(torch.zeros(4, 3), [4], [1, 1], axis)
