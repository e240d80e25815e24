"""Gating and dispatch of a mixture-of-experts layer, as DeepSpeed-MoE defines them
(``deepspeed.moe.sharded_moe``): top-1 and top-2 gates with capacity, token dropping and the
load-balancing auxiliary loss, and the layer that dispatches tokens to experts and combines
their outputs.

For ``S`` tokens and ``E`` experts a gate returns ``(l_aux, combine_weights, dispatch_mask,
exp_counts)``: ``combine_weights`` is ``[S, E, C]`` (token s's weight in slot c of expert e, for
a capacity of ``C`` slots per expert), ``dispatch_mask`` its non-zero pattern, ``exp_counts``
the tokens each expert was chosen for before any was dropped.

- Capacity: ``ceil(S / E * capacity_factor)``, at least ``min_capacity`` (top-2: twice the
  factor). With ``drop_tokens=False`` it is the largest expert's count instead, so none drops.
- Dropping: top-1 with ``use_rts`` (random token selection) keeps a random ``C`` of each
  expert's tokens; without it, and always for top-2, an expert keeps the first ``C`` tokens in
  order (top-2's second choices queue behind every first choice).
- Auxiliary loss: top-1 ``E * sum_e(mean gate_e * fraction routed_e)``; top-2 ``E * E *
  mean_e(...)`` over the first choices, as DeepSpeed computes them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import functional as cf
from ..comm.grid import comm_for

TOP2_EPS = torch.finfo(torch.float32).eps


def _capacity(num_tokens: int, num_experts: int, factor: float, min_capacity: int) -> int:
    return max(math.ceil(num_tokens / num_experts * factor), min_capacity)


def _busiest(exp_counts: torch.Tensor, agree) -> int:
    """Slots for every token (``drop_tokens=False``): the busiest expert's count, the largest
    over the ep ranks when ``agree`` (a max over them) is given, so their exchanges match."""
    capacity = max(int(exp_counts.max()), 1)
    return agree(capacity) if agree is not None else capacity


def gumbel_rsample(shape, device) -> torch.Tensor:
    """Gumbel(0, 1) noise (DeepSpeed's noisy gate policy "RSample", top-2's second choice)."""
    u = torch.rand(shape, device=device).clamp_(1e-20, 1.0)
    return -torch.log(-torch.log(u).clamp_min(1e-20))


def _first_come(mask: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep each expert's first ``capacity`` tokens of one-hot ``mask`` [S, E]: (kept mask,
    each kept token's slot)."""
    locations = torch.cumsum(mask, dim=0) - 1
    mask = mask * torch.lt(locations, capacity)
    return mask, torch.sum(locations * mask, dim=1)


def top1gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    agree=None,
    **_ignored,
):
    """Each token to its most probable expert (see the module doc). ``agree``: the largest of
    an int over the ep ranks (for ``drop_tokens=False``)."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    chooser = gates
    if noisy_gate_policy == "RSample":
        chooser = logits + gumbel_rsample(logits.shape, logits.device)
    mask1 = F.one_hot(torch.argmax(chooser, dim=1), num_classes=num_experts)
    if used_token is not None:
        mask1 = mask1 * used_token.to(mask1.dtype)[:, None]
    exp_counts = torch.sum(mask1, dim=0).detach().to("cpu")
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    else:
        capacity = _busiest(exp_counts, agree)
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.sum(me * ce) * num_experts
    if use_rts and drop_tokens:  # a random capacity's worth of each expert's tokens
        score = mask1 * torch.rand(mask1.shape, device=logits.device)
        top = torch.topk(score, k=min(capacity, num_tokens), dim=0).indices
        chosen = torch.zeros_like(mask1).scatter_(0, top, 1)
        mask1 = mask1 * chosen
        locations1_s = torch.sum((torch.cumsum(mask1, dim=0) - 1) * mask1, dim=1)
    else:
        mask1, locations1_s = _first_come(mask1, capacity)
    gates = gates * mask1.float()
    slots = F.one_hot(locations1_s, num_classes=capacity).float()
    combine_weights = torch.einsum("se,sc->sec", gates, slots)
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


def top2gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    top2_2nd_expert_sampling: bool = True,
    agree=None,
    **_ignored,
):
    """Each token to its two most probable experts, weights renormalised over the two (see the
    module doc); the second choice is drawn with Gumbel noise when
    ``top2_2nd_expert_sampling``."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    mask1 = F.one_hot(torch.argmax(gates, dim=1), num_classes=num_experts)
    second = logits
    if top2_2nd_expert_sampling:
        second = logits + gumbel_rsample(logits.shape, logits.device)
    second = second.masked_fill(mask1.bool(), float("-inf"))
    mask2 = F.one_hot(torch.argmax(second, dim=1), num_classes=num_experts)
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach().to("cpu")
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, 2 * capacity_factor, min_capacity)
    else:
        capacity = _busiest(exp_counts, agree)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)
    mask1 = mask1 * torch.lt(locations1, capacity)
    mask2 = mask2 * torch.lt(locations2, capacity)
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    mask1_f, mask2_f = mask1.float(), mask2.float()
    gates1_s = torch.einsum("se,se->s", gates, mask1_f)
    gates2_s = torch.einsum("se,se->s", gates, mask2_f)
    denom_s = torch.clamp(gates1_s + gates2_s, min=TOP2_EPS)
    gates1 = (gates1_s / denom_s)[:, None] * mask1_f
    gates2 = (gates2_s / denom_s)[:, None] * mask2_f
    slots1 = F.one_hot(locations1_s, num_classes=capacity).float()
    slots2 = F.one_hot(locations2_s, num_classes=capacity).float()
    combine_weights = torch.einsum("se,sc->sec", gates1, slots1) + torch.einsum(
        "se,sc->sec", gates2, slots2
    )
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


class TopKGate(nn.Module):
    """The gate: an fp32 linear map from the model dimension to expert logits, then top-1 or
    top-2 gating (capacity ``eval_capacity_factor`` outside training)."""

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        top2_2nd_expert_sampling: bool = True,
        **_ignored,
    ) -> None:
        super().__init__()
        if k not in (1, 2):
            raise ValueError(f"MoE: k {k}: only top-1 and top-2 gating are supported")
        if noisy_gate_policy not in (None, "None", "Jitter", "RSample"):
            raise ValueError(
                f"MoE: noisy_gate_policy {noisy_gate_policy!r} is not one of None, 'Jitter', "
                "'RSample'"
            )
        self.wg = nn.Linear(model_dim, num_experts, bias=False).float()
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.topology = None  # the grid, when the experts are split over its ep axis

    def _agree(self, capacity: int) -> int:
        t = torch.tensor([capacity], dtype=torch.int64, device=self.wg.weight.device)
        comm_for(self.topology).all_reduce(t, axis="ep", op=torch.distributed.ReduceOp.MAX)
        return int(t)

    def forward(self, input: torch.Tensor, used_token: torch.Tensor | None = None):
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:  # multiplicative jitter
            x = x * torch.empty_like(x).uniform_(1.0 - 1e-2, 1.0 + 1e-2)
        logits = self.wg(x.to(self.wg.weight.dtype)).float()  # a module call: stage 3 gathers
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        agree = self._agree if self.topology is not None else None
        if self.k == 1:
            return top1gating(
                logits,
                factor,
                self.min_capacity,
                used_token,
                self.noisy_gate_policy if self.training else None,
                self.drop_tokens,
                self.use_rts,
                agree=agree,
            )
        return top2gating(
            logits,
            factor,
            self.min_capacity,
            self.drop_tokens,
            self.top2_2nd_expert_sampling and self.training,
            agree=agree,
        )


def _all_to_all(x: torch.Tensor, topology) -> torch.Tensor:
    """Rows ``[j * n / ep, (j + 1) * n / ep)`` of ``x`` to ep rank ``j``; the result holds rank
    ``i``'s rows for this rank at ``[i * n / ep, ...)``. Its own inverse, so backward is the same
    exchange."""
    return cf.all_to_all(x, cf.on_axis(comm_for(topology), "ep"), 0, 0)


class MOELayer(nn.Module):
    """Dispatch each token to its experts' slots, run the experts, combine their outputs by the
    gate's weights. ``forward`` returns the output; ``l_aux`` and ``exp_counts`` stay on the
    layer."""

    def __init__(self, gate: TopKGate, experts: nn.Module, num_local_experts: int) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.num_local_experts = num_local_experts
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None
        self.topology = None  # the grid, when the experts are split over its ep axis

    def forward(self, hidden: torch.Tensor, used_token: torch.Tensor | None = None):
        d_model = hidden.shape[-1]
        tokens = hidden.reshape(-1, d_model)
        self.l_aux, combine_weights, dispatch_mask, self.exp_counts = self.gate(tokens, used_token)
        dispatched = torch.einsum("sec,sm->ecm", dispatch_mask.type_as(hidden), tokens)
        if self.topology is None:
            expert_output = self.experts(dispatched)  # [E, C, d_model]
        else:  # each ep rank's slots for expert group j to ep rank j, and the outputs back
            received = _all_to_all(dispatched, self.topology)  # [ep * local, C, d_model]
            expert_output = _all_to_all(self.experts(received), self.topology)
        combined = torch.einsum("sec,ecm->sm", combine_weights.type_as(hidden), expert_output)
        return combined.reshape(hidden.shape)
