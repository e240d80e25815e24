"""The one owner of ZeRO stage 0-2 state: the flat groups, their buckets and the parameter index.

Modelled on Megatron-Core's ``_ParamAndGradBuffer`` (the buffer owns its buckets and the map
from each parameter to its place in them). :class:`FlatBuffers` builds each flat group's
buffers (:class:`~.params.FlatGroup`) and each bucket's state
(:class:`~.params.BucketState`), and answers where a parameter is (:meth:`locate`). The
gradient buffer (:mod:`.grads`), the write-back (:mod:`.write_back`) and the checkpoint
(:mod:`.checkpoint`) are each given it; none of them reads the strategy. The words
(flat group, bucket, piece, cut, master) are defined in :mod:`zerostack.zero`'s vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm import Comm
from ...core import scratch
from ...core.pinned import host_zeros
from ...core.precision import Precision
from ..offload.host import HostOffload, host_device
from ..partition import FlatLayout
from .params import BucketState, Cut, FlatGroup, flat_parts


class FlatBuffers:
    """The flat groups of one model's optimizer groups (``groups``), the buckets they are cut
    into (``buckets``, in launch order), which flat groups each optimizer group became
    (``of_group``), the parameter index (:meth:`locate`), and the pool of bucket-sized scratch
    buffers one backward or step borrows (``pool``).

    ``sharded``: masters and optimizer state cut over each flat group's ranks (stages 1-2);
    ``shard_grads``: the window's gradients held as this rank's shard (stage 2), in host memory
    when ``host`` offloads the optimizer."""

    def __init__(
        self,
        groups: list[dict],
        *,
        comm: Comm,
        precision: Precision,
        stage: int,
        sharded: bool,
        shard_grads: bool,
        bucket_numel: int,
        prescale: float,
        host: HostOffload,
        device: torch.device,
        sub_group_numel: int | None = None,
        shared: set[nn.Parameter] | frozenset = frozenset(),
    ) -> None:
        self.reduce_dtype = precision.reduce_dtype
        self.accum_dtype = precision.accum_dtype(stage)
        self.pool = scratch.Pool()  # bucket-sized buffers of one backward, or one step
        self.groups: list[FlatGroup] = []
        self.buckets: list[BucketState] = []
        # param -> (bucket index, its range in the group's flat buffer)
        self._index: dict[nn.Parameter, tuple[int, slice]] = {}
        self.of_group: list[list[int]] = [[] for _ in groups]
        dtype = precision.compute_dtype
        # a sharded buffer keeps gradient pieces (on the host when offloaded), else full ones
        shard_device = host_device() if host.offloads else device
        shard_device = shard_device if shard_grads else None

        master_dtype = precision.master_dtype  # fp32, or 16 bits (*_master_weights_and_grads)

        def master_for(numel: int) -> torch.Tensor | None:
            """A zeroed master in the masters' dtype: in host memory when offloaded (pinned if
            asked and a GPU is there), else on the device; None where the master is the
            parameter buffer's own piece (the same dtype, not offloaded)."""
            if host.offloads:
                return host_zeros(numel, master_dtype, host.pin)
            if dtype == master_dtype:
                return None
            return torch.zeros(numel, dtype=master_dtype, device=device)  # padding stays 0

        parts = flat_parts(groups, shared, comm.topo, sharded=sharded, prescale=prescale)
        for g, (i, options, fcut, params) in enumerate(parts):
            self.of_group[i].append(g)
            numel = bucket_numel
            if host.device == "nvme" and sub_group_numel:
                # a rank's piece of a bucket is one sub-group: the unit swapped with the disk
                numel = min(bucket_numel, sub_group_numel * fcut.world)
            layout = FlatLayout.build(
                [tuple(p.shape) for p in params], world=fcut.world, bucket_numel=numel
            )
            pieces = [layout.piece(bucket, fcut.piece_rank) for bucket in layout.buckets]
            fg, masters = FlatGroup.build(
                params,
                options,
                layout,
                comm=comm,
                cut=fcut,
                dtype=dtype,
                device=device,
                grad_shard_device=shard_device,
                grad_dtype=self.accum_dtype,
                pieces=pieces,
                master_for=master_for,
            )
            for bucket, (lo, hi), master in zip(layout.buckets, pieces, masters, strict=True):
                fg.buckets.append(len(self.buckets))
                st = BucketState.build(g, bucket, nn.Parameter(master), lo, hi, fg)
                self._index.update({p: (len(self.buckets), rng) for p, rng in st.ranges})
                self.buckets.append(st)
            self.groups.append(fg)

        # what the pool keeps between steps: one bucket's staged gradients (DeepSpeed keeps one
        # bucket-sized buffer too); a step's other buffers come back to the system at its end
        biggest = max((st.bucket.numel for st in self.buckets), default=0)
        self.rest_bytes = biggest * self.reduce_dtype.itemsize
        # fixed by the flat groups' cuts, read in every gradient hook and every step: whether
        # any gradient is summed over other ranks (not at dp 1 without ep), whether each rank
        # holds another part of the gradients (the norm needs a sum), and what every ep rank
        # holds cut over dp x ep (each rank counts and saves its own piece of it)
        self.reduces = any(fg.cut.size > 1 for fg in self.groups)
        self.grads_sharded = any(fg.cut.world > 1 for fg in self.groups)
        self.cut_over_ep = {
            p
            for fg in self.groups
            if fg.cut.world > 1 and fg.cut.axis == "dp_ep"
            for p in fg.params
        }

    # ------------------------------------------------------------------ the parameter index
    def __contains__(self, p: nn.Parameter) -> bool:
        """Whether ``p`` is in a flat group (the optimizer trains it)."""
        return p in self._index

    def params(self) -> list[nn.Parameter]:
        """Every parameter in a flat group, in the order the groups were built."""
        return list(self._index)

    def locate(self, p: nn.Parameter) -> tuple[int, slice]:
        """``(bucket index, p's range in its group's flat buffer)``."""
        return self._index[p]

    def group_of(self, st: BucketState) -> FlatGroup:
        """The flat group bucket ``st`` is part of."""
        return self.groups[st.group]

    def cut_of(self, st: BucketState) -> Cut:
        """Where bucket ``st``'s gradients are summed and its state is cut."""
        return self.groups[st.group].cut

    def state_axis(self, p: nn.Parameter) -> str | None:
        """The axis over which ``p``'s master is cut, None where every rank holds it whole."""
        b, _ = self._index[p]
        fcut = self.groups[self.buckets[b].group].cut
        return fcut.axis if fcut.world > 1 else None

    # ------------------------------------------------------------------ the optimizer's view
    def masters(self) -> list[nn.Parameter]:
        """Each bucket's fp32 master (this rank's piece of it), in bucket order."""
        return [st.master for st in self.buckets]

    def optimizer_groups(self) -> list[dict]:
        """Per optimizer group, the masters of its flat groups' buckets, with its options."""
        out = []
        for flats in self.of_group:
            masters = [self.buckets[b].master for g in flats for b in self.groups[g].buckets]
            out.append({"params": masters, **self.groups[flats[0]].options})
        return out

    def group_params(self) -> list[list[nn.Parameter]]:
        """Each optimizer group's trained parameters, in the group's order."""
        return [[p for g in flats for p in self.groups[g].params] for flats in self.of_group]
