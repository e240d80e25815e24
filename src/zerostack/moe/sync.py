"""Gradients under expert parallelism (every ZeRO stage).

The grid's dp axis is the expert-data-parallel group: the ranks holding the same experts, over
which ZeRO reduces and cuts the experts. The ``ep`` ranks of a group read different batches, so
the full average over all ``dp * ep`` batches needs one more factor: a parameter every ep rank
holds (all but the experts) is reduced over the ``dp * ep`` ranks of the ``dp_ep`` axis, its
sum prescaled by ``1 / ep`` in the same collective (``zero.flat.params.Cut``,
``zero.stage3.reduce.piece_reducers``), and an expert's gradient, which the all-to-all's
backward has already summed over the ep ranks' tokens, is divided by ep. The expert's division
happens in a gradient hook (below), before the gradient reaches ZeRO's buckets.
"""

from __future__ import annotations

import torch
from torch import nn

from ..topology import Topology
from .utils import is_moe_param


def divide_expert_grads_by_ep(model: nn.Module, topo: Topology) -> None:
    """Hook every trainable expert parameter of ``model`` to divide its gradient by ep (see
    the module doc)."""
    ep = topo.ep

    def expert(grad: torch.Tensor) -> torch.Tensor:
        return grad / ep

    for p in model.parameters():
        if p.requires_grad and is_moe_param(p):
            p.register_hook(expert)
