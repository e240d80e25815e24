"""A small GPT (nanoGPT-shaped): byte tokens, learned positions, pre-norm blocks, tied head.

``GPT(cfg)(idx)`` returns logits; ``GPT(cfg)(idx, targets)`` returns the mean cross-entropy,
computed in fp32 whatever the compute dtype, so fp16/bf16 runs report comparable losses::

    model = GPT(GPTConfig(n_layer=2, d_model=64, n_head=4, block_size=64))
    loss = model(x, y)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")

    @property
    def num_params(self) -> int:
        """Parameters counted once (the tied head adds none)."""
        d, L, b = self.d_model, self.n_layer, int(self.bias)
        per_block = 2 * (d + d * b) + (3 * d * d + 3 * d * b) + (d * d + d * b)
        per_block += (4 * d * d + 4 * d * b) + (4 * d * d + d * b)
        return self.vocab_size * d + self.block_size * d + L * per_block + (d + d * b)


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


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = _linear(cfg, cfg.d_model, 3 * cfg.d_model)
        self.proj = _linear(cfg, cfg.d_model, cfg.d_model, residual=True)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return F.dropout(self.proj(y), p, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = _linear(cfg, cfg.d_model, 4 * cfg.d_model)
        self.proj = _linear(cfg, 4 * cfg.d_model, cfg.d_model, residual=True)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(F.gelu(self.fc(x))), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = InitEmbedding(cfg.vocab_size, cfg.d_model)
        self.wpe = InitEmbedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        # Tied: one parameter, two uses. Built on "meta" so no weight is allocated only to be
        # thrown away (it would also cost a whole vocab x d_model matrix under zero.Init).
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, device="meta")
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        b, t = idx.shape
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
