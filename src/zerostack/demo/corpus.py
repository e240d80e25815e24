"""The demo's corpus and a byte-level language-modelling dataset.

The corpus is the Book of Genesis, King James Version (public domain), 197 KB, taken from Debian's
``bible-kjv-text`` package with the verse numbers removed::

    train, val = corpus_datasets(block_size=64)
    x, y = train[0]          # int64 tensors of length 64; y is x shifted by one byte
"""

from __future__ import annotations

from importlib import resources

import torch
from torch.utils.data import Dataset

CORPUS_FILE = "genesis.txt"


def load_corpus() -> torch.Tensor:
    """The corpus as a 1-D int64 tensor of UTF-8 byte values (vocabulary 256)."""
    raw = resources.files(__package__).joinpath(CORPUS_FILE).read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


class ByteDataset(Dataset):
    """Non-overlapping windows of ``block_size + 1`` bytes: input and next-byte target."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if tokens.numel() < block_size + 1:
            raise ValueError(f"{tokens.numel()} tokens are too few for block_size {block_size}")
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} windows")
        chunk = self.tokens[i * self.block_size : (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


def corpus_datasets(block_size: int, val_fraction: float = 0.1) -> tuple[ByteDataset, ByteDataset]:
    """Train and validation datasets: the last ``val_fraction`` of the text is held out."""
    tokens = load_corpus()
    cut = int(tokens.numel() * (1 - val_fraction))
    return ByteDataset(tokens[:cut], block_size), ByteDataset(tokens[cut:], block_size)
