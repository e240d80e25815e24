"""The experts of one MoE layer: copies of a module, each run on its own slots."""

from __future__ import annotations

import copy

import torch
from torch import nn


class Experts(nn.Module):
    """``num_local_experts`` deep copies of ``expert``; their parameters are marked as expert
    parameters (``allreduce = False``, ``group_name``), as DeepSpeed marks them."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name=None):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(
            copy.deepcopy(expert) for _ in range(num_local_experts)
        )
        self.num_local_experts = num_local_experts
        for e in self.deepspeed_experts:
            for p in e.parameters():
                p.allreduce = False
                p.group_name = expert_group_name

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs`` [ranks * experts, slots, d_model], grouped by the rank the slots came
        from: local expert ``l`` runs on rows ``l, l + experts, ...``."""
        n = self.num_local_experts
        grouped = inputs.view(-1, n, *inputs.shape[1:])  # [ranks, local experts, slots, d]
        outputs = [e(grouped[:, i]) for i, e in enumerate(self.deepspeed_experts)]
        return torch.stack(outputs, dim=1).view(inputs.shape)
