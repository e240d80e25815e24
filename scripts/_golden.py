"""What the golden scripts share: their JSON written to ``--write``'s path, else printed, and
the tiny model two of them train under DeepSpeed and zerostack alike."""

from __future__ import annotations

import json

import torch
from torch import nn


def emit(out: dict, path: str | None) -> int:
    """Write ``out`` as indented JSON to ``path`` (print it when None); the exit status."""
    text = json.dumps(out, indent=1)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


class TinyNet(nn.Module):
    """Embedding, one attention block with layer norms, an MLP, a head and the loss."""

    def __init__(self, width: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.width, self.vocab = width, vocab
        self.embed = nn.Embedding(vocab, width)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        att = (q @ k.transpose(-1, -2) / self.width**0.5).softmax(-1)
        x = x + self.proj(att @ v)
        x = x + self.down(nn.functional.gelu(self.up(self.norm2(x))))
        logits = self.head(x)
        targets = ids[:, 1:].reshape(-1)
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, self.vocab), targets)
