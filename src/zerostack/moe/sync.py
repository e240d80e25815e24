"""Gradients under expert parallelism (ZeRO stages 0-2).

The grid's dp axis, over which ZeRO reduces and divides, is the expert-data-parallel group: the
ranks holding the same experts. The ``ep`` ranks of a group read different batches, so the full
average over all ``dp * ep`` batches needs one more factor: a parameter every ep rank holds (all
but the experts) has its gradient averaged over the ep ranks, and an expert's gradient, which
the all-to-all's backward has already summed over the ep ranks' tokens, is divided by ep. The
expert's division happens in a gradient hook, before the gradient reaches ZeRO's buckets; the
shared parameters are summed over ep once per step, on ZeRO's reduced fp32 pieces, in buckets
(``ShardedDataParallel._average_over_ep``), not parameter by parameter at every micro-step.
"""

from __future__ import annotations

import torch
from torch import nn

from ..topology import Topology
from .utils import is_moe_param


def average_over_ep(model: nn.Module, topo: Topology) -> None:
    """Hook every trainable expert parameter of ``model`` (see the module doc)."""
    ep = topo.ep

    def expert(grad: torch.Tensor) -> torch.Tensor:
        return grad / ep

    for p in model.parameters():
        if p.requires_grad and is_moe_param(p):
            p.register_hook(expert)
