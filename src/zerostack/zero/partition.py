"""Pure math for flat parameter buffers: where each parameter lives, buckets, rank pieces.

Parameters of one optimizer group are packed end to end into one flat buffer, in the order their
gradients are expected to become ready (reverse registration order, as backward visits them), and
cut at parameter boundaries into buckets of at least ``bucket_numel`` elements. Each bucket is
padded so that it splits into ``world`` equal pieces of a multiple of :data:`ALIGN_NUMEL`
elements (:func:`piece_numel`): a bucket of ready gradients is one contiguous range, all-reduced
(stage 0) or reduce-scattered (stages 1-2) without a copy, and rank ``r`` owns piece ``r`` of
every bucket.
A rank's shard is its pieces of all buckets, end to end (the words: the vocabulary note in
:mod:`zerostack.zero`)::

    layout = FlatLayout.build([(4, 3), (3,)], world=2, bucket_numel=3)
    [(b.start, b.end) for b in layout.buckets]   # [(0, 16), (16, 32)]: pieces of 8 elements
    layout.piece(layout.buckets[1], rank=1)      # (24, 32): rank 1's piece of bucket 1
    layout.shard_numel                           # 16 = 8 + 8
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALIGN_NUMEL = 8
"""Every rank's piece (of a bucket at stages 0-2, of a parameter at stage 3) is a multiple of this
many elements: 16 bytes at 2-byte dtypes, 32 in fp32. So each piece, and each bucket after it,
starts 16-byte aligned inside its buffer (whose start the allocator aligns), where NCCL and
multi-tensor apply take their fast paths; DeepSpeed aligns NCCL's starts too."""


def piece_numel(numel: int, world: int, align: int = ALIGN_NUMEL) -> int:
    """Elements of each of ``world`` equal pieces that hold ``numel`` (padded): the smallest
    multiple of ``align`` that is enough, and at least ``align``."""
    per = -(-numel // world)
    return max(align, -(-per // align) * align)


@dataclass(frozen=True)
class Slot:
    """One parameter inside the flat buffer: its index in the group, offset, size and shape."""

    index: int
    offset: int
    numel: int
    shape: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Bucket:
    """A contiguous, padded range ``[start, end)`` of the flat buffer and the slots it holds.

    ``shard_offset`` is where this bucket's piece starts inside every rank's shard.
    """

    start: int
    end: int
    slots: tuple[int, ...]  # positions in FlatLayout.slots
    piece_numel: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class FlatLayout:
    slots: tuple[Slot, ...]
    buckets: tuple[Bucket, ...]
    world: int

    @classmethod
    def build(
        cls,
        shapes: list[tuple[int, ...]],
        *,
        world: int = 1,
        bucket_numel: int | None = None,
        reverse: bool = True,
        align: int = ALIGN_NUMEL,
    ) -> FlatLayout:
        """Pack parameters of the given shapes; ``reverse`` puts the last parameter first; each
        rank's piece of a bucket is a multiple of ``align`` elements (:func:`piece_numel`).

        ``bucket_numel=None`` makes one bucket of everything. A bucket closes as soon as it holds
        ``bucket_numel`` elements (so a large parameter closes the bucket it lands in, as in torch
        DDP). An empty group still gets one (all-padding) bucket so every rank has a shard.
        """
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
        if bucket_numel is not None and bucket_numel < 1:
            raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
        order = list(range(len(shapes) - 1, -1, -1) if reverse else range(len(shapes)))
        limit = bucket_numel or math.inf
        groups: list[list[int]] = [[]]
        size = 0
        for i in order:
            if groups[-1] and size >= limit:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += math.prod(shapes[i])
        slots: list[Slot] = []
        buckets: list[Bucket] = []
        start = shard_offset = 0
        for members in groups:
            offset = start
            positions = []
            for i in members:
                n = math.prod(shapes[i])
                positions.append(len(slots))
                slots.append(Slot(i, offset, n, tuple(shapes[i])))
                offset += n
            piece = piece_numel(offset - start, world, align)
            padded = piece * world
            buckets.append(Bucket(start, start + padded, tuple(positions), piece, shard_offset))
            start += padded
            shard_offset += piece
        return cls(tuple(slots), tuple(buckets), world)

    @property
    def numel(self) -> int:
        """Elements of real parameters (no padding)."""
        return sum(s.numel for s in self.slots)

    @property
    def padded_numel(self) -> int:
        return self.buckets[-1].end

    @property
    def shard_numel(self) -> int:
        """Elements each rank owns: its piece of every bucket."""
        return self.padded_numel // self.world

    def piece(self, bucket: Bucket, rank: int) -> tuple[int, int]:
        """The ``[start, end)`` range of the flat buffer that ``rank`` owns within ``bucket``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} out of range for world {self.world}")
        lo = bucket.start + rank * bucket.piece_numel
        return lo, lo + bucket.piece_numel

    def shard_pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """``(flat_start, flat_end, shard_start)`` for each piece ``rank`` owns, bucket order."""
        out = []
        for b in self.buckets:
            lo, hi = self.piece(b, rank)
            out.append((lo, hi, b.shard_offset))
        return out


@dataclass(frozen=True)
class PieceBuckets:
    """Stage 3's reduce buckets: each parameter already is ``world`` equal pieces of ``piece``
    elements, so a bucket is a ``(world, width)`` matrix whose row ``r`` is rank ``r``'s pieces of
    the bucket's parameters end to end; one reduce-scatter gives each rank its row. ``at[i]`` is
    where item ``i``'s piece starts in its bucket's row, ``bucket[i]`` which bucket it is in.

    ``units`` are groups of items never split across buckets (a module's parameters), in launch
    order; a bucket takes units until its ``world * width`` reaches ``bucket_numel``::

        b = PieceBuckets.build([[0, 1], [2]], piece=[3, 1, 4], world=2, bucket_numel=10)
        b.items, b.width, b.at  # [[0, 1, 2]], [8], {0: 0, 1: 3, 2: 4}: 2 x 4 < 10, unit 1 joins
    """

    items: list[list[int]]  # per bucket, the items in it
    width: list[int]  # per bucket, the elements of one rank's row
    bucket: dict[int, int]
    at: dict[int, int]

    @classmethod
    def build(
        cls, units: list[list[int]], *, piece: list[int], world: int, bucket_numel: int
    ) -> PieceBuckets:
        items: list[list[int]] = []
        width: list[int] = []
        bucket: dict[int, int] = {}
        at: dict[int, int] = {}
        for unit in units:
            if not unit:
                continue
            if not items or width[-1] * world >= bucket_numel:
                items.append([])
                width.append(0)
            for i in unit:
                bucket[i], at[i] = len(items) - 1, width[-1]
                items[-1].append(i)
                width[-1] += piece[i]
        return cls(items, width, bucket, at)


def piece_extent(numel: int, width: int, rank: int) -> tuple[int, int]:
    """``[lo, hi)``: the elements of a flat tensor of ``numel`` that rank ``rank``'s piece of
    ``width`` holds when it is cut into pieces of that width (``hi - lo < width`` where the
    piece runs into the padding, 0 when it is all padding)."""
    lo = min(rank * width, numel)
    return lo, min(lo + width, numel)
