"""A linear layer whose backward does not pin a stage-3 parameter's gathered storage.

Stage 3 routes plain ``nn.Linear`` modules through it, and the tensor-parallel layers use it too,
so a released weight is freed during forward whichever layer holds it. Its weight gradient, as
large as the weight and dropped as soon as it is staged, is made in a mapping of its own on the
CPU (:mod:`zerostack.core.scratch`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...core import scratch
from ...core.precision import autocast_as, autocast_state


class _LinearSavingWeight(torch.autograd.Function):
    """``F.linear`` that saves the weight *parameter* for backward, not a view of its storage.

    torch's linear saves ``weight.t()``, a view that keeps the gathered storage alive until
    backward even after the module releases the parameter, so a stage-3 forward would end up
    holding every layer's full weights. Saved as the parameter itself, the weight is whatever the
    parameter holds when backward unpacks it: empty after the release, gathered again by the
    pre-backward hook.
    """

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.autocast = autocast_state(x)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        with autocast_as(ctx.autocast):
            return _LinearSavingWeight._backward(ctx, gy)

    @staticmethod
    def _backward(ctx, gy):
        x, weight = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = gy.matmul(weight)
        flat = gy.reshape(-1, gy.shape[-1])
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            if flat.dtype == x2.dtype:  # out of glibc's heap on the CPU (.scratch)
                gw = scratch.empty(weight.numel(), flat.dtype, flat.device).view(weight.shape)
                torch.matmul(flat.t(), x2, out=gw)
            else:
                gw = flat.t().matmul(x2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = flat.sum(0)
        return gx, gw, gb


def linear_saving_weight(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``F.linear`` whose backward keeps the weight parameter itself (see _LinearSavingWeight):
    what ZeRO stage 3 needs to free a released weight during forward."""
    return _LinearSavingWeight.apply(x, weight, bias)
