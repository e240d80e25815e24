"""What ``initialize`` checks of a model at sequence parallelism (sp > 1): that its attention
exchanges sequence shards over the grid's sp ranks (Ulysses' all-to-alls, ring attention, or
Hugging Face attention registered by ``UlyssesSPAttentionHF``), else each rank would attend
within its own shard, silently."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..comm.functional import Axis
from ..config import ConfigError
from ..topology import Topology
from .hf_ulysses import registered_ulysses
from .layer import DistributedAttention


def wires_sequence(model: nn.Module, topo: Topology, built: Topology | None) -> bool:
    """sp > 1 needs attention that exchanges sequence shards: DistributedAttention layers on
    this grid, or a plain model whose ``parallelize(topology)`` wires them (True: call it);
    else each rank would attend within its own shard, silently. Ring attention (a module's
    ``ring`` axis, as the GPT's attention has) counts as such layers too."""
    rings = {m.ring.size for m in model.modules() if isinstance(getattr(m, "ring", None), Axis)}
    if rings - {topo.ring}:
        raise ConfigError(f"ring_parallel_size: the model's ring attention runs over "
                          f"{sorted(rings)} ranks, the grid has ring {topo.ring}")
    layers = [m for m in model.modules() if isinstance(m, DistributedAttention)]
    if rings and topo.ulysses == 1:
        return False
    if layers:
        for m in layers:
            if isinstance(m.spg, Topology) and m.spg.sp != topo.sp:
                raise ConfigError(
                    f"sequence_parallel_size: the model's DistributedAttention was built for sp "
                    f"{m.spg.sp}, the grid has sp {topo.sp}"
                )
        return False
    if built is None and callable(getattr(model, "parallelize", None)):
        return True
    hf = registered_ulysses(model)  # a Hugging Face model under UlyssesSPAttentionHF
    if hf is not None:
        theirs = dist.get_process_group_ranks(hf.sequence_group)
        ours = dist.get_process_group_ranks(topo.group("sp"))
        if sorted(theirs) != sorted(ours):
            raise ConfigError(
                f"sequence_parallel_size: the model's Ulysses attention exchanges over ranks "
                f"{sorted(theirs)}, the grid's sp group is {sorted(ours)}; pass "
                "initialize(mpu=...) the mpu register_with_transformers returned"
            )
        return False
    if isinstance(getattr(getattr(model, "config", None), "_attn_implementation", None), str):
        raise ConfigError(
            f"sequence_parallel_size: {topo.sp} needs a model whose attention exchanges sequence "
            "shards: for a Hugging Face model, call UlyssesSPAttentionHF.register_with_transformers"
            " (deepspeed.runtime.sequence_parallel.ulysses_sp) before initialize and pass it mpu="
        )
    raise ConfigError(
        f"sequence_parallel_size: {topo.sp} needs a model whose attention exchanges sequence "
        "shards: zerostack.sequence.DistributedAttention layers, or a model with a "
        "parallelize(topology) method (zerostack.models.GPT)"
    )
