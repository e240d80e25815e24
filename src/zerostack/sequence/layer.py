"""The all-to-all that turns sequence shards into head shards and back, and the attention
wrapper that uses it (DeepSpeed-Ulysses' ``DistributedAttention``, with its signature)::

    attn = DistributedAttention(local_attention, topo)           # or a ProcessGroup
    out = attn(q, k, v)   # [s/sp, b, h, d] in, attention over all s, [s/sp, b, h, d] out

Per attention, forward moves four all-to-alls (q, k, v, and the output back), each of the
rank's whole input: ``b * s * h / sp`` elements for a hidden size ``h``; backward moves the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import collectives
from ..comm.grid import comm_for
from ..topology import Topology

Exchange = Callable[[torch.Tensor, torch.Tensor], None]
"""``exchange(output, input)``: row ``r`` of ``input`` to rank ``r``, ``output``'s row ``s``
from rank ``s`` (``all_to_all_single`` over the sp group)."""


def _exchange(group: Topology | dist.ProcessGroup) -> tuple[int, Exchange]:
    """(sp size, the exchange) over ``group``: a Topology's sp axis through its ``Comm`` (in the
    engine's CommLog), or a process group through DeepSpeed's module function (in the comms
    logger)."""
    if isinstance(group, Topology):
        return group.sp, lambda out, inp: comm_for(group).all_to_all(out, inp, axis="sp")
    return dist.get_world_size(group), lambda out, inp: collectives.all_to_all_single(
        out, inp, group=group
    )


def _all_to_all(x: torch.Tensor, scatter: int, gather: int, size: int, exchange: Exchange):
    if x.shape[scatter] % size:
        raise ValueError(
            f"sequence parallel all-to-all: dim {scatter} of shape {tuple(x.shape)} does not "
            f"split into {size} ranks"
        )
    send = torch.stack(x.chunk(size, dim=scatter))  # row r: what rank r takes
    received = torch.empty_like(send)
    exchange(received, send)
    return torch.cat(received.unbind(0), dim=gather)  # row s came from rank s: in order


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter, gather, size, exchange):
        ctx.args = (scatter, gather, size, exchange)
        return _all_to_all(x, scatter, gather, size, exchange)

    @staticmethod
    def backward(ctx, grad):
        scatter, gather, size, exchange = ctx.args
        return (
            _all_to_all(grad.contiguous(), gather, scatter, size, exchange),
            None,
            None,
            None,
            None,
        )


def seq_all_to_all(
    x: torch.Tensor, group: Topology | dist.ProcessGroup, scatter_idx: int, gather_idx: int
) -> torch.Tensor:
    """Split ``x`` along ``scatter_idx`` over the sp ranks and join what they send along
    ``gather_idx``, in rank order; its backward is the reverse exchange."""
    size, exchange = _exchange(group)
    if size == 1:
        return x
    scatter, gather = scatter_idx % x.dim(), gather_idx % x.dim()
    return _SeqAllToAll.apply(x, scatter, gather, size, exchange)


class DistributedAttention(nn.Module):
    """Attention over a sequence split across ranks (DeepSpeed-Ulysses).

    ``query``, ``key`` and ``value`` hold this rank's shard of the sequence (dimension
    ``gather_idx``) and every head (dimension ``scatter_idx``); ``local_attention`` is called on
    the whole sequence and ``1/sp`` of the heads, and its output is returned as a sequence shard
    again. The defaults match DeepSpeed's ``[s, b, h, d]`` layout; a ``[b, s, h, d]`` layout
    takes ``scatter_idx=2, gather_idx=1``. Heads must divide by sp.
    """

    def __init__(
        self,
        local_attention: Callable[..., torch.Tensor] | nn.Module,
        sequence_process_group: Topology | dist.ProcessGroup,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
    ) -> None:
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream  # DeepSpeed's overlap stream: accepted, the exchange is inline

    def forward(self, query, key, value, *args, **kwargs) -> torch.Tensor:
        q, k, v = (seq_all_to_all(t, self.spg, self.scatter_idx, self.gather_idx) for t in
                   (query, key, value))  # fmt: skip
        context = self.local_attn(q, k, v, *args, **kwargs)
        return seq_all_to_all(context, self.spg, self.gather_idx, self.scatter_idx)


def shard_sequence(batch: Any, topology: Topology, dim: int = 1) -> Any:
    """This sp rank's shard of every tensor in ``batch`` (a tensor, or tuples, lists and dicts
    of them) along ``dim`` (the sequence of ``[b, s, ...]`` batches); tensors with fewer
    dimensions pass whole. The identity when sp is 1."""
    sp = topology.sp
    if sp == 1:
        return batch
    rank = topology.rank("sp")

    def cut(t):
        if isinstance(t, (tuple, list)):
            return type(t)(cut(u) for u in t)
        if isinstance(t, dict):
            return {k: cut(u) for k, u in t.items()}
        if not isinstance(t, torch.Tensor) or t.dim() <= dim:
            return t
        if t.shape[dim] % sp:
            raise ValueError(
                f"sequence_parallel_size: a batch tensor of shape {tuple(t.shape)} does not "
                f"split into {sp} sequence shards along dim {dim}"
            )
        return t.chunk(sp, dim=dim)[rank].contiguous()

    return cut(batch)
