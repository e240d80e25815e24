"""A small GPT (nanoGPT-shaped): byte tokens, learned positions, pre-norm blocks, tied head.

``GPT(cfg)(idx)`` returns logits; ``GPT(cfg)(idx, targets)`` returns the mean cross-entropy,
computed in fp32 whatever the compute dtype, so fp16/bf16 runs report comparable losses::

    model = GPT(GPTConfig(n_layer=2, d_model=64, n_head=4, block_size=64))
    loss = model(x, y)

Tensor-parallel from the same config (Megatron's split: attention heads and the MLP's hidden
features across the tp ranks, a vocabulary-split embedding tied to the head, the loss computed
on vocabulary-split logits), optionally with sequence parallelism::

    model = GPT(cfg, topology=topo, sequence_parallel=True)    # or GPT(cfg).parallelize(topo)

On a grid with Ulysses sequence parallelism (``Topology.build(sp=2)``) each rank runs on its
shard of the sequence and attention exchanges sequence shards for head shards
(:class:`~zerostack.sequence.DistributedAttention`); heads must divide by tp * sp.

The model is built whole and each rank keeps its slices, so with the same seed the shards are
exactly the slices of the plain model (``split_state_dict`` / ``join_state_dicts`` in
:mod:`.gpt_tp` convert between the two).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import functional as cf
from ..comm.grid import comm_for
from ..config import ConfigError
from ..sequence import DistributedAttention, ring_attention, sequence_piece
from ..tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    ensure_seeded,
    gather_from_tp,
    get_rng_tracker,
    vocab_parallel_cross_entropy,
)
from ..topology import Topology
from ..zero.stage3.params import is_sharded
from .gpt_tp import PositionShards, check_tp_split, parallelize_block, sp_norm


@dataclass
class GPTConfig:
    vocab_size: int = 256
    """Byte-level vocabulary: every UTF-8 byte is a token, no tokenizer needed."""
    block_size: int = 64
    """Longest sequence the position embedding covers."""
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    dropout: float = 0.0
    bias: bool = True
    checkpoint_every: int = 0
    """Activation checkpointing: run each ``checkpoint_every`` consecutive blocks through
    ``zerostack.activation_checkpointing.checkpoint`` (their input kept, the rest recomputed in
    backward); 0 = off."""
    moe_every: int = 0
    """Mixture of experts: every ``moe_every``-th block (the last of each run of that many)
    replaces its MLP with a :class:`zerostack.moe.MoE` of ``num_experts`` MLPs; 0 = none."""
    num_experts: int = 1
    moe_k: int = 1
    """Experts per token: top-1 or top-2 gating."""
    moe_capacity_factor: float = 1.0
    """Slots per expert, as a multiple of tokens / experts (DeepSpeed's capacity_factor); the
    same for evaluation."""
    moe_min_capacity: int = 4
    moe_drop_tokens: bool = True
    moe_use_rts: bool = False
    """Random token selection when an expert overflows (DeepSpeed's default is True; off here,
    so an overflowing expert keeps its first tokens, deterministically)."""
    moe_aux_loss_coef: float = 0.01
    """Weight of the summed load-balancing losses in the returned loss."""
    moe_ep_size: int = 1
    """Expert-parallel ranks: each holds num_experts / moe_ep_size of every MoE block's
    experts."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.moe_every < 0:
            raise ValueError(f"moe_every must be >= 0, got {self.moe_every}")
        if self.moe_every and self.checkpoint_every:
            raise ValueError("moe_every does not combine with checkpoint_every yet")

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` (from 0) is a mixture-of-experts block."""
        return self.moe_every > 0 and (layer + 1) % self.moe_every == 0

    @property
    def num_params(self) -> int:
        """Parameters counted once (the tied head adds none)."""
        d, L, b = self.d_model, self.n_layer, int(self.bias)
        per_block = 2 * (d + d * b) + (3 * d * d + 3 * d * b) + (d * d + d * b)
        mlp = (4 * d * d + 4 * d * b) + (4 * d * d + d * b)
        per_block += mlp
        moe_blocks = sum(self.is_moe(i) for i in range(L))  # E experts and a gate, not one MLP
        experts = moe_blocks * ((self.num_experts - 1) * mlp + d * self.num_experts)
        return self.vocab_size * d + self.block_size * d + L * per_block + (d + d * b) + experts


class InitLinear(nn.Linear):
    """``nn.Linear`` with GPT-2's init: normal(0, std) weights and zero biases.

    The init runs inside the constructor, not in a pass over the finished model, so a model built
    under ``zerostack.zero.Init`` (which shards each module as its outermost constructor returns)
    gets exactly the values of one built whole.
    """

    def __init__(self, d_in: int, d_out: int, *, bias: bool, std: float) -> None:
        super().__init__(d_in, d_out, bias=bias)
        with torch.no_grad():
            nn.init.normal_(self.weight, mean=0.0, std=std)
            if self.bias is not None:
                nn.init.zeros_(self.bias)


class InitEmbedding(nn.Embedding):
    """``nn.Embedding`` with normal(0, 0.02) weights, initialised in the constructor."""

    def __init__(self, n: int, d: int) -> None:
        super().__init__(n, d)
        with torch.no_grad():
            nn.init.normal_(self.weight, mean=0.0, std=0.02)


def _linear(cfg: GPTConfig, d_in: int, d_out: int, *, residual: bool = False) -> InitLinear:
    # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer) so the stream keeps variance ~1.
    std = 0.02 / math.sqrt(2 * cfg.n_layer) if residual else 0.02
    return InitLinear(d_in, d_out, bias=cfg.bias, std=std)


def _split_rng(split: bool):
    """Dropout on tp-split data (a rank's heads, a sequence shard) draws a mask per tp rank."""
    return get_rng_tracker().fork() if split else contextlib.nullcontext()


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head  # heads on this rank: n_head / tp once parallelized
        self.head_dim = cfg.d_model // cfg.n_head
        self.qkv = _linear(cfg, cfg.d_model, 3 * cfg.d_model)
        self.proj = _linear(cfg, cfg.d_model, cfg.d_model, residual=True)
        self.dropout = cfg.dropout
        self.heads_split = False  # set by GPT.parallelize
        self.sequence_parallel = False
        self.ulysses: DistributedAttention | None = None  # set by GPT.parallelize when sp > 1
        self.ring: cf.Axis | None = None  # and this when ring > 1: _attend is ring attention

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over ``[b, t, heads, head_dim]`` inputs, in the same layout."""
        p = self.dropout if self.training else 0.0
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        if self.ring is not None:  # over the ring's zigzag shards (no dropout: refused)
            return ring_attention(q, k, v, self.ring).transpose(1, 2)
        with _split_rng(self.heads_split and p > 0):
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return y.transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = self.n_head * self.head_dim
        # the full sequence under Megatron's sequence parallelism, even when x is a shard;
        # this rank's sequence shard under Ulysses
        q, k, v = self.qkv(x).split(width, dim=2)
        b, t = q.shape[:2]
        q, k, v = (z.view(b, t, self.n_head, self.head_dim) for z in (q, k, v))
        y = (self._attend if self.ulysses is None else self.ulysses)(q, k, v)
        y = y.contiguous().view(b, t, width)
        p = self.dropout if self.training else 0.0
        with _split_rng(self.sequence_parallel and p > 0):
            return F.dropout(self.proj(y), p, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = _linear(cfg, cfg.d_model, 4 * cfg.d_model)
        self.proj = _linear(cfg, 4 * cfg.d_model, cfg.d_model, residual=True)
        self.dropout = cfg.dropout
        self.sequence_parallel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(F.gelu(self.fc(x)))
        with _split_rng(self.sequence_parallel and self.training and self.dropout > 0):
            return F.dropout(y, self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, *, moe: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.l_aux: torch.Tensor | None = None  # the last forward's load-balancing loss (MoE)
        if moe:
            from ..moe import MoE

            self.mlp = MoE(
                cfg.d_model,
                MLP(cfg),
                num_experts=cfg.num_experts,
                ep_size=cfg.moe_ep_size,
                k=cfg.moe_k,
                capacity_factor=cfg.moe_capacity_factor,
                eval_capacity_factor=cfg.moe_capacity_factor,
                min_capacity=cfg.moe_min_capacity,
                drop_tokens=cfg.moe_drop_tokens,
                use_rts=cfg.moe_use_rts,
                top2_2nd_expert_sampling=False,
            )
        else:
            self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        y = self.mlp(self.ln2(x))
        if isinstance(y, tuple):  # MoE: (output, l_aux, exp_counts)
            y, self.l_aux, _ = y
        return x + y


class GPT(nn.Module):
    def __init__(
        self, cfg: GPTConfig, *, topology: Topology | None = None, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.topology: Topology | None = None  # set by parallelize
        self.sequence_parallel = False
        self.wte = InitEmbedding(cfg.vocab_size, cfg.d_model)
        self.wpe = InitEmbedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, moe=cfg.is_moe(i)) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        # Tied: one parameter, two uses. Built on "meta" so no weight is allocated only to be
        # thrown away (it would also cost a whole vocab x d_model matrix under zero.Init).
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, device="meta")
        self.head.weight = self.wte.weight
        if topology is not None:
            self.parallelize(topology, sequence_parallel=sequence_parallel)

    def parallelize(self, topology: Topology, *, sequence_parallel: bool = False) -> GPT:
        """Keep this rank's tp slices of every split layer (in place); returns the model."""
        cfg = self.cfg
        if self.topology is not None:
            raise ValueError("GPT.parallelize: the model is already tensor-parallel")
        if any(is_sharded(p) for p in self.parameters()):
            raise ValueError(
                "GPT.parallelize: tensor parallelism with zero.Init is not supported yet; "
                "build the model without zero.Init (ZeRO stage 3 shards it at initialize)"
            )
        check_tp_split(cfg, topology)
        if sequence_parallel and topology.sp > 1:
            raise ConfigError(
                f"GPT sequence_parallel (Megatron's) with sequence_parallel_size {topology.sp} "
                "(Ulysses or ring attention): both split the sequence, so choose one"
            )
        ensure_seeded(topology)
        sp = dict(topology=topology, sequence_parallel=sequence_parallel)
        self.wte = VocabParallelEmbedding.from_embedding(self.wte, **sp)
        self.head = ColumnParallelLinear.from_linear(self.head, **sp)
        self.head.weight = self.wte.weight
        if sequence_parallel:
            pos = PositionShards(cfg.block_size, cfg.d_model)
            pos.weight = self.wpe.weight
            pos.topology = topology
            self.wpe = pos
        for block in self.blocks:
            parallelize_block(block, topology, sequence_parallel=sequence_parallel)
        self.ln_f = sp_norm(self.ln_f, topology, sequence_parallel)
        self.topology, self.sequence_parallel = topology, sequence_parallel
        return self

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        b, t = idx.shape
        topo = self.topology
        sp = topo.sp if topo is not None else 1  # Ulysses: idx is this rank's sequence shard
        if t * sp > self.cfg.block_size:
            raise ValueError(f"sequence length {t * sp} exceeds block_size {self.cfg.block_size}")
        if sp > 1:
            whole = torch.arange(t * sp, device=idx.device)
            pos = sequence_piece(whole, 0, topo.rank("sp"), sp, topo.ring)
        elif self.sequence_parallel:
            if t % topo.tp:
                raise ValueError(
                    f"sequence length {t} does not split into {topo.tp} tp ranks "
                    "(sequence_parallel)"
                )
            n = t // topo.tp
            pos = torch.arange(topo.rank("tp") * n, (topo.rank("tp") + 1) * n, device=idx.device)
        else:
            pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        every = self.cfg.checkpoint_every
        if every > 0 and torch.is_grad_enabled():
            from .. import activation_checkpointing as checkpointing  # imports tensor_parallel

            if self.sequence_parallel and checkpointing.settings().partitions:
                raise ValueError(
                    "GPT: activation_checkpointing.partition_activations does not combine with "
                    "sequence_parallel (a block's input is already this rank's sequence shard)"
                )

            def run(x: torch.Tensor, blocks: list[nn.Module]) -> torch.Tensor:
                for block in blocks:
                    x = block(x)
                return x

            blocks = list(self.blocks)
            for i in range(0, len(blocks), every):
                x = checkpointing.checkpoint(run, x, blocks[i : i + every])
        else:
            for block in self.blocks:
                x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits if topo is None else gather_from_tp(logits, comm_for(topo))
        if topo is None:
            loss = F.cross_entropy(logits.float().flatten(0, -2), targets.reshape(-1))
        else:
            loss = vocab_parallel_cross_entropy(logits, targets, comm_for(topo)).mean()
        if self.cfg.moe_every:  # the load-balancing losses of this forward's MoE blocks
            aux = sum(b.l_aux for b in self.blocks if b.l_aux is not None)
            if self.sequence_parallel:  # each tp rank's is its part of the sequence's: the mean
                aux = aux / topo.tp
            loss = loss + self.cfg.moe_aux_loss_coef * aux
        return loss
