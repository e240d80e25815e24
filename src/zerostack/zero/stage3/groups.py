"""ZeRO stage 3's optimizer groups: each group's parameters, cut into sub-groups on NVMe, get
one fp32 master (this rank's pieces end to end) whose views the parameters keep as their piece,
master and gradient shard (see :mod:`.strategy`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...core.storage import same_storage
from ..offload.host import to_host


@dataclass
class Group:
    """A sub-group of one optimizer group's parameters (the whole group unless on NVMe)."""

    params: list[nn.Parameter]
    options: dict
    master: nn.Parameter  # fp32, this rank's pieces end to end
    pieces: torch.Tensor  # compute dtype (the master itself in fp32 training)
    grad_shard: torch.Tensor  # the accumulation dtype (fp32 by default)
    index: int = 0  # the optimizer group it belongs to

    @property
    def separate_master(self) -> bool:
        """Whether the fp32 master has storage of its own (not the pieces themselves, as in
        fp32 training with the pieces in memory)."""
        return self.pieces is None or not same_storage(self.pieces, self.master)


def sub_groups(params: list[nn.Parameter], limit: int | None) -> list[list[nn.Parameter]]:
    """Consecutive runs of parameters whose pieces add up to at most ``limit`` elements."""
    if not limit:
        return [params]
    out: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        n = p._zs.piece.numel()
        if out[-1] and size + n > limit:
            out.append([])
            size = 0
        out[-1].append(p)
        size += n
    return out


def make_group(
    params,
    options,
    index,
    *,
    dtype,
    pin,
    device,
    offload,
    swapper,
    grads,
    store,
    meter,
    master_dtype=torch.float32,
) -> Group:
    """One (sub-)group's master in ``master_dtype`` (fp32, or 16 bits: then, in memory, the
    compute-dtype pieces themselves): this rank's pieces of ``params`` end to end (on the host
    when ``offload`` is not "none"), its compute-dtype pieces and gradient shard as views each
    parameter keeps. ``swapper`` says where the pieces live, ``grads`` gives the shard where the
    fp32 gradients are summed, ``store`` keeps the master, ``meter`` counts the pieces."""
    swapped = [p for p in params if swapper.holds(p)]
    if swapped:
        swapper.fetch(swapped)
    swapped = set(swapped)
    total = sum(p._zs.piece.numel() for p in params) or 1
    master = torch.zeros(total, dtype=master_dtype, device=device)
    off = 0
    for p in params:
        pn = p._zs.piece.numel()
        master[off : off + pn].copy_(p._zs.piece)
        off += pn
    # The group's pieces, end to end; the per-parameter pieces they replace are freed.
    pieces = master if dtype == master.dtype else master.to(dtype)
    if offload != "none":
        master = to_host(master, pin)  # a host copy, separate even in fp32
    grad_shard = grads.shard_for(master)
    off = 0
    for p in params:
        st, pn = p._zs, p._zs.piece.numel()
        if p in swapped:  # back to its file, in the compute dtype
            swapper.rewrite(p, pieces[off : off + pn], dtype)
            st.master = st.grad = None
        else:
            st.piece, st.master = pieces[off : off + pn], master[off : off + pn]
            st.grad = None if grad_shard is None else grad_shard[off : off + pn]
        off += pn
    if swapped:
        pieces = None
    else:
        meter.track(pieces)
    group = Group(params, options, nn.Parameter(master), pieces, grad_shard, index)
    if not store.in_memory:
        for p in params:
            p._zs.master = None  # the master lives in a file now, not in views of it
    store.add(group.master)
    return group
