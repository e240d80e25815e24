"""DeepSpeed ALST's data side for Hugging Face models under sequence parallelism:
``UlyssesSPDataLoaderAdapter`` (each sp rank's piece of every batch, ``shift_labels`` made
before the cut) and :func:`ulysses_sp_loss` (the mean over the whole sequence's labelled tokens).
With ring ranks among the sp ranks the pieces are :func:`~zerostack.sequence.sequence_piece`'s
zigzag shards; the attention side is :mod:`zerostack.sequence.hf_ulysses`."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm import collectives
from ..comm import functional as cf
from .ring import sequence_piece

RINGS: dict = {}
"""sp group -> its ring groups, as ``register_with_transformers`` built them (the adapter
cuts a ring's zigzag pieces where the ring is)."""


class UlyssesSPDataLoaderAdapter:
    """DeepSpeed's data loader adapter: each sp rank's ``dl`` yields its own batches (dicts of
    ``[b, s, ...]`` tensors with ``input_ids`` and ``position_ids``, ``labels`` optional); one
    batch from every sp rank is taken and handed out in sp rank order, one per step, each rank
    its shard of dim 1 (sp steps consume sp batches, as dp would). ``labels`` become
    ``shift_labels`` (shifted over the whole sequence, ``-100`` at its end) before the cut, so
    no label is lost at a shard's edge; non-tensors reach every rank whole. Shards come back
    on the CPU, as DeepSpeed's. Lengths may vary between batches but must divide by sp. On a
    grid with ring ranks among the sp ranks (zerostack's ``ring_parallel_size``), each rank's
    cut is :func:`~zerostack.sequence.sequence_piece`'s (found from ``sp_group``)."""

    def __init__(self, dl, sp_rank: int, sp_group, sp_world_size, device):
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self.ring = RINGS.get(sp_group, 1)
        self.iter = iter(dl)
        self.micro_batches: deque[dict] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def _gathered(self, batch: dict) -> list[dict]:
        """Every sp rank's batch, in sp rank order (each rank broadcasts its tensors in turn)."""
        meta = {k: (tuple(v.shape), v.dtype) if torch.is_tensor(v) else (None, v)
                for k, v in batch.items()}
        metas: list[Any] = [None] * self.sp_world_size
        collectives.all_gather_object(metas, meta, group=self.sp_group)
        out = []
        for src, theirs in enumerate(metas):
            got = {}
            for k, (shape, value) in theirs.items():
                if shape is None:
                    got[k] = value
                    continue
                t = (batch[k].to(self.device).contiguous() if src == self.sp_rank else
                     torch.empty(shape, dtype=value, device=self.device))
                collectives.broadcast(t, dist.get_global_rank(self.sp_group, src),
                                      group=self.sp_group)
                got[k] = t
            out.append(got)
        return out

    def refill(self) -> None:
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next epoch starts over
            raise
        for key in ("input_ids", "position_ids"):
            if key not in batch:  # (position_ids: so that each shard keeps its place)
                raise ValueError(f"UlyssesSPDataLoaderAdapter: a batch needs {key!r} (for "
                                 "position_ids of unpacked rows: arange(seq_len) per row)")
        sp, ring = self.sp_world_size, self.ring
        for whole in self._gathered(batch):
            s = whole["input_ids"].shape[1]
            if s % sp or ring > 1 and s % (2 * ring):
                raise ValueError(f"UlyssesSPDataLoaderAdapter: sequence length {s} is not "
                                 f"divisible by sequence_parallel_size {sp}" + (
                                     f" and 2 * ring {2 * ring}" if ring > 1 else ""))
            if "labels" in whole:
                labels = F.pad(whole.pop("labels"), (0, 1), value=-100)
                whole["shift_labels"] = labels[:, 1:].contiguous()
            shard = {}
            for k, v in whole.items():
                if torch.is_tensor(v) and v.dim() >= 2:
                    if v.shape[1] != s:
                        raise ValueError(f"UlyssesSPDataLoaderAdapter: {k} has shape "
                                         f"{tuple(v.shape)}, input_ids a length of {s}")
                    v = sequence_piece(v, 1, self.sp_rank, sp, ring).cpu().contiguous()
                shard[k] = v
            self.micro_batches.append(shard)


def ulysses_sp_loss(logits: torch.Tensor, shift_labels: torch.Tensor, sp_group,
                    ignore_index: int = -100) -> torch.Tensor:
    """Causal-LM cross-entropy over the labelled tokens of the whole sequence, from this sp
    rank's ``logits`` [b, s/sp, vocab] and ``shift_labels`` [b, s/sp] (the adapter's): the same
    value on every sp rank, even one with no label (DeepSpeed's tutorial form gives NaN); its
    gradient, after zerostack's average over the sp ranks, is the whole sequence's::

        out = engine(**batch)
        loss = ulysses_sp_loss(out.logits, batch["shift_labels"], mpu.get_sequence_parallel_group())
        engine.backward(loss)

    The ranks' loss sums and token counts are summed over the sp group; the gradient of the
    sum reaches every rank's copy (an all-reduce in backward, as DeepSpeed's all_gather)."""
    axis = cf.on_group(sp_group, "sp")
    labels = shift_labels.to(logits.device).reshape(-1)
    total = F.cross_entropy(logits.float().reshape(labels.numel(), -1), labels,
                            ignore_index=ignore_index, reduction="sum")
    count = (labels != ignore_index).sum().to(total.dtype)
    count = cf.reduce(count, axis)
    total = cf.reduce(cf.copy(total, axis), axis)
    return total / count.clamp_min(1)
