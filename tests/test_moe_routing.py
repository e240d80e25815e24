"""zerostack.moe.routing against Hugging Face's own routers (Transformers 5.24): for each MoE
architecture, the experts chosen and their weights, bit for bit, from the router's logits
(issue 53: "routing exactly as the model's own block"), and bad routings refused by name."""

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

from zerostack.moe.routing import Routing, RoutingError, route

H = 32  # hidden width; 16 experts, 4 a token, 4 groups of which 2 eligible where grouped
SMALL = {"hidden_size": H, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8}


def _cases():
    grouped = {"n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2}
    return {
        "mixtral": (transformers.MixtralConfig(**SMALL, num_local_experts=16,
                    num_experts_per_tok=4), mixtral.MixtralTopKRouter),
        "qwen3_moe": (transformers.Qwen3MoeConfig(**SMALL, num_experts=16, num_experts_per_tok=4),
                      qwen3.Qwen3MoeTopKRouter),
        "qwen3_moe unnormalized": (transformers.Qwen3MoeConfig(**SMALL, num_experts=16,
                                   num_experts_per_tok=4, norm_topk_prob=False),
                                   qwen3.Qwen3MoeTopKRouter),
        "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig(**SMALL, num_experts=16,
                        num_experts_per_tok=4), qwen35.Qwen3_5MoeTopKRouter),
        "deepseek_v2 greedy": (transformers.DeepseekV2Config(**SMALL, **grouped,
                               topk_method="greedy", routed_scaling_factor=16.0),
                               ds2.DeepseekV2TopkRouter),
        "deepseek_v2 grouped": (transformers.DeepseekV2Config(**SMALL, **grouped,
                                topk_method="group_limited_greedy", routed_scaling_factor=16.0),
                                ds2.DeepseekV2TopkRouter),
        "deepseek_v3": (transformers.DeepseekV3Config(**SMALL, **grouped),
                        ds3.DeepseekV3TopkRouter),
        "deepseek_v3 unnormalized": (transformers.DeepseekV3Config(**SMALL, **grouped,
                                     norm_topk_prob=False), ds3.DeepseekV3TopkRouter),
        "glm4_moe": (transformers.Glm4MoeConfig(**SMALL, **grouped), glm.Glm4MoeTopkRouter),
        "gpt_oss": (transformers.GptOssConfig(**SMALL, num_local_experts=16,
                    num_experts_per_tok=4), oss.GptOssTopKRouter),
    }  # fmt: skip


@pytest.mark.parametrize("name", list(_cases()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_experts_and_weights_are_the_hf_routers(name, dtype):
    """Each router's weights drawn at random (and DeepSeek-V3's correction bias, which moves
    the choice but not the weights), 64 tokens: zerostack's choice is HF's, and each chosen
    expert's weight is HF's to the bit, in HF's dtype."""
    config, cls = _cases()[name]
    torch.manual_seed(0)
    router = cls(config)
    with torch.no_grad():
        for p in router.parameters():
            p.normal_()
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(torch.randn_like(bias))
    router = router.to(dtype) if name.startswith(("mixtral", "qwen", "gpt")) else router
    x = torch.randn(64, H, dtype=dtype)
    logits, hf_weights, hf_chosen = router(x)
    r = Routing.from_hf_config(config)
    weights, chosen = route(logits, r, bias)
    assert weights.dtype == hf_weights.dtype and chosen.shape == (64, 4)
    assert torch.equal(chosen, hf_chosen)  # in HF's order: the normalizing sum's order
    assert torch.equal(weights, hf_weights)
    if bias is not None:  # the bias moved the choice of some tokens, here
        unbiased = route(logits, r, torch.zeros_like(bias))[1]
        assert not torch.equal(unbiased.sort(dim=-1).values, chosen.sort(dim=-1).values)


def test_grouped_routing_keeps_to_the_best_groups():
    """Four groups of four experts, two eligible: every choice falls in the two groups with the
    best scores, even where a single expert elsewhere scores higher. Scored by a group's two
    best (DeepSeek-V3), group 0's one strong expert loses to groups 1 and 2's pairs; by its
    best alone (DeepSeek-V2's group_limited_greedy), group 0 and group 1 win."""
    r = Routing(16, 4, score="sigmoid", groups=4, top_groups=2)
    logits = -4.0 - 0.01 * torch.arange(16.0).view(1, 16)  # the rest low, no two alike
    logits[0, 0] = 5.0  # group 0's best alone: sigmoid 0.993, its next 0.018
    logits[0, [4, 5]] = 2.0  # group 1: two of 0.881
    logits[0, [8, 9]] = 1.5  # group 2: two of 0.818
    assert set(route(logits, r)[1][0].tolist()) == {4, 5, 8, 9}
    best = Routing(16, 4, score="sigmoid", groups=4, top_groups=2, group_score="max")
    assert set(route(logits, best)[1][0].tolist()) == {0, 1, 4, 5}
    assert 0 in route(logits, Routing(16, 4, score="sigmoid"))[1][0].tolist()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"experts": 8, "top_k": 9}, "top_k: 9 of 8 experts"),
        ({"experts": 8, "top_k": 2, "score": "relu"}, "score: 'relu' is not one of"),
        ({"experts": 8, "top_k": 2, "groups": 3}, "groups: 3 do not split 8 experts"),
        ({"experts": 8, "top_k": 2, "groups": 4, "top_groups": 5}, "top_groups: 5 of 4"),
        ({"experts": 8, "top_k": 5, "groups": 4, "top_groups": 2}, "more than the 2 top groups"),
        ({"experts": 8, "top_k": 2, "groups": 8, "top_groups": 2}, "fewer than 2 experts"),
    ],
)
def test_a_bad_routing_is_named(kwargs, message):
    with pytest.raises(RoutingError, match=message):
        Routing(**kwargs)


def test_logits_and_bias_are_checked():
    r = Routing(8, 2, score="sigmoid", bias=True)
    with pytest.raises(RoutingError, match=r"logits: shape \(4, 7\), not \[tokens, 8\]"):
        route(torch.zeros(4, 7), r, torch.zeros(8))
    with pytest.raises(RoutingError, match="bias: missing"):
        route(torch.zeros(4, 8), r)
    with pytest.raises(RoutingError, match="model_type: 'llama' has no known routing"):
        Routing.from_hf_config(transformers.LlamaConfig(**SMALL))
