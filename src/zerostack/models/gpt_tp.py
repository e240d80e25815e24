"""The reference GPT under tensor and sequence parallelism: how a block splits across the tp
ranks (heads, MLP features; Ulysses heads across sp), how a parameter of the plain model is cut
(:func:`tp_spec`), and a plain state dict split into tp ranks' and joined back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import functional as cf
from ..comm.grid import comm_for
from ..config import ConfigError
from ..moe import MoE
from ..sequence import DistributedAttention
from ..tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    copy_to_tp,
    join_tensors,
    split_tensor,
)
from ..topology import Topology

if TYPE_CHECKING:
    from .gpt import Block, GPTConfig


def check_tp_split(cfg: GPTConfig, topology: Topology) -> None:
    tp, sp = topology.tp, topology.ulysses  # the ring ranks keep every head
    if cfg.n_head % tp:
        raise ValueError(f"GPT: n_head {cfg.n_head} does not split into {tp} tp ranks")
    if cfg.n_head % (tp * sp):
        what = "sp" if topology.ring == 1 else "Ulysses ranks (sp / ring)"
        raise ValueError(
            f"sequence_parallel_size: GPT's n_head {cfg.n_head} does not split into "
            f"tp * {what} = {tp} * {sp} head shards"
        )
    if topology.ring > 1 and cfg.dropout > 0:
        raise ConfigError(
            f"ring_parallel_size {topology.ring} with GPT dropout {cfg.dropout}: ring attention "
            "has no attention dropout, so set dropout to 0"
        )
    if cfg.vocab_size % tp:
        raise ValueError(f"GPT: vocab_size {cfg.vocab_size} does not split into {tp} tp ranks")


def sp_norm(ln: nn.LayerNorm, topology: Topology, sequence_parallel: bool) -> nn.LayerNorm:
    """The layer norm as it runs on sequence shards (itself without sequence parallelism)."""
    if not sequence_parallel:
        return ln
    return SequenceParallelLayerNorm.from_layer_norm(ln, topology=topology)


def parallelize_block(block: Block, topology: Topology, *, sequence_parallel: bool) -> None:
    """Split a block's attention heads and MLP features across the tp ranks (in place)."""
    sp = dict(topology=topology, sequence_parallel=sequence_parallel)
    block.ln1 = sp_norm(block.ln1, topology, sequence_parallel)
    block.ln2 = sp_norm(block.ln2, topology, sequence_parallel)
    attn, mlp = block.attn, block.mlp
    attn.qkv = ColumnParallelLinear.from_linear(attn.qkv, chunks=3, **sp)
    attn.proj = RowParallelLinear.from_linear(attn.proj, **sp)
    attn.n_head //= topology.tp
    attn.heads_split = topology.tp > 1
    attn.sequence_parallel = sequence_parallel
    if not isinstance(mlp, MoE):  # a MoE block's experts stay whole: replicated over tp
        mlp.fc = ColumnParallelLinear.from_linear(mlp.fc, **sp)
        mlp.proj = RowParallelLinear.from_linear(mlp.proj, **sp)
        mlp.sequence_parallel = sequence_parallel
    elif sequence_parallel and topology.tp > 1:
        sum_grads_over_tp(mlp, topology)
    if topology.ring > 1:  # the keys and values of the ring shards pass around
        attn.ring = cf.on_axis(comm_for(topology), "ring")
    if topology.ulysses > 1:  # [b, t, heads, head_dim], heads scattered, sequence gathered
        attn.ulysses = DistributedAttention(attn._attend, topology, scatter_idx=2, gather_idx=1)


def sum_grads_over_tp(module: nn.Module, topology: Topology) -> None:
    """Under Megatron's sequence parallelism a MoE block runs on this tp rank's part of the
    sequence: each tp rank routes its own tokens (gating them apart, as Ulysses ranks do) to
    the experts, which are replicated over tp. The gate's and the experts' gradients then see
    only those tokens, so a hook sums them over tp, as the layer norms' are summed
    (:func:`copy_to_tp`): every tp rank gets the whole sequence's gradient."""
    comm = comm_for(topology)

    def summed(grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone()
        comm.all_reduce(out, axis="tp")
        return out

    for p in module.parameters():
        if p.requires_grad:
            p.register_hook(summed)


class PositionShards(nn.Embedding):
    """The position table under sequence parallelism: replicated, looked up for this rank's
    part of the sequence, so its gradient is all-reduced over tp."""

    topology: Topology

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return F.embedding(pos, copy_to_tp(self.weight, comm_for(self.topology)))


def tp_spec(name: str) -> tuple[int, int] | None:
    """How parameter ``name`` of the GPT is split under tp: ``(dim, chunks)``, None if whole."""
    if name in ("wte.weight", "head.weight") or name.endswith((".mlp.fc.weight", ".mlp.fc.bias")):
        return 0, 1
    if name.endswith((".attn.qkv.weight", ".attn.qkv.bias")):
        return 0, 3
    if name.endswith((".attn.proj.weight", ".mlp.proj.weight")):
        return 1, 1
    return None


def split_state_dict(state: dict[str, torch.Tensor], tp: int) -> list[dict[str, torch.Tensor]]:
    """A plain GPT's state dict as the ``tp`` state dicts of its tensor-parallel ranks."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name, t in state.items():
        spec = tp_spec(name)
        for r in range(tp):
            out[r][name] = (
                t.clone()
                if spec is None
                else split_tensor(t, parts=tp, rank=r, dim=spec[0], chunks=spec[1])
            )
    return out


def join_state_dicts(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The plain GPT's state dict from its tp ranks' state dicts (in tp-rank order)."""
    out = {}
    for name in shards[0]:
        spec = tp_spec(name)
        parts = [s[name] for s in shards]
        out[name] = (
            parts[0].clone() if spec is None else join_tensors(parts, dim=spec[0], chunks=spec[1])
        )
    return out
