"""Differentiable collectives: each forward collective paired with the one its gradient needs.

Tensor parallelism (Megatron's ``f`` and ``g`` and their sequence-parallel forms), Ulysses'
sequence <-> head exchange and mixture-of-experts' token exchange are all made of these, along
one :class:`Axis` of the grid (tp, sp, ep) or along a process group a user hands in.

=============================  ===============================  ===============================
function                       forward                          backward
=============================  ===============================  ===============================
copy(x, axis)                  identity                         all-reduce
reduce(x, axis)                all-reduce                       identity
scatter(x, dim, axis)          keep this rank's part of ``dim`` all-gather along ``dim``
gather(x, dim, axis)           all-gather along ``dim``         keep this rank's part
gather(..., grad_is_partial)   all-gather along ``dim``         reduce-scatter along ``dim``
reduce_scatter(x, dim, axis)   reduce-scatter along ``dim``     all-gather along ``dim``
all_to_all(x, axis, s, g)      split ``s`` over the ranks,      the reverse exchange (split
                               join what arrives along ``g``    ``g``, join along ``s``)
exchange(x, send, receive, a)  ``send[r]`` rows to rank ``r``,  the reverse exchange
                               ``receive[s]`` from rank ``s``
=============================  ===============================  ===============================

Parts are in rank order: rank ``r`` keeps (and gathers into place) the ``r``-th of ``size``
equal slices of ``dim``. A size that does not split is a ``ValueError`` naming the axis.
Each function is the identity when the axis has one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import collectives
from .grid import Comm


@dataclass(frozen=True)
class Axis:
    """One axis of collectives: ``comm``'s grid axis ``name`` ('tp', 'sp', 'ep'; counted in its
    ``CommLog``), or a process group (``group``: through DeepSpeed's module functions, counted
    by the comms logger)."""

    name: str
    comm: Comm | None = None
    group: dist.ProcessGroup | None = None

    @property
    def size(self) -> int:
        if self.comm is None:
            return dist.get_world_size(self.group)
        return getattr(self.comm.topo, self.name)

    @property
    def rank(self) -> int:
        if self.comm is None:
            return dist.get_rank(self.group)
        return self.comm.topo.rank(self.name)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        if self.comm is None:
            collectives.all_gather_into_tensor(out, inp, group=self.group)
        else:
            self.comm.all_gather(out, inp, axis=self.name)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        if self.comm is None:
            collectives.reduce_scatter_tensor(out, inp, group=self.group)
        else:
            self.comm.reduce_scatter(out, inp, axis=self.name)

    def all_reduce(self, x: torch.Tensor) -> None:
        if self.comm is None:
            collectives.all_reduce(x, group=self.group)
        else:
            self.comm.all_reduce(x, axis=self.name)

    def all_to_all(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int] | None = None,
        in_splits: list[int] | None = None,
    ) -> None:
        if self.comm is None:
            collectives.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        else:
            self.comm.all_to_all(
                out, inp, axis=self.name, output_splits=out_splits, input_splits=in_splits
            )

    def ring_shift(self, send: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every tensor of ``send`` to the next rank of the axis (``rank + 1``, wrapping), and
        the previous rank's, like-shaped, back: the sends and receives are posted together, so
        each rank sends and receives at once (ring attention's exchange). One rank: ``send``."""
        n = self.size
        if n == 1:
            return list(send)
        send = [t.contiguous() for t in send]
        recv = [torch.empty_like(t) for t in send]
        after, before = (self.rank + 1) % n, (self.rank - 1) % n
        if self.comm is not None:  # peers are coordinates along the axis
            ops = [("send", t, after) for t in send] + [("recv", t, before) for t in recv]
            self.comm.p2p(ops, axis=self.name)
            return recv
        group = self.group if self.group is not None else dist.group.WORLD
        after, before = dist.get_global_rank(group, after), dist.get_global_rank(group, before)
        ops = [collectives.P2POp(collectives.isend, t, after, group) for t in send]
        ops += [collectives.P2POp(collectives.irecv, t, before, group) for t in recv]
        for work in collectives.batch_isend_irecv(ops):
            work.wait()
        return recv


def on_axis(comm: Comm, name: str) -> Axis:
    """``comm``'s grid axis ``name``."""
    return Axis(name, comm=comm)


def on_group(group: dist.ProcessGroup, name: str = "group") -> Axis:
    """A process group's ranks, as an axis."""
    return Axis(name, group=group)


# ---------------------------------------------------------------------------- the collectives
def _parts(x: torch.Tensor, dim: int, axis: Axis) -> int:
    size, n = x.shape[dim], axis.size
    if size % n:
        raise ValueError(
            f"dimension {dim} of size {size} does not split into {n} {axis.name} ranks"
        )
    return size // n


def _split(x: torch.Tensor, dim: int, axis: Axis) -> torch.Tensor:
    part = _parts(x, dim, axis)
    return x.narrow(dim, axis.rank * part, part).contiguous()


def _all_gather(x: torch.Tensor, dim: int, axis: Axis) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((axis.size, *x.shape))
    axis.all_gather(out.view(-1), x.view(-1))
    return torch.cat(out.unbind(0), dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, axis: Axis) -> torch.Tensor:
    _parts(x, dim, axis)
    chunks = torch.stack(x.chunk(axis.size, dim=dim))  # [size, ...part], contiguous
    out = x.new_empty(chunks.shape[1:])
    axis.reduce_scatter(out.view(-1), chunks.view(-1))
    return out


def _all_reduce(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    x = x.contiguous().clone()
    axis.all_reduce(x)
    return x


def _all_to_all(x: torch.Tensor, scatter: int, gather: int, axis: Axis) -> torch.Tensor:
    _parts(x, scatter, axis)
    if scatter == gather == 0:  # the parts are x's own consecutive rows: no copy in or out
        x = x.contiguous()
        out = torch.empty_like(x)
        axis.all_to_all(out, x)
        return out
    send = torch.stack(x.chunk(axis.size, dim=scatter))  # row r: what rank r takes
    received = torch.empty_like(send)
    axis.all_to_all(received, send)
    return torch.cat(received.unbind(0), dim=gather)  # row s came from rank s: in order


def _exchange(x: torch.Tensor, send: list[int], receive: list[int], axis: Axis) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(receive), *x.shape[1:]))
    axis.all_to_all(out, x, list(receive), list(send))
    return out


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, receive, axis):
        ctx.send, ctx.receive, ctx.axis = send, receive, axis
        return _exchange(x, send, receive, axis)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.receive, ctx.send, ctx.axis), None, None, None


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.axis), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        return _all_reduce(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis):
        ctx.dim, ctx.axis = dim, axis
        return _split(x, dim, axis)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.axis), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis, grad_is_partial):
        ctx.dim, ctx.axis, ctx.grad_is_partial = dim, axis, grad_is_partial
        return _all_gather(x, dim, axis)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:  # each rank holds a part of the gradient: sum the parts
            return _reduce_scatter(grad, ctx.dim, ctx.axis), None, None, None
        return _split(grad, ctx.dim, ctx.axis), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis):
        ctx.dim, ctx.axis = dim, axis
        return _reduce_scatter(x, dim, axis)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.axis), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, scatter, gather):
        ctx.args = (axis, scatter, gather)
        return _all_to_all(x, scatter, gather, axis)

    @staticmethod
    def backward(ctx, grad):
        axis, scatter, gather = ctx.args
        return _all_to_all(grad.contiguous(), gather, scatter, axis), None, None, None


def _run(fn: type[torch.autograd.Function], *args):
    return fn.apply(*args)


# Under torch.compile the collectives run eagerly, the graph broken around each: they post
# through Comm (its CommLog, the watchdog's in-flight list), which dynamo cannot trace.
_apply = torch.compiler.disable(_run, recursive=True)


def copy(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Identity forward; the gradient is all-reduced over ``axis`` (Megatron's ``f``)."""
    return x if axis.size == 1 else _apply(_Copy, x, axis)


def reduce(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """All-reduce over ``axis`` forward; the gradient passes (Megatron's ``g``)."""
    return x if axis.size == 1 else _apply(_Reduce, x, axis)


def scatter(x: torch.Tensor, dim: int, axis: Axis) -> torch.Tensor:
    """This rank's part of ``dim``; the gradient is all-gathered back along it."""
    return x if axis.size == 1 else _apply(_Scatter, x, dim, axis)


def gather(x: torch.Tensor, dim: int, axis: Axis, grad_is_partial: bool = False) -> torch.Tensor:
    """All-gather along ``dim``; the gradient keeps this rank's part, or, when each rank's
    gradient is a partial sum of the whole (``grad_is_partial``: the gathered tensor fed a layer
    split over the same ranks), is reduce-scattered."""
    return x if axis.size == 1 else _apply(_Gather, x, dim, axis, grad_is_partial)


def reduce_scatter(x: torch.Tensor, dim: int, axis: Axis) -> torch.Tensor:
    """Reduce-scatter along ``dim``; the gradient is all-gathered back along it."""
    return x if axis.size == 1 else _apply(_ReduceScatter, x, dim, axis)


def all_to_all(x: torch.Tensor, axis: Axis, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``scatter_dim`` over the ranks of ``axis`` (part ``r`` to rank ``r``) and join what
    arrives along ``gather_dim``, in rank order; the gradient takes the reverse exchange."""
    if axis.size == 1:
        return x
    return _apply(_AllToAll, x, axis, scatter_dim % x.dim(), gather_dim % x.dim())


def exchange(x: torch.Tensor, send: list[int], receive: list[int], axis: Axis) -> torch.Tensor:
    """Rows of ``x`` (its first dimension) to the axis's ranks in order, ``send[r]`` to rank
    ``r``; what arrives, ``receive[s]`` rows from rank ``s``, in rank order (mixture-of-experts'
    dispatch, whose counts vary per step). Backward sends the gradients back the same way."""
    if len(send) != axis.size or len(receive) != axis.size or sum(send) != x.shape[0]:
        raise ValueError(
            f"{axis.name}: send {list(send)} and receive {list(receive)} for {x.shape[0]} rows "
            f"over {axis.size} ranks"
        )
    if axis.size == 1:
        return x
    return _apply(_Exchange, x, tuple(send), tuple(receive), axis)
