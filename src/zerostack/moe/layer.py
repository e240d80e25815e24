"""DeepSpeed-MoE's layer (``deepspeed.moe.layer.MoE``), with its signature and return value::

    moe = MoE(hidden_size=64, expert=MLP(...), num_experts=8, k=2)
    output, l_aux, exp_counts = moe(hidden)      # add l_aux (times a coefficient) to the loss

With ``ep_size > 1`` each of ``ep_size`` ranks holds ``num_experts / ep_size`` of the experts
and tokens travel to their experts and back by all-to-all over the grid's ep axis;
``initialize`` builds that axis from the layers' ``ep_size`` and binds them to it. At ep_size 1
every rank holds every expert, and ZeRO shards and reduces them like any other parameter.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .experts import Experts
from .sharded_moe import MOELayer, TopKGate


class MoE(nn.Module):
    """A mixture of ``num_experts`` copies of ``expert`` behind a top-``k`` gate; with
    ``use_residual`` (Residual MoE) a dense copy runs beside it and a learned two-way softmax
    mixes the two. ``forward(hidden, used_token=None)`` returns ``(output, l_aux,
    exp_counts)``."""

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"MoE: num_experts must be >= 1, got {num_experts}")
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(
                f"MoE: num_experts {num_experts} does not split into ep_size {ep_size}"
            )
        if use_tutel or enable_expert_tensor_parallelism:
            raise ValueError(
                "MoE: use_tutel and enable_expert_tensor_parallelism are not supported"
            )
        self.use_residual = use_residual
        self.ep_size = ep_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            top2_2nd_expert_sampling,
        )
        self.deepspeed_moe = MOELayer(gate, experts, self.num_local_experts)
        if use_residual:
            self.mlp = copy.deepcopy(expert)
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_topology(self, topology) -> None:
        """The grid whose ep axis (of size ``ep_size``) exchanges the tokens (``initialize``
        calls it)."""
        if topology.ep != self.ep_size:
            raise ValueError(f"MoE: ep_size {self.ep_size}, the grid has ep {topology.ep}")
        self.deepspeed_moe.topology = topology if self.ep_size > 1 else None
        self.deepspeed_moe.gate.topology = self.deepspeed_moe.topology

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            coef = torch.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
