"""Pure math for flat parameter buffers: where each parameter lives, buckets, rank slices.

Parameters of one optimizer group are packed end to end into one flat buffer, in the order their
gradients are expected to become ready (reverse registration order, as backward visits them), so a
bucket of ready gradients is one contiguous range and is reduced without a copy. The buffer is
padded to a multiple of ``world * align`` elements so it splits into equal rank slices::

    layout = FlatLayout.build([(4, 3), (3,)], world=2)
    layout.padded_numel            # 16: 15 elements padded to a multiple of 2
    layout.shard_range(rank=1)     # (8, 16)
    layout.buckets(bucket_numel=8) # [Bucket(start=0, end=3, ...), Bucket(start=3, end=16, ...)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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
    """A contiguous range ``[start, end)`` of the flat buffer and the slots it covers."""

    start: int
    end: int
    slots: tuple[int, ...]  # positions in FlatLayout.slots

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class FlatLayout:
    slots: tuple[Slot, ...]
    numel: int
    padded_numel: int
    world: int

    @classmethod
    def build(
        cls, shapes: list[tuple[int, ...]], *, world: int = 1, align: int = 1, reverse=True
    ) -> FlatLayout:
        """Pack parameters of the given shapes; ``reverse`` puts the last parameter first."""
        if world < 1 or align < 1:
            raise ValueError(f"world and align must be >= 1, got {world} and {align}")
        order = range(len(shapes) - 1, -1, -1) if reverse else range(len(shapes))
        slots, offset = [], 0
        for i in order:
            n = math.prod(shapes[i])
            slots.append(Slot(i, offset, n, tuple(shapes[i])))
            offset += n
        unit = world * align
        padded = max(unit, -(-offset // unit) * unit)
        return cls(tuple(slots), offset, padded, world)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world

    def shard_range(self, rank: int) -> tuple[int, int]:
        """The ``[start, end)`` range of the flat buffer owned by ``rank``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} out of range for world {self.world}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def buckets(self, bucket_numel: int) -> list[Bucket]:
        """Split at parameter boundaries into ranges of at least ``bucket_numel`` elements.

        A parameter larger than the bucket size gets a bucket of its own; the last bucket also
        covers the padding, so the buckets tile the whole buffer.
        """
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
        out: list[Bucket] = []
        start, members = 0, []
        for pos, slot in enumerate(self.slots):
            members.append(pos)
            if slot.end - start >= bucket_numel:
                out.append(Bucket(start, slot.end, tuple(members)))
                start, members = slot.end, []
        if members or start < self.padded_numel:
            if members or not out:
                out.append(Bucket(start, self.padded_numel, tuple(members)))
            else:  # only padding left: fold it into the last bucket
                last = out.pop()
                out.append(Bucket(last.start, self.padded_numel, last.slots))
        return out
