"""The region boundaries of tensor and sequence parallelism, as named autograd Functions.

Megatron-LM's ``f`` and ``g`` (Shoeybi et al., 2019) and their sequence-parallel forms
(Korthikanti et al., 2022). Each is one of :mod:`zerostack.comm.functional`'s differentiable
collectives over the tp axis of a :class:`~zerostack.comm.Comm`, so the ``CommLog`` counts them;
each returns its input unchanged when the tp size is 1.

====================  =============================  =============================
function              forward                        backward
====================  =============================  =============================
copy_to_tp (f)        identity                       all-reduce
reduce_from_tp (g)    all-reduce                     identity
scatter_to_tp         keep this rank's last-dim part all-gather along the last dim
gather_from_tp        all-gather along the last dim  keep this rank's part
scatter_to_sp         keep this rank's sequence part all-gather along the sequence
gather_from_sp        all-gather along the sequence  reduce-scatter along the sequence
gather_linear_from_sp all-gather, then F.linear      reduce-scatter; all-gather again
reduce_scatter_to_sp  reduce-scatter along sequence  all-gather along the sequence
====================  =============================  =============================

Activations are batch-first, ``[batch, sequence, hidden]``, so the sequence is dim 1
(``SEQ_DIM``); Megatron keeps ``[sequence, batch, hidden]`` to gather along dim 0 without a copy.
"""

from __future__ import annotations

import torch

from ..comm import Comm
from ..comm import functional as cf
from ..comm.functional import _all_gather, _reduce_scatter, on_axis
from ..core.precision import autocast_as, autocast_state

SEQ_DIM = 1


class _GatherLinearFromSP(torch.autograd.Function):
    """``F.linear`` of the all-gathered sequence shards that keeps only this rank's shard for
    backward and gathers it again there (Korthikanti et al.; Megatron does the same): the layer
    holds ``1 / tp`` of its input between forward and backward, at the price of one more
    all-gather. Like ``linear_saving_weight``, it saves the weight parameter itself, so a stage-3
    release frees the gathered storage during forward."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ctx.axis, ctx.has_bias = on_axis(comm, "tp"), bias is not None
        ctx.save_for_backward(x, weight)
        ctx.autocast = autocast_state(x)
        return torch.nn.functional.linear(_all_gather(x, SEQ_DIM, ctx.axis), weight, bias)

    @staticmethod
    def backward(ctx, gy):
        with autocast_as(ctx.autocast):  # as forward ran (a user's torch.autocast)
            return _GatherLinearFromSP._backward(ctx, gy)

    @staticmethod
    def _backward(ctx, gy):
        shard, weight = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _reduce_scatter(gy.matmul(weight), SEQ_DIM, ctx.axis)
        flat = gy.reshape(-1, gy.shape[-1])
        if ctx.needs_input_grad[1]:
            x = _all_gather(shard, SEQ_DIM, ctx.axis)
            gw = flat.t().matmul(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = flat.sum(0)
        return gx, gw, gb, None


def copy_to_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Enter a tp region (Megatron's f): identity forward, all-reduce of the gradient backward.

    Also the way a replicated parameter used on sequence shards gets its whole gradient.
    """
    return cf.copy(x, on_axis(comm, "tp"))


def reduce_from_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Leave a tp region (Megatron's g): all-reduce forward, identity backward."""
    return cf.reduce(x, on_axis(comm, "tp"))


def scatter_to_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Keep this rank's part of the last dimension; the gradient is all-gathered back."""
    return cf.scatter(x, -1, on_axis(comm, "tp"))


def gather_from_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """All-gather the last dimension; the gradient keeps this rank's part."""
    return cf.gather(x, -1, on_axis(comm, "tp"))


def scatter_to_sp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Keep this rank's part of the sequence; the gradient is all-gathered back."""
    return cf.scatter(x, SEQ_DIM, on_axis(comm, "tp"))


def gather_from_sp(x: torch.Tensor, comm: Comm, *, grad_is_partial: bool = True) -> torch.Tensor:
    """All-gather the sequence shards. Backward reduce-scatters the gradient when the gathered
    tensor feeds a tp-split layer (each rank holds a partial sum), else keeps this rank's part."""
    return cf.gather(x, SEQ_DIM, on_axis(comm, "tp"), grad_is_partial)


def gather_linear_from_sp(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm
) -> torch.Tensor:
    """``F.linear(gather_from_sp(x), weight, bias)`` keeping only the sequence shard ``x`` for
    backward (the full input is gathered again there): a column-parallel layer's input under
    sequence parallelism costs ``1 / tp`` of its size in activation memory."""
    return _GatherLinearFromSP.apply(x, weight, bias, comm)


def reduce_scatter_to_sp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Sum the partial results of a tp region and keep this rank's sequence part (the
    sequence-parallel form of g); the gradient is all-gathered back."""
    return cf.reduce_scatter(x, SEQ_DIM, on_axis(comm, "tp"))
