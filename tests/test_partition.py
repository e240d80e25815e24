"""FlatLayout: parameter offsets, buckets padded per bucket, rank pieces (pure arithmetic)."""

from __future__ import annotations

import math
import random

import pytest

from zerostack.zero.partition import (
    ALIGN_NUMEL,
    Bucket,
    FlatLayout,
    PieceBuckets,
    Slot,
    piece_extent,
    piece_numel,
)

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # property test below is skipped; the seeded sweep still runs
    given = None


def check_layout(shapes, world, bucket_numel, reverse, align=1):
    """Every invariant of a layout; raises AssertionError on the first miss. The hand-computed
    examples use ``align=1`` (pieces padded to whole elements only); the engine's layouts align
    pieces to ALIGN_NUMEL elements (the tests after them)."""
    layout = FlatLayout.build(
        shapes, world=world, bucket_numel=bucket_numel, reverse=reverse, align=align
    )
    sizes = [math.prod(s) for s in shapes]
    limit = math.inf if bucket_numel is None else bucket_numel
    slots, buckets = layout.slots, layout.buckets
    assert isinstance(buckets, tuple) and buckets
    assert layout.world == world

    # Slots: every parameter once, in (reverse) registration order, with its own size and shape.
    order = list(range(len(shapes)))[::-1] if reverse else list(range(len(shapes)))
    assert [s.index for s in slots] == order
    for slot in slots:
        assert slot.numel == sizes[slot.index]
        assert slot.shape == tuple(shapes[slot.index])
        assert slot.end == slot.offset + slot.numel
    assert layout.numel == sum(sizes)

    # Buckets tile [0, padded_numel) contiguously, without gaps.
    assert buckets[0].start == 0
    assert buckets[-1].end == layout.padded_numel
    for a, b in zip(buckets, buckets[1:], strict=False):
        assert a.end == b.start

    # Every slot sits in exactly one bucket, in order: the buckets' slot lists concatenate to
    # 0, 1, ..., len(slots) - 1. Only an empty layout has a bucket without slots.
    assert [p for b in buckets for p in b.slots] == list(range(len(slots)))
    assert all(b.slots for b in buckets) or (not shapes and len(buckets) == 1)

    shard_offset = 0
    for i, b in enumerate(buckets):
        last = i == len(buckets) - 1
        real = sum(slots[p].numel for p in b.slots)

        # Size and padding: world equal pieces of whole blocks of align elements; padding below
        # one block per rank unless nothing is real.
        assert b.numel == b.end - b.start > 0
        assert b.numel % world == 0 and b.piece_numel % align == 0
        assert b.numel == world * b.piece_numel
        assert b.numel >= real
        if real == 0:
            assert b.numel == world * align
        else:
            assert b.numel - real < world * align

        # Slots are packed end to end from the bucket's start, so they lie inside it.
        offset = b.start
        for p in b.slots:
            assert slots[p].offset == offset
            offset = slots[p].end
        assert offset == b.start + real <= b.end

        # Greedy cut: every bucket but the last reaches bucket_numel, and a bucket closes as soon
        # as it does, so the elements before its last slot stay below the limit.
        if not last:
            assert real >= limit
        if b.slots:
            assert real - slots[b.slots[-1]].numel < limit
        for k, p in enumerate(b.slots):  # a parameter of at least bucket_numel closes its bucket
            if slots[p].numel >= limit:
                assert k == len(b.slots) - 1

        assert b.shard_offset == shard_offset
        shard_offset += b.piece_numel
    assert layout.shard_numel == shard_offset
    assert layout.shard_numel * world == layout.padded_numel

    # Rank pieces: each rank's pieces are disjoint and fill its shard end to end; together, the
    # ranks' pieces of a bucket tile that bucket exactly, in rank order.
    pieces = {r: layout.shard_pieces(r) for r in range(world)}
    for r, mine in pieces.items():
        assert len(mine) == len(buckets)
        at = 0
        for (lo, hi, shard_start), b in zip(mine, buckets, strict=True):
            assert (lo, hi) == layout.piece(b, r)
            assert b.start <= lo < hi <= b.end
            assert hi - lo == b.piece_numel
            assert shard_start == at == b.shard_offset
            at += hi - lo
        assert at == layout.shard_numel
        spans = sorted((lo, hi) for lo, hi, _ in mine)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    for k, b in enumerate(buckets):
        ranges = [pieces[r][k][:2] for r in range(world)]
        assert ranges[0][0] == b.start and ranges[-1][1] == b.end
        for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False):
            assert end == start
    return layout


# ---------------------------------------------------------------- hand-computed examples


def test_docstring_example():
    # The module docstring's example unaligned (aligned: below): the 3-element slot alone
    # reaches the limit.
    layout = check_layout([(4, 3), (3,)], world=2, bucket_numel=3, reverse=True)
    assert layout.slots == (Slot(1, 0, 3, (3,)), Slot(0, 4, 12, (4, 3)))
    assert [(b.start, b.end) for b in layout.buckets] == [(0, 4), (4, 16)]
    assert layout.buckets == (Bucket(0, 4, (0,), 2, 0), Bucket(4, 16, (1,), 6, 2))
    assert layout.piece(layout.buckets[1], rank=1) == (10, 16)
    assert layout.shard_numel == 8
    assert layout.numel == 15
    assert layout.padded_numel == 16
    assert layout.shard_pieces(0) == [(0, 2, 0), (4, 10, 2)]
    assert layout.shard_pieces(1) == [(2, 4, 0), (10, 16, 2)]


def test_greedy_cut():
    # 3 < 8 elements, so the 12-element slot joins the first bucket (greedy cut): one bucket of
    # 15 real elements padded to 16.
    layout = check_layout([(4, 3), (3,)], world=2, bucket_numel=8, reverse=True)
    assert layout.slots == (Slot(1, 0, 3, (3,)), Slot(0, 3, 12, (4, 3)))
    assert layout.buckets == (Bucket(0, 16, (0, 1), 8, 0),)
    assert layout.piece(layout.buckets[0], rank=1) == (8, 16)
    assert layout.shard_numel == 8


def test_forward_order():
    layout = check_layout([(4, 3), (3,)], world=2, bucket_numel=8, reverse=False)
    assert layout.slots == (Slot(0, 0, 12, (4, 3)), Slot(1, 12, 3, (3,)))
    assert layout.buckets == (Bucket(0, 12, (0,), 6, 0), Bucket(12, 16, (1,), 2, 6))
    assert layout.shard_pieces(0) == [(0, 6, 0), (12, 14, 6)]
    assert layout.shard_pieces(1) == [(6, 12, 0), (14, 16, 6)]


def test_default_is_one_bucket_reverse_order_world_1():
    layout = FlatLayout.build([(4, 3), (3,)], align=1)
    assert layout.world == 1
    assert layout.slots == (Slot(1, 0, 3, (3,)), Slot(0, 3, 12, (4, 3)))
    assert layout.buckets == (Bucket(0, 15, (0, 1), 15, 0),)
    assert layout.numel == layout.padded_numel == layout.shard_numel == 15
    assert layout.shard_pieces(0) == [(0, 15, 0)]


def test_known_example_several_bucket_sizes():
    shapes = [(2,), (3,), (4,), (10,), (1,), (1,)]  # sizes 2, 3, 4, 10, 1, 1: 21 elements

    # 2 + 3 reaches 5; 4 does not, 4 + 10 does; 1 + 1 is the last bucket. Pads 5->8, 14->16, 2->4.
    layout = check_layout(shapes, world=4, bucket_numel=5, reverse=False)
    assert [s.offset for s in layout.slots] == [0, 2, 8, 12, 24, 25]
    assert layout.buckets == (
        Bucket(0, 8, (0, 1), 2, 0),
        Bucket(8, 24, (2, 3), 4, 2),
        Bucket(24, 28, (4, 5), 1, 6),
    )
    assert layout.numel == 21
    assert layout.padded_numel == 28
    assert layout.shard_numel == 7
    assert layout.piece(layout.buckets[1], 3) == (20, 24)
    assert layout.shard_pieces(1) == [(2, 4, 0), (12, 16, 2), (25, 26, 6)]

    layout = check_layout(shapes, world=4, bucket_numel=10, reverse=False)
    assert layout.buckets == (Bucket(0, 20, (0, 1, 2, 3), 5, 0), Bucket(20, 24, (4, 5), 1, 5))
    assert layout.shard_numel == 6

    # Every parameter reaches a limit of 1: one bucket each, padded 2->4, 3->4, 4, 10->12, 1->4.
    layout = check_layout(shapes, world=4, bucket_numel=1, reverse=False)
    assert [(b.start, b.end) for b in layout.buckets] == [
        (0, 4),
        (4, 8),
        (8, 12),
        (12, 24),
        (24, 28),
        (28, 32),
    ]
    assert [b.piece_numel for b in layout.buckets] == [1, 1, 1, 3, 1, 1]
    assert [b.shard_offset for b in layout.buckets] == [0, 1, 2, 3, 6, 7]
    assert layout.shard_numel == 8

    for n in (None, 21, 10**9):
        layout = check_layout(shapes, world=4, bucket_numel=n, reverse=False)
        assert layout.buckets == (Bucket(0, 24, (0, 1, 2, 3, 4, 5), 6, 0),)
        assert [s.offset for s in layout.slots] == [0, 2, 5, 9, 19, 20]


def test_reverse_order_buckets():
    # Reverse: sizes 1, 1, 10, 4, 3, 2. 1 + 1 + 10 reaches 5; 4 + 3 does; 2 is last.
    layout = check_layout([(2,), (3,), (4,), (10,), (1,), (1,)], 4, 5, reverse=True)
    assert [s.index for s in layout.slots] == [5, 4, 3, 2, 1, 0]
    assert [s.offset for s in layout.slots] == [0, 1, 2, 12, 16, 20]
    assert layout.buckets == (
        Bucket(0, 12, (0, 1, 2), 3, 0),
        Bucket(12, 20, (3, 4), 2, 3),
        Bucket(20, 24, (5,), 1, 5),
    )


def test_scalar_and_multi_dim_shapes():
    layout = check_layout([(), (2, 3, 4), (1,)], world=1, bucket_numel=None, reverse=False)
    assert [(s.offset, s.numel, s.shape) for s in layout.slots] == [
        (0, 1, ()),
        (1, 24, (2, 3, 4)),
        (25, 1, (1,)),
    ]
    assert layout.numel == layout.padded_numel == 26

    layout = check_layout([(), (2, 3, 4), (1,)], world=3, bucket_numel=1, reverse=False)
    assert [s.offset for s in layout.slots] == [0, 3, 27]
    assert layout.buckets == (
        Bucket(0, 3, (0,), 1, 0),
        Bucket(3, 27, (1,), 8, 1),
        Bucket(27, 30, (2,), 1, 9),
    )
    assert layout.shard_numel == 10


@pytest.mark.parametrize(
    "numel,world,padded",
    [
        (15, 2, 16),
        (16, 2, 16),
        (17, 2, 18),
        (1, 8, 8),
        (7, 1, 7),
        (100, 7, 105),
        (0, 3, 3),
    ],
)
def test_single_bucket_padding(numel, world, padded):
    layout = check_layout([(numel,)], world=world, bucket_numel=None, reverse=True)
    assert layout.numel == numel
    assert layout.buckets == (Bucket(0, padded, (0,), padded // world, 0),)
    assert layout.padded_numel == padded
    assert layout.shard_numel == padded // world


@pytest.mark.parametrize("bucket_numel", [None, 1, 5])
def test_empty_shape_list_is_one_all_padding_bucket(bucket_numel):
    layout = check_layout([], world=4, bucket_numel=bucket_numel, reverse=True)
    assert layout.slots == ()
    assert layout.buckets == (Bucket(0, 4, (), 1, 0),)
    assert layout.numel == 0
    assert layout.padded_numel == 4
    assert layout.shard_numel == 1
    assert [layout.shard_pieces(r) for r in range(4)] == [[(r, r + 1, 0)] for r in range(4)]


@pytest.mark.parametrize("bucket_numel", [None, 1, 5])
def test_zero_size_shapes_only(bucket_numel):
    # Zero elements never reach the limit: one bucket of both slots, padded to world.
    layout = check_layout([(0,), (3, 0)], world=4, bucket_numel=bucket_numel, reverse=False)
    assert layout.slots == (Slot(0, 0, 0, (0,)), Slot(1, 0, 0, (3, 0)))
    assert layout.buckets == (Bucket(0, 4, (0, 1), 1, 0),)


def test_zero_size_shapes_among_others():
    layout = check_layout([(0,), (3, 0), (5,)], world=2, bucket_numel=1, reverse=False)
    assert [s.offset for s in layout.slots] == [0, 0, 0]
    assert layout.buckets == (Bucket(0, 6, (0, 1, 2), 3, 0),)

    # A zero-size slot after a full bucket opens the next one and shares it with what follows.
    layout = check_layout([(5,), (0,), (2,)], world=2, bucket_numel=5, reverse=False)
    assert layout.slots == (Slot(0, 0, 5, (5,)), Slot(1, 6, 0, (0,)), Slot(2, 6, 2, (2,)))
    assert layout.buckets == (Bucket(0, 6, (0,), 3, 0), Bucket(6, 8, (1, 2), 1, 3))

    # ... and if nothing follows, it is alone in an all-padding bucket of world elements.
    layout = check_layout([(5,), (0,)], world=2, bucket_numel=5, reverse=False)
    assert layout.slots == (Slot(0, 0, 5, (5,)), Slot(1, 6, 0, (0,)))
    assert layout.buckets == (Bucket(0, 6, (0,), 3, 0), Bucket(6, 8, (1,), 1, 3))
    assert layout.shard_numel == 4


def test_large_parameter_closes_its_bucket():
    shapes = [(4,), (100,), (4,), (4,)]
    layout = check_layout(shapes, world=1, bucket_numel=4, reverse=False)
    assert [(b.start, b.end) for b in layout.buckets] == [(0, 4), (4, 104), (104, 108), (108, 112)]

    # 4 < 8, so the 100-element slot joins the first bucket, and closes it.
    layout = check_layout(shapes, world=3, bucket_numel=8, reverse=False)
    assert layout.buckets == (Bucket(0, 105, (0, 1), 35, 0), Bucket(105, 114, (2, 3), 3, 35))
    assert [s.offset for s in layout.slots] == [0, 4, 105, 109]
    assert layout.shard_numel == 38
    assert layout.piece(layout.buckets[1], 2) == (111, 114)


def test_bucket_and_slot_properties():
    assert Bucket(3, 10, (0,), 7, 0).numel == 7
    assert Slot(0, 5, 6, (2, 3)).end == 11


# ---------------------------------------------------------------- argument errors


def test_build_rejects_a_bad_align():
    with pytest.raises(ValueError, match="align must be >= 1, got 0"):
        FlatLayout.build([(4,)], align=0)


@pytest.mark.parametrize("world", [0, -2])
def test_build_rejects_bad_world(world):
    with pytest.raises(ValueError, match=f"world must be >= 1, got {world}"):
        FlatLayout.build([(4,)], world=world)


@pytest.mark.parametrize("bucket_numel", [0, -1])
def test_build_rejects_bad_bucket_numel(bucket_numel):
    with pytest.raises(ValueError, match=f"bucket_numel must be >= 1, got {bucket_numel}"):
        FlatLayout.build([(4,)], bucket_numel=bucket_numel)


@pytest.mark.parametrize("rank", [-1, 3, 100])
def test_piece_rejects_out_of_range_rank(rank):
    layout = FlatLayout.build([(10,)], world=3)
    with pytest.raises(ValueError, match=f"rank {rank} out of range for world 3"):
        layout.piece(layout.buckets[0], rank)
    with pytest.raises(ValueError, match=f"rank {rank} out of range for world 3"):
        layout.shard_pieces(rank)


def test_engine_layouts_align_every_piece_to_16_bytes():
    """The engine's layouts (the default ``align``): each rank's piece of every bucket, and so
    every bucket's start, falls on a 16-byte boundary at 2-byte dtypes (8 elements), with the
    least padding that does: the docstring's example, and stage 3's per-parameter pieces."""
    assert ALIGN_NUMEL * 2 == 16
    layout = check_layout([(4, 3), (3,)], world=2, bucket_numel=3, reverse=True, align=8)
    assert layout == FlatLayout.build([(4, 3), (3,)], world=2, bucket_numel=3)
    assert [(b.start, b.end) for b in layout.buckets] == [(0, 16), (16, 32)]
    assert layout.piece(layout.buckets[1], rank=1) == (24, 32)
    assert layout.shard_numel == 16
    big = check_layout([(100,), (17,)], world=3, bucket_numel=50, reverse=False, align=8)
    assert [(b.start, b.piece_numel) for b in big.buckets] == [(0, 40), (120, 8)]
    for b in big.buckets:
        assert all(lo * 2 % 16 == 0 for lo, _ in (big.piece(b, r) for r in range(3)))
    # stage 3: a parameter of n elements in world pieces
    assert [piece_numel(n, 4) for n in (0, 1, 32, 33, 64, 65)] == [8, 8, 8, 16, 16, 24]
    assert piece_numel(7, 1) == 8 and piece_numel(7, 1, align=1) == 7


def test_build_arguments_are_keyword_only():
    with pytest.raises(TypeError):
        FlatLayout.build([(4,)], 2)


# ---------------------------------------------------------------- properties


def test_invariants_seeded_sweep():
    rng = random.Random(0)
    for _ in range(400):
        shapes = [
            tuple(rng.randint(0, 6) for _ in range(rng.randint(0, 3)))
            for _ in range(rng.randint(0, 10))
        ]
        check_layout(
            shapes,
            world=rng.randint(1, 8),
            bucket_numel=rng.choice([None, 1, 2, 3, 5, 8, 16, 50, 1000]),
            reverse=rng.random() < 0.5,
            align=rng.choice([1, 2, ALIGN_NUMEL]),
        )


if given is not None:
    _shapes = st.lists(st.lists(st.integers(0, 7), max_size=3).map(tuple), max_size=12)

    @settings(max_examples=300, deadline=None, database=None)
    @given(
        shapes=_shapes,
        world=st.integers(1, 8),
        bucket_numel=st.none() | st.integers(1, 80),
        reverse=st.booleans(),
        align=st.sampled_from([1, 3, ALIGN_NUMEL]),
    )
    def test_invariants_property(shapes, world, bucket_numel, reverse, align):
        check_layout(shapes, world, bucket_numel, reverse, align)

else:

    @pytest.mark.skip(reason="hypothesis is not installed")
    def test_invariants_property():
        pass


def test_piece_buckets_keep_units_whole_and_rows_packed():
    """Stage 3's reduce buckets: units (modules) are never split, a bucket closes once its
    world x width reaches the bucket size, and each item's piece starts where the previous
    ended in its bucket's row."""
    b = PieceBuckets.build([[0, 1], [2]], piece=[3, 1, 4], world=2, bucket_numel=10)
    assert (b.items, b.width, b.at) == ([[0, 1, 2]], [8], {0: 0, 1: 3, 2: 4})
    b = PieceBuckets.build([[0, 1], [], [2], [3]], piece=[3, 1, 4, 2], world=2, bucket_numel=8)
    assert b.items == [[0, 1], [2], [3]]  # 2 x 4 = 8 closes the first; 2 x 4 the second
    assert b.width == [4, 4, 2] and b.bucket == {0: 0, 1: 0, 2: 1, 3: 2}
    assert b.at == {0: 0, 1: 3, 2: 0, 3: 0}


def test_a_pieces_extent_stops_at_the_end_of_the_parameter():
    """Stage 3 cuts a flat parameter of 10 elements into pieces of 4 (padded): rank 2's piece
    holds elements 8-9 and two pad, rank 3's is all padding."""
    assert [piece_extent(10, 4, r) for r in range(4)] == [(0, 4), (4, 8), (8, 10), (10, 10)]
    assert piece_extent(8, 4, 1) == (4, 8) and piece_extent(0, 4, 0) == (0, 0)
