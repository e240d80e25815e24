"""A Hugging Face MoE block's experts, cut by expert for expert parallelism and run on the rows
routed to them (issue 53). zerostack keeps the model's own experts module and its tensor layout
(``gate_up_proj``, ``down_proj`` and their biases, experts first), so each rank's slice is the
model's module with fewer experts, computes with the model's own code (Mixtral's, Qwen's,
DeepSeek's, GLM's, GPT-OSS's activation and bias conventions alike), and the slices of all
ranks, concatenated, are the model's checkpoint tensors again. DeepSpeed's AutoEP instead
repacks them into its own ``w1``/``w2``/``w3`` (docs/design/autoep-reference.md, section 3).

Rows reach an expert one (token, expert) pair at a time, each with its weight, and their
outputs are summed per token in ascending expert order, the order Hugging Face's eager experts
add them in. :func:`expert_parallel` makes a rank's slice stand in for the whole module inside
the model's own MoE block (router, shared experts and auxiliary loss untouched): each row goes
to the rank holding its expert, which runs the rows of all ranks together in the order the
whole batch would give them, and the outputs come back to be weighted and summed.
"""

from __future__ import annotations

import copy
from functools import cache

import torch
from torch import nn

from ..comm import functional as cf


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


def expert_parallel(experts: nn.Module, axis: cf.Axis) -> nn.Module:
    """The model's experts module as rank ``axis.rank`` of ``axis.size`` holds it: its share
    of the experts (a contiguous block, :func:`expert_slice`), with a forward that takes the
    whole module's arguments (each token's chosen global experts and weights) and returns its
    output for this rank's tokens, exchanging rows with the other ranks."""
    total, ep = expert_count(experts), axis.size
    if total % ep:
        raise ExpertsError(f"{axis.name}: {ep} ranks do not split {total} experts evenly")
    share = total // ep
    own = expert_slice(experts, axis.rank * share, share)
    own.__class__ = _parallel(type(experts))
    own.ep_axis = axis
    return own


@cache
def _parallel(cls: type) -> type:
    return type(
        f"ExpertParallel{cls.__name__}", (cls,), {"forward": _dispatch, "local": cls.forward}
    )


def _dispatch(self, hidden_states, top_k_index, top_k_weights):
    """Forward of :func:`expert_parallel`'s module (``self.local``: the model's own)."""
    x, axis = hidden_states, self.ep_axis
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    slot = torch.arange(flat.numel(), device=flat.device)
    order = torch.argsort((flat * k + slot % k) * tokens + slot // k)  # by expert, rank, token
    dest = flat[order] // self.num_experts
    send = torch.bincount(dest, minlength=axis.size)
    receive = torch.empty_like(send)
    axis.all_to_all(receive, send)  # one count per rank each way
    send, receive = send.tolist(), receive.tolist()
    meta = torch.stack([flat[order] - dest * self.num_experts, order % k, order // k], dim=1)
    meta = cf.exchange(meta, send, receive, axis)  # local expert, choice rank, token
    rows = cf.exchange(x[order // k], send, receive, axis)
    source = torch.repeat_interleave(
        torch.arange(axis.size, device=x.device), torch.tensor(receive, device=x.device)
    )
    expert, rank, token = meta.unbind(1)
    # the whole batch's order: by expert, choice rank, then token (rank by rank, in order)
    perm = torch.argsort(((expert * k + rank) * axis.size + source) * (1 << 31) + token)
    ones = torch.ones(perm.numel(), 1, dtype=top_k_weights.dtype, device=x.device)
    out = self.local(rows[perm], expert[perm].unsqueeze(1), ones)  # each row its own output
    if not rows.shape[0]:  # no rows here: keep the way back joined, so backward's exchange runs
        out = out + rows.sum()
    back = cf.exchange(out[torch.argsort(perm)], receive, send, axis)
    weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(1)
    return torch.zeros_like(x).index_add(0, order // k, weighted.to(x.dtype))
