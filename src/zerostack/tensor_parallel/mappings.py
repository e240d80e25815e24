"""The region boundaries of tensor and sequence parallelism, as named autograd Functions.

Megatron-LM's ``f`` and ``g`` (Shoeybi et al., 2019) and their sequence-parallel forms
(Korthikanti et al., 2022). Each is a pair (forward, backward) of collectives over the tp axis of
a :class:`~zerostack.comm.Comm`, so the ``CommLog`` counts them; each returns its input unchanged
when the tp size is 1.

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
from ..precision import autocast_as, autocast_state

SEQ_DIM = 1


def _split(x: torch.Tensor, dim: int, comm: Comm) -> torch.Tensor:
    tp, rank = comm.topo.tp, comm.topo.rank("tp")
    size = x.shape[dim]
    if size % tp:
        raise ValueError(f"dimension {dim} of size {size} does not split into {tp} tp ranks")
    return x.narrow(dim, rank * (size // tp), size // tp).contiguous()


def _all_gather(x: torch.Tensor, dim: int, comm: Comm) -> torch.Tensor:
    tp = comm.topo.tp
    x = x.contiguous()
    out = x.new_empty((tp, *x.shape))
    comm.all_gather(out.view(-1), x.view(-1), axis="tp")
    return torch.cat(out.unbind(0), dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, comm: Comm) -> torch.Tensor:
    tp = comm.topo.tp
    size = x.shape[dim]
    if size % tp:
        raise ValueError(f"dimension {dim} of size {size} does not split into {tp} tp ranks")
    chunks = torch.stack(x.chunk(tp, dim=dim))  # [tp, ...chunk], contiguous
    out = x.new_empty(chunks.shape[1:])
    comm.reduce_scatter(out.view(-1), chunks.view(-1), axis="tp")
    return out


def _all_reduce(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    x = x.contiguous().clone()
    comm.all_reduce(x, axis="tp")
    return x


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.comm), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        return _all_reduce(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _split(x, -1, comm)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, -1, ctx.comm), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _all_gather(x, -1, comm)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.comm), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _split(x, SEQ_DIM, comm)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQ_DIM, ctx.comm), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, grad_is_partial):
        ctx.comm, ctx.grad_is_partial = comm, grad_is_partial
        return _all_gather(x, SEQ_DIM, comm)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:  # the gathered tensor fed a tp-split layer: sum the parts
            return _reduce_scatter(grad, SEQ_DIM, ctx.comm), None, None
        return _split(grad, SEQ_DIM, ctx.comm), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter(x, SEQ_DIM, comm)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQ_DIM, ctx.comm), None


class _GatherLinearFromSP(torch.autograd.Function):
    """``F.linear`` of the all-gathered sequence shards that keeps only this rank's shard for
    backward and gathers it again there (Korthikanti et al.; Megatron does the same): the layer
    holds ``1 / tp`` of its input between forward and backward, at the price of one more
    all-gather. Like ``linear_saving_weight``, it saves the weight parameter itself, so a stage-3
    release frees the gathered storage during forward."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ctx.comm, ctx.has_bias = comm, bias is not None
        ctx.save_for_backward(x, weight)
        ctx.autocast = autocast_state(x)
        return torch.nn.functional.linear(_all_gather(x, SEQ_DIM, comm), weight, bias)

    @staticmethod
    def backward(ctx, gy):
        with autocast_as(ctx.autocast):  # as forward ran (a user's torch.autocast)
            return _GatherLinearFromSP._backward(ctx, gy)

    @staticmethod
    def _backward(ctx, gy):
        shard, weight = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _reduce_scatter(gy.matmul(weight), SEQ_DIM, ctx.comm)
        flat = gy.reshape(-1, gy.shape[-1])
        if ctx.needs_input_grad[1]:
            x = _all_gather(shard, SEQ_DIM, ctx.comm)
            gw = flat.t().matmul(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = flat.sum(0)
        return gx, gw, gb, None


def copy_to_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Enter a tp region (Megatron's f): identity forward, all-reduce of the gradient backward.

    Also the way a replicated parameter used on sequence shards gets its whole gradient.
    """
    return x if comm.topo.tp == 1 else _CopyToTP.apply(x, comm)


def reduce_from_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Leave a tp region (Megatron's g): all-reduce forward, identity backward."""
    return x if comm.topo.tp == 1 else _ReduceFromTP.apply(x, comm)


def scatter_to_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Keep this rank's part of the last dimension; the gradient is all-gathered back."""
    return x if comm.topo.tp == 1 else _ScatterToTP.apply(x, comm)


def gather_from_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """All-gather the last dimension; the gradient keeps this rank's part."""
    return x if comm.topo.tp == 1 else _GatherFromTP.apply(x, comm)


def scatter_to_sp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Keep this rank's part of the sequence; the gradient is all-gathered back."""
    return x if comm.topo.tp == 1 else _ScatterToSP.apply(x, comm)


def gather_from_sp(x: torch.Tensor, comm: Comm, *, grad_is_partial: bool = True) -> torch.Tensor:
    """All-gather the sequence shards. Backward reduce-scatters the gradient when the gathered
    tensor feeds a tp-split layer (each rank holds a partial sum), else keeps this rank's part."""
    return x if comm.topo.tp == 1 else _GatherFromSP.apply(x, comm, grad_is_partial)


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
    return x if comm.topo.tp == 1 else _ReduceScatterToSP.apply(x, comm)
