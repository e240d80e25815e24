"""Tensor-parallel parameters made whole for a while: each rank's slices all-gathered over tp
and joined (:func:`~.layers.join_tensors`) into ``p.data``, then cut again on the way out.

RL frameworks send the trained weights to an inference engine between steps (OpenRLHF's
weight sync to vLLM, through DeepSpeed's ``GatherReplacedLayerParams``): inside
:func:`whole_tp`, a split parameter's ``.data`` is the whole tensor, as the unsplit model had it;
on leaving, each rank keeps its slice of what ``.data`` then holds (a value written inside is
kept, on the module's parameter: an engine's fp32 masters are the optimizer's and are not
touched, as in DeepSpeed).
"""

from __future__ import annotations

import contextlib

from torch import nn

from ..comm.grid import comm_for
from ..topology import Topology
from .layers import join_tensors, partition_spec, split_tensor


def tp_topology(module: nn.Module) -> Topology | None:
    """The grid the tensor-parallel layers of ``module`` were split over (None: none are)."""
    for m in module.modules():
        topo = getattr(m, "topology", None)
        if isinstance(topo, Topology) and topo.tp > 1:
            return topo
    return None


@contextlib.contextmanager
def whole_tp(params: list[nn.Parameter], topology: Topology):
    """Within, each tp-split one of ``params`` holds its whole value (see the module); a
    collective over tp on the way in and none on the way out."""
    from ..zero.stage3.params import is_sharded

    split = [p for p in params if partition_spec(p) is not None]
    if any(is_sharded(p) for p in split):
        raise ValueError(
            "whole tensor-parallel parameters: these are stage-3 pieces; gather them with "
            "zero.GatheredParameters"
        )
    comm, tp, rank = comm_for(topology), topology.tp, topology.rank("tp")
    for p in split:
        t = p.data.contiguous()
        parts = t.new_empty((tp, *t.shape))
        comm.all_gather(parts.view(-1), t.view(-1), axis="tp")
        dim, chunks = partition_spec(p)
        p.data = join_tensors(list(parts.unbind(0)), dim=dim, chunks=chunks)
    try:
        yield
    finally:
        for p in split:
            dim, chunks = partition_spec(p)
            p.data = split_tensor(p.data, parts=tp, rank=rank, dim=dim, chunks=chunks)


__all__ = ["tp_topology", "whole_tp"]
