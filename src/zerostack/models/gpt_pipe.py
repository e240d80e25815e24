"""The reference GPT as a pipeline layer list, and its weights to and from the plain GPT's.

    layers = gpt_layers(cfg, topology=topo)       # token embedding (tied to the head), blocks, ...
    model = PipelineModule(layers, topology=topo, loss_fn=GPTLoss(topo),
                           partition_method="type:Block")
    load_plain_state(model, GPT(cfg).state_dict(), cfg)  # the plain weights, this rank's part

Layer ``0`` is the token embedding (tie key ``"embed"``), ``1`` adds positions, ``2 .. L+1`` are
the blocks, ``L+2`` the final layer norm and ``L+3`` the head: the tied embedding used as a
(column-parallel) linear layer.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.grid import comm_for
from ..pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from ..sequence import sequence_piece
from ..tensor_parallel import (
    VocabParallelEmbedding,
    copy_to_tp,
    gather_linear_from_sp,
    split_tensor,
    vocab_parallel_cross_entropy,
)
from ..topology import Topology
from .gpt import Block, GPTConfig, InitEmbedding
from .gpt_tp import PositionShards, check_tp_split, parallelize_block, sp_norm, tp_spec


class TokenEmbedding(nn.Module):
    def __init__(self, cfg: GPTConfig, topology: Topology | None = None, sp: bool = False) -> None:
        super().__init__()
        self.wte = InitEmbedding(cfg.vocab_size, cfg.d_model)
        self.topology, self.sequence_parallel = topology, sp
        if topology is not None:
            check_tp_split(cfg, topology)
            self.wte = VocabParallelEmbedding.from_embedding(
                self.wte, topology=topology, sequence_parallel=sp
            )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx)


def head_forward(embedding: TokenEmbedding, x: torch.Tensor) -> torch.Tensor:
    """The tied embedding as the output layer: logits (vocabulary-split under tp)."""
    topo, weight = embedding.topology, embedding.wte.weight
    if topo is None:
        return F.linear(x, weight)
    if embedding.sequence_parallel and topo.tp > 1:
        return gather_linear_from_sp(x, weight, None, comm_for(topo))
    return F.linear(copy_to_tp(x, comm_for(topo)), weight)


class AddPositions(nn.Module):
    def __init__(self, cfg: GPTConfig, topology: Topology | None = None, sp: bool = False) -> None:
        super().__init__()
        self.wpe = InitEmbedding(cfg.block_size, cfg.d_model)
        self.topology, self.sequence_parallel = topology, sp
        if sp:
            pos = PositionShards(cfg.block_size, cfg.d_model)
            pos.weight, pos.topology = self.wpe.weight, topology
            self.wpe = pos

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]  # this rank's part of the sequence under sequence parallelism
        topo = self.topology
        if self.sequence_parallel:
            pos = torch.arange(topo.rank("tp") * n, (topo.rank("tp") + 1) * n, device=x.device)
        elif topo is not None and topo.sp > 1:  # Ulysses' (and the ring's) sequence shard
            whole = torch.arange(n * topo.sp, device=x.device)
            pos = sequence_piece(whole, 0, topo.rank("sp"), topo.sp, topo.ring)
        else:
            pos = torch.arange(n, device=x.device)
        return x + self.wpe(pos)


class PipeBlock(Block):
    """A block of the pipeline; a MoE one leaves ``moe_aux_loss_coef`` times its auxiliary loss
    as its ``side_loss``, which the executor adds to the loss (the GPT adds it to its own)."""

    def __init__(
        self, cfg: GPTConfig, topology: Topology | None = None, sp: bool = False, moe=False
    ) -> None:
        super().__init__(cfg, moe=moe)
        self.coef = cfg.moe_aux_loss_coef
        # Megatron's sequence parallelism: each tp rank's auxiliary loss is its part's (the mean)
        if sp and topology is not None:
            self.coef /= topology.tp
        self.side_loss: torch.Tensor | None = None
        if topology is not None:
            parallelize_block(self, topology, sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        self.side_loss = None if self.l_aux is None else self.coef * self.l_aux
        return x


class FinalNorm(nn.Module):
    def __init__(self, cfg: GPTConfig, topology: Topology | None = None, sp: bool = False) -> None:
        super().__init__()
        self.ln = sp_norm(nn.LayerNorm(cfg.d_model, bias=cfg.bias), topology, sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x)


class GPTLoss:
    """Mean next-token cross-entropy of (vocabulary-split) logits, in fp32."""

    def __init__(self, topology: Topology | None = None) -> None:
        self.topology = topology

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.topology is None or self.topology.tp == 1:
            return F.cross_entropy(logits.float().flatten(0, -2), targets.reshape(-1))
        return vocab_parallel_cross_entropy(logits, targets, comm_for(self.topology)).mean()


def gpt_layers(cfg: GPTConfig, topology: Topology | None = None, *, sequence_parallel=False):
    """The GPT as a layer list for :class:`~zerostack.pipeline.PipelineModule`."""
    tp = topology if topology is not None and topology.tp > 1 else None
    extra = (tp, sequence_parallel and tp is not None)
    # the blocks and the positions see Ulysses' sequence shards (sp > 1) even at tp 1
    grid = (topology if topology is not None and topology.sp > 1 else tp, extra[1])
    return [
        TiedLayerSpec("embed", TokenEmbedding, cfg, *extra, tied_weight_attr="wte.weight"),
        LayerSpec(AddPositions, cfg, *grid),
        *[LayerSpec(PipeBlock, cfg, *grid, moe=cfg.is_moe(i)) for i in range(cfg.n_layer)],
        LayerSpec(FinalNorm, cfg, *extra),
        TiedLayerSpec(
            "embed",
            TokenEmbedding,
            cfg,
            *extra,
            forward_fn=head_forward,
            tied_weight_attr="wte.weight",
        ),
    ]


def pipeline_name(name: str, cfg: GPTConfig) -> str:
    """The name a plain GPT parameter has in the pipeline module."""
    if name == "wte.weight":
        return "tied_modules.embed.wte.weight"
    if name == "wpe.weight":
        return "1.wpe.weight"
    if name.startswith("blocks."):
        _, i, rest = name.split(".", 2)
        return f"{2 + int(i)}.{rest}"
    if name.startswith("ln_f."):
        return f"{cfg.n_layer + 2}.ln.{name[5:]}"
    raise KeyError(f"{name}: not a parameter of the GPT")


def plain_name(name: str, cfg: GPTConfig) -> str:
    """The inverse of :func:`pipeline_name`."""
    if name == "tied_modules.embed.wte.weight":
        return "wte.weight"
    head, rest = name.split(".", 1)
    idx = int(head)
    if idx == 1:
        return "wpe.weight"
    if idx == cfg.n_layer + 2:
        return f"ln_f.{rest[3:]}"
    return f"blocks.{idx - 2}.{rest}"


def load_plain_state(model: PipelineModule, state: dict[str, torch.Tensor], cfg: GPTConfig):
    """Copy a plain GPT's weights into this rank's layers (its tp slice of split ones; at ep > 1
    its own experts: local expert l of ep rank r is expert r * experts / ep + l)."""
    topo = model.topology
    first = topo.rank("ep") * (cfg.num_experts // topo.ep)
    with torch.no_grad():
        for name, p in model.named_parameters():
            plain = plain_name(name, cfg)
            found = re.match(r"(.*deepspeed_experts\.)(\d+)(\..*)", plain)
            if found and topo.ep > 1:
                plain = f"{found[1]}{first + int(found[2])}{found[3]}"
            src = state[plain]
            spec = tp_spec(plain_name(name, cfg))
            if topo.tp > 1 and spec is not None:
                src = split_tensor(
                    src, parts=topo.tp, rank=topo.rank("tp"), dim=spec[0], chunks=spec[1]
                )
            p.copy_(src)


__all__ = [
    "GPTLoss",
    "PipelineModule",
    "gpt_layers",
    "load_plain_state",
    "pipeline_name",
    "plain_name",
]
