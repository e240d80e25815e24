"""The flat parameters of ZeRO stages 0-2: each optimizer group's buffers (:class:`FlatGroup`:
the parameters as views of one compute-dtype buffer, the gradients as a full buffer or this
rank's shard) and each bucket's part of them (:class:`BucketState`: its master, the pieces and
staging of its reduction, which parameter elements its master holds). The layout itself is
:mod:`..partition`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ...comm import Comm
from ..partition import Bucket, FlatLayout


@dataclass(frozen=True)
class Cut:
    """Where a flat group's gradients are summed and its state is cut: over the grid's
    ``axis`` ('dp': the ranks holding the same parameters; 'dp_ep': with expert parallelism,
    the ``dp * ep`` ranks holding what all but the experts are), ``size`` ranks, this one at
    ``rank``; its masters and optimizer state shared by ``world`` of them (``size``, stages 1-2;
    1, stage 0: every rank holds all). Its gradients are multiplied by ``prescale`` before
    they are summed, so that every group's sum times the strategy's one ``grad_post`` is the
    mean over the global batch."""

    axis: str = "dp"
    size: int = 1
    rank: int = 0
    world: int = 1
    prescale: float = 1.0

    @property
    def piece_rank(self) -> int:
        """Which piece of each bucket this rank holds (0: the whole, when not cut)."""
        return self.rank if self.world > 1 else 0


def flat_parts(groups: list[dict], shared, topo, *, sharded: bool, prescale: float) -> list:
    """``(optimizer group index, its options, cut, params)`` of each flat group: an optimizer
    group's parameters on the dp axis, those of them in ``shared`` (at ep > 1: every ep rank
    holds them) on the dp_ep axis; a state ``sharded`` over the axis (stages 1-2) or not. At
    dp 1 nothing is prescaled (the strategy's ``grad_post``); each cut's factor makes its sum,
    times that, the mean."""
    base = prescale if topo.dp > 1 else 1.0

    def cut(axis: str) -> Cut:
        size, rank = topo.size(axis), topo.rank(axis)
        return Cut(axis, size, rank, size if sharded else 1, base * topo.dp / size)

    parts = []
    for i, group in enumerate(groups):
        options = {k: v for k, v in group.items() if k != "params"}
        params = list(group["params"])
        split = [
            ("dp", [p for p in params if p not in shared]),
            ("dp_ep", [p for p in params if p in shared]),
        ]
        for axis, mine in [(a, ps) for a, ps in split if ps] or [("dp", params)]:
            parts.append((i, options, cut(axis), mine))
    return parts


@dataclass
class BucketState:
    group: int
    bucket: Bucket
    master: nn.Parameter
    staging: torch.Tensor | None = None  # stage 2: the bucket's full gradients, until reduced
    piece: torch.Tensor | None = None  # stages 1-2: this rank's reduced piece, until consumed
    shard_clean: bool = True  # stage 2: its part of the gradient shard is zero since the step
    # (start, end, param) of each parameter's elements inside ``master``
    segments: list[tuple[int, int, nn.Parameter]] = field(default_factory=list)
    host_grad: torch.Tensor | None = None  # offload: the fp32 gradient piece, in host memory
    updated: torch.Tensor | None = None  # nvme: the stepped piece in the compute dtype
    # (param, its range in the group's flat buffer) of each parameter in the bucket
    ranges: list[tuple[nn.Parameter, slice]] = field(default_factory=list)

    @classmethod
    def build(cls, g: int, bucket: Bucket, master: nn.Parameter, lo: int, hi: int, fg):
        """Bucket ``bucket`` of group ``g``, whose master holds ``[lo, hi)`` of the flat buffer."""
        st = cls(g, bucket, master)
        for pos in bucket.slots:
            slot = fg.layout.slots[pos]
            p = fg.params[slot.index]
            st.ranges.append((p, slice(slot.offset, slot.end)))
            a, b = max(slot.offset, lo), min(slot.end, hi)
            if a < b:
                st.segments.append((a - lo, b - lo, p))
        return st


@dataclass
class FlatGroup:
    """One optimizer group: its parameters and buffers."""

    params: list[nn.Parameter]
    options: dict
    layout: FlatLayout
    params_flat: torch.Tensor
    grads_flat: torch.Tensor | None  # stages 0-1
    grad_shard: torch.Tensor | None  # stage 2, in the accumulation dtype (fp32 by default)
    cut: Cut = Cut()
    buckets: list[int] = field(default_factory=list)  # indices into ShardedDataParallel.buckets

    @classmethod
    def build(
        cls,
        params: list[nn.Parameter],
        options: dict,
        layout: FlatLayout,
        *,
        comm: Comm,
        cut: Cut,
        dtype: torch.dtype,
        device: torch.device,
        grad_shard_device: torch.device | None,
        grad_dtype: torch.dtype,
        pieces: list[tuple[int, int]],
        master_for,
    ) -> tuple[FlatGroup, list[torch.Tensor]]:
        """The group's buffers, its parameters made views of them, and the fp32 masters of
        ``pieces`` (this rank's ``[lo, hi)`` of each bucket, the values of rank 0 of the
        ``cut``'s axis).

        Parameter by parameter, so the start costs little more than the steady state (not a
        whole fp32 copy of the model beside the model and its 16-bit buffer): each value is
        broadcast from that rank in fp32, written into the masters it overlaps and, cast, into
        the parameter buffer, whose view then replaces the parameter (its own storage goes).
        ``master_for(numel)`` makes a zeroed master (where it lives: the device, or pinned host
        memory when offloaded); in fp32 without offload the master is a view of the parameter
        buffer itself (None). Gradients, in ``grad_dtype``: a full flat buffer (whose views are
        the parameters' ``.grad`` when it is in ``dtype``), or, given ``grad_shard_device``, a
        shard there (stage 2), made once the parameters' own storage is gone."""
        params_flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        masters = [master_for(hi - lo) for lo, hi in pieces]
        bucket_of = {pos: b for b, bucket in enumerate(layout.buckets) for pos in bucket.slots}
        for pos, slot in enumerate(layout.slots):
            p = params[slot.index]
            dst = params_flat[slot.offset : slot.end]
            # In fp32, broadcast in the buffer itself: a collective's worker thread may hold its
            # tensor a while after the wait returns (gloo does), and the buffer stays anyway.
            # Otherwise the value goes in fp32 too (an fp32 parameter already on the device
            # as it is, its own storage going next).
            if dtype == torch.float32:
                value = dst.copy_(p.detach().reshape(-1))
            else:
                value = p.detach().reshape(-1).to(device=device, dtype=torch.float32)
            if cut.size > 1:
                comm.broadcast(value, src=0, axis=cut.axis)
            if value is not dst:
                dst.copy_(value)
            lo, hi = pieces[bucket_of[pos]]
            a, b = max(slot.offset, lo), min(slot.end, hi)
            master = masters[bucket_of[pos]]
            if a < b and master is not None:
                master[a - lo : b - lo].copy_(value[a - slot.offset : b - slot.offset])
            p.data = params_flat[slot.offset : slot.end].view(slot.shape)
            del value
        masters = [
            params_flat[lo:hi] if m is None else m
            for m, (lo, hi) in zip(masters, pieces, strict=True)
        ]
        grads_flat = grad_shard = None
        if grad_shard_device is None:
            grads_flat = torch.zeros(layout.padded_numel, dtype=grad_dtype, device=device)
        else:
            shard = layout.shard_numel
            grad_shard = torch.zeros(shard, dtype=grad_dtype, device=grad_shard_device)
        for slot in layout.slots:
            p = params[slot.index]
            # autograd sums into the buffer itself when it is in the parameters' dtype
            as_grad = grads_flat is not None and grad_dtype == dtype
            p.grad = grads_flat[slot.offset : slot.end].view(slot.shape) if as_grad else None
        return cls(params, options, layout, params_flat, grads_flat, grad_shard, cut), masters
