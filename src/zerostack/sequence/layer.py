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

from ..comm import functional as cf
from ..comm.grid import comm_for
from ..topology import Topology
from .ring import sequence_piece


def _axis(group: Topology | dist.ProcessGroup) -> cf.Axis:
    """The Ulysses ranks of ``group``: a Topology's sp axis (its 'ulysses' axis when part of sp
    is a ring) through its ``Comm`` (in the engine's CommLog), or a process group through
    DeepSpeed's module functions (in the comms logger)."""
    if isinstance(group, Topology):
        return cf.on_axis(comm_for(group), "sp" if group.ring == 1 else "ulysses")
    return cf.on_group(group, "sp")


def seq_all_to_all(
    x: torch.Tensor, group: Topology | dist.ProcessGroup, scatter_idx: int, gather_idx: int
) -> torch.Tensor:
    """Split ``x`` along ``scatter_idx`` over the sp ranks and join what they send along
    ``gather_idx``, in rank order; its backward is the reverse exchange."""
    return cf.all_to_all(x, _axis(group), scatter_idx, gather_idx)


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
        q, k, v = (
            seq_all_to_all(t, self.spg, self.scatter_idx, self.gather_idx)
            for t in (query, key, value)
        )
        context = self.local_attn(q, k, v, *args, **kwargs)
        return seq_all_to_all(context, self.spg, self.gather_idx, self.scatter_idx)


def shard_sequence(batch: Any, topology: Topology, dim: int = 1) -> Any:
    """This sp rank's shard of every tensor in ``batch`` (a tensor, or tuples, lists and dicts
    of them) along ``dim`` (the sequence of ``[b, s, ...]`` batches); tensors with fewer
    dimensions pass whole. The identity when sp is 1. With ring ranks, the pieces are
    :func:`~zerostack.sequence.ring.sequence_piece`'s (zigzag shards of the ring)."""
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
        try:
            return sequence_piece(t, dim, rank, sp, topology.ring).contiguous()
        except ValueError as e:
            raise ValueError(f"{e}: a batch tensor of shape {tuple(t.shape)}") from None

    return cut(batch)
