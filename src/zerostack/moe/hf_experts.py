"""A Hugging Face MoE block's experts, cut by expert for expert parallelism and run on the rows
routed to them (issue 53). zerostack keeps the model's own experts module and its tensor layout
(``gate_up_proj``, ``down_proj`` and their biases, experts first), so each rank's slice is the
model's module with fewer experts, computes with the model's own code (Mixtral's, Qwen's,
DeepSeek's, GLM's, GPT-OSS's activation and bias conventions alike), and the slices of all
ranks, concatenated, are the model's checkpoint tensors again. DeepSpeed's AutoEP instead
repacks them into its own ``w1``/``w2``/``w3`` (docs/design/autoep-reference.md, section 3).

Rows reach an expert one (token, expert) pair at a time, each with its weight, and their
outputs are summed per token in ascending expert order, the order Hugging Face's eager experts
add them in.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class ExpertsError(ValueError):
    """Experts that cannot be cut or run as asked (one line naming what)."""


def expert_count(experts: nn.Module) -> int:
    count = getattr(experts, "num_experts", None)
    if not isinstance(count, int) or count < 1:
        raise ExpertsError(f"{type(experts).__name__}: no num_experts to cut by")
    return count


def expert_slice(experts: nn.Module, first: int, count: int) -> nn.Module:
    """The model's experts module holding experts ``first`` to ``first + count - 1``: the same
    class and settings, each parameter whose first dimension is the experts cut to those (a
    copy: the source can be freed)."""
    total = expert_count(experts)
    if count < 1 or first < 0 or first + count > total:
        raise ExpertsError(f"experts {first}..{first + count - 1} are not within 0..{total - 1}")
    own = copy.copy(experts)  # a new module object: its own parameter, buffer and child tables
    own._parameters = dict(experts._parameters)
    own._buffers = dict(experts._buffers)
    own._modules = dict(experts._modules)
    cut = 0
    for name, p in experts.named_parameters(recurse=False):
        if p.dim() >= 1 and p.shape[0] == total:
            piece = p.detach()[first : first + count].clone()
            own._parameters[name] = nn.Parameter(piece, requires_grad=p.requires_grad)
            cut += 1
    if not cut:
        raise ExpertsError(f"{type(experts).__name__}: no parameter has {total} experts first")
    own.num_experts = count
    return own


def run_experts(
    experts: nn.Module,
    x: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
    first: int = 0,
) -> torch.Tensor:
    """``[tokens, hidden]``: for each token, the sum over its chosen experts that ``experts``
    holds (global ids ``first`` on) of the expert's output times its weight; tokens routed
    elsewhere only get zeros. ``chosen`` and ``weights``: ``[tokens, k]``, as a router gives
    them."""
    if chosen.shape != weights.shape or chosen.dim() != 2 or chosen.shape[0] != x.shape[0]:
        raise ExpertsError(
            f"chosen {tuple(chosen.shape)} and weights {tuple(weights.shape)} for "
            f"{x.shape[0]} tokens: need [tokens, k] each"
        )
    count = expert_count(experts)
    tokens, k = chosen.shape
    flat = (chosen - first).reshape(-1)  # slot t k + j: token t's j-th choice
    mine = ((flat >= 0) & (flat < count)).nonzero().squeeze(1)
    # by expert, then by the choice's rank j, then by token: the rows each expert's matmuls
    # take in the order Hugging Face's experts gather them (torch.where over [k, tokens])
    key = (flat[mine] * k + mine % k) * tokens + mine // k
    order = mine[torch.argsort(key)]
    token = order // k
    rows = experts(
        x[token], flat[order].unsqueeze(1), weights.reshape(-1)[order].unsqueeze(1)
    )  # one (expert, weight) pair a row: the row's output is that expert's share
    out = torch.zeros_like(x)
    return out.index_add(0, token, rows.to(x.dtype))
