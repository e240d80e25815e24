"""Token-choice top-k routing as Hugging Face's mixture-of-experts blocks compute it, one
description (:class:`Routing`) for every architecture DeepSpeed's AutoEP presets cover and two it
lacks (issue 53; what each preset does: docs/design/autoep-reference.md, section 2):

============  ======================  ===========================================================
family        model types             from the router's logits
============  ======================  ===========================================================
softmax       mixtral, qwen3_moe,     softmax over the experts in fp32, the top k, their weights
              qwen3_5_moe             summed to 1 (Qwen3-MoE only with ``norm_topk_prob``); Qwen's
                                      routers hand the weights back in the logits' dtype
grouped       deepseek_v2             softmax; "group_limited_greedy": the experts in groups, a
                                      group scored by its best expert, the top groups' experts
                                      alone eligible; weights times ``routed_scaling_factor``
biased        deepseek_v3, glm4_moe   sigmoid; a correction bias added for the choice only (the
                                      weights are the unbiased scores); groups scored by their two
                                      best; weights summed to 1 (plus 1e-20) with
                                      ``norm_topk_prob``, then scaled
logits        gpt_oss                 the top k of the logits (the router has a bias), softmax
                                      over those k in the logits' dtype
============  ======================  ===========================================================

:func:`route` returns the weights and the chosen experts, pairs in the order ``torch.topk``
gives them; a block's output sums over the k, so callers need no order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCORES = ("softmax", "sigmoid", "logits")  # over all experts; per expert; the top k's logits
GROUP_SCORES = ("max", "top2")  # a group's score: its best expert's, or its best two's sum
MODEL_TYPES = (
    "mixtral", "qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text", "deepseek_v2", "deepseek_v3",
    "glm4_moe", "gpt_oss",
)  # fmt: skip


class RoutingError(ValueError):
    """A routing that cannot be built (one line naming the setting)."""


@dataclass(frozen=True)
class Routing:
    """How a block picks ``top_k`` of its ``experts`` for each token and weighs them.

    ``score``: a key of :data:`SCORES`. ``normalize``: the chosen weights divided by their sum
    (plus ``eps``). ``scale``: the weights multiplied by it afterwards. ``groups`` /
    ``top_groups``: only the experts of the ``top_groups`` best of ``groups`` equal groups may
    be chosen, a group scored by ``group_score``. ``bias``: a per-expert correction added to
    the scores for the choice only (DeepSeek-V3's ``e_score_correction_bias``; passed to
    :func:`route`). ``weights_dtype``: "fp32", or "logits" to hand the weights back in the
    logits' dtype. ``sorted``: the k in descending order (``torch.topk``'s default, as
    Mixtral's, Qwen's and GPT-OSS's routers take them) or as ``topk(sorted=False)`` leaves them
    (DeepSeek's and GLM's): the order the weights are summed in when normalized."""

    experts: int
    top_k: int
    score: str = "softmax"
    normalize: bool = True
    eps: float = 0.0
    scale: float = 1.0
    groups: int = 1
    top_groups: int = 1
    group_score: str = "top2"
    bias: bool = False
    weights_dtype: str = "fp32"
    sorted: bool = True

    def __post_init__(self) -> None:
        if self.experts < 1 or not 1 <= self.top_k <= self.experts:
            raise RoutingError(f"top_k: {self.top_k} of {self.experts} experts")
        if self.score not in SCORES:
            raise RoutingError(f"score: {self.score!r} is not one of {', '.join(SCORES)}")
        if self.group_score not in GROUP_SCORES:
            raise RoutingError(f"group_score: {self.group_score!r} is not max or top2")
        if self.weights_dtype not in ("fp32", "logits"):
            raise RoutingError(f"weights_dtype: {self.weights_dtype!r} is not fp32 or logits")
        if self.groups < 1 or self.experts % self.groups:
            raise RoutingError(f"groups: {self.groups} do not split {self.experts} experts evenly")
        if not 1 <= self.top_groups <= self.groups:
            raise RoutingError(f"top_groups: {self.top_groups} of {self.groups} groups")
        if self.top_k > self.top_groups * (self.experts // self.groups):
            raise RoutingError(
                f"top_k: {self.top_k} is more than the {self.top_groups} top groups hold"
            )
        if self.groups > 1 and self.group_score == "top2" and self.experts // self.groups < 2:
            raise RoutingError(f"groups: {self.groups} leave fewer than 2 experts to score each")
        if self.groups > 1 and self.score == "logits":
            raise RoutingError("groups: not with score 'logits' (it ranks raw logits)")

    @classmethod
    def from_hf_config(cls, config) -> Routing:
        """The routing of a Hugging Face config's MoE blocks (its ``model_type``; a
        multimodal config's text part)."""
        config = getattr(config, "text_config", None) or config
        kind = config.model_type
        if kind not in MODEL_TYPES:
            raise RoutingError(f"model_type: {kind!r} has no known routing")
        k = config.num_experts_per_tok
        if kind == "mixtral":
            return cls(config.num_local_experts, k)
        if kind in ("qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text"):
            normalize = getattr(config, "norm_topk_prob", True) if kind == "qwen3_moe" else True
            return cls(config.num_experts, k, normalize=normalize, weights_dtype="logits")
        if kind == "deepseek_v2":
            grouped = config.topk_method == "group_limited_greedy"
            return cls(
                config.n_routed_experts,
                k,
                normalize=False,
                scale=float(config.routed_scaling_factor),
                groups=config.n_group if grouped else 1,
                top_groups=config.topk_group if grouped else 1,
                group_score="max",
                sorted=False,
            )
        if kind in ("deepseek_v3", "glm4_moe"):
            return cls(
                config.n_routed_experts,
                k,
                score="sigmoid",
                normalize=bool(config.norm_topk_prob),
                eps=1e-20,
                scale=float(config.routed_scaling_factor),
                groups=config.n_group,
                top_groups=config.topk_group,
                bias=True,
                sorted=False,
            )
        return cls(config.num_local_experts, k, score="logits", weights_dtype="logits")  # gpt_oss


def route(
    logits: torch.Tensor, r: Routing, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, experts)``, each ``[tokens, top_k]``, for router ``logits`` ``[tokens,
    experts]`` (``bias``: the correction :attr:`Routing.bias` asks for)."""
    if logits.dim() != 2 or logits.shape[1] != r.experts:
        raise RoutingError(f"logits: shape {tuple(logits.shape)}, not [tokens, {r.experts}]")
    if (bias is not None) != r.bias:
        raise RoutingError(f"bias: {'missing' if r.bias else 'given'} for this routing")
    if r.score == "logits":
        top, chosen = torch.topk(logits, r.top_k, dim=-1)
        return torch.softmax(top, dim=1, dtype=top.dtype), chosen
    if r.score == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = logits.float().sigmoid()
    choice = scores if bias is None else scores + bias
    if r.groups > 1:
        per_group = choice.view(-1, r.groups, r.experts // r.groups)
        if r.group_score == "max":
            group_scores = per_group.max(dim=-1).values
        else:
            group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)
        best = torch.topk(group_scores, r.top_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, best, 1).bool()
        keep = keep.unsqueeze(-1).expand_as(per_group).reshape(-1, r.experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    chosen = torch.topk(choice, r.top_k, dim=-1, sorted=r.sorted)[1]
    weights = scores.gather(1, chosen)
    if r.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + r.eps)
    if r.scale != 1.0:
        weights = weights * r.scale
    if r.weights_dtype == "logits":
        weights = weights.to(logits.dtype)
    return weights, chosen
