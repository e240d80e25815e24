"""Ring attention (context parallelism): exact attention over a sequence split across ranks, the
keys and values passed around a ring so that no rank ever holds more than two shards of them::

    axis = functional.on_group(group, "ring")          # or functional.on_axis(comm, "sp")
    q, k, v = (zigzag_shard(t, axis.rank, axis.size, dim=2) for t in (q, k, v))
    out = ring_attention(q, k, v, axis)   # [b, h, S/world, d]: this rank's rows of attention

With a causal mask, a rank holding one contiguous slice of the sequence would attend to all the
keys before it: the last rank does ``world`` times the first one's work. The zigzag layout
(:func:`zigzag_shard`) cuts the sequence into ``2 * world`` chunks and gives rank ``r`` chunks
``r`` and ``2 * world - 1 - r``, one early and one late, so every rank computes the same number
of query-key pairs. Positions (for rotary embeddings) are ``zigzag_shard(arange(S), ...)``.

Forward runs ``world`` steps: attention of the local queries against the keys and values held,
merged into fp32 accumulators by online softmax (the running maximum and sum of each row), then
the keys and values move on to the next rank. Per attention it sends k and v ``world - 1``
times (``2 * b * h_kv * S/world * d`` elements each time); backward sends k, v and the fp32
gradients of k and v ``world - 1`` times and the gradients once more, which brings them home.
Saved for backward: q, k, v, the output and the fp32 log-sum-exp of each row, no probabilities.
Scores are made ``tile`` x ``tile`` positions at a time (by default the largest power of two
that keeps one tile's fp32 scores, over the batch and heads, within 4 MiB), so the transient
memory of a step is bounded whatever the shard's length, and tiles wholly above the causal
diagonal are skipped. The exchange is blocking (no overlap of communication with compute).
"""

from __future__ import annotations

import math

import torch

from ..comm import functional as cf

__all__ = ["ring_attention", "sequence_piece", "sequence_unpiece", "zigzag_shard", "zigzag_unshard"]


def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int) -> torch.Tensor:
    """Rank ``rank``'s part of the sequence along ``dim``: of ``2 * world`` equal chunks,
    chunk ``rank`` then chunk ``2 * world - 1 - rank`` (world 2: ranks hold chunks 0+3, 1+2)."""
    size = x.shape[dim]
    if size % (2 * world):
        raise ValueError(
            f"zigzag_shard: a sequence of {size} (dim {dim}) does not split into 2 * world = "
            f"{2 * world} equal chunks"
        )
    if not 0 <= rank < world:
        raise ValueError(f"zigzag_shard: rank {rank} is not in 0..{world - 1}")
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def zigzag_unshard(parts: list[torch.Tensor], world: int, dim: int) -> torch.Tensor:
    """The whole sequence from every rank's :func:`zigzag_shard`, in rank order."""
    if len(parts) != world:
        raise ValueError(f"zigzag_unshard: {len(parts)} parts for a world of {world}")
    halves = [p.chunk(2, dim=dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


def _check_pieces(size: int, dim: int, sp: int, ring: int) -> None:
    if sp % ring:
        raise ValueError(f"ring_parallel_size {ring} does not divide sequence_parallel_size {sp}")
    if ring == 1 and size % sp or ring > 1 and (size % (2 * ring) or size // ring % (sp // ring)):
        what = (
            f"{sp} equal shards"
            if ring == 1
            else (
                f"2 * ring = {2 * ring} zigzag chunks, each ring shard into {sp // ring} Ulysses "
                "shards"
            )
        )
        raise ValueError(
            f"sequence_parallel_size: a sequence of {size} (dim {dim}) does not split into {what}"
        )


def sequence_piece(x: torch.Tensor, dim: int, rank: int, sp: int, ring: int = 1) -> torch.Tensor:
    """Sequence-parallel rank ``rank``'s piece of ``x`` along ``dim``, of ``sp`` ranks in
    ``ring`` ring groups of ``sp // ring`` Ulysses ranks: ring rank ``rank // (sp // ring)``
    takes its :func:`zigzag_shard`, which its Ulysses ranks cut into equal consecutive pieces
    (ring 1: the ``rank``-th of ``sp`` equal consecutive pieces)."""
    _check_pieces(x.shape[dim], dim, sp, ring)
    if ring == 1:
        return x.chunk(sp, dim=dim)[rank]
    u = sp // ring
    return zigzag_shard(x, rank // u, ring, dim).chunk(u, dim=dim)[rank % u]


def sequence_unpiece(parts: list[torch.Tensor], dim: int, ring: int = 1) -> torch.Tensor:
    """The whole sequence from every sp rank's :func:`sequence_piece`, in sp rank order."""
    if len(parts) % ring:
        raise ValueError(f"sequence_unpiece: {len(parts)} pieces for {ring} ring ranks")
    u = len(parts) // ring
    shards = [torch.cat(parts[g * u : (g + 1) * u], dim=dim) for g in range(ring)]
    return zigzag_unshard(shards, ring, dim) if ring > 1 else shards[0]


Block = tuple[slice, slice, bool]


def _blocks(rank: int, src: int, world: int, n: int, causal: bool) -> list[Block]:
    """The attention blocks of this rank's ``n`` queries against the ``n`` keys of rank
    ``src`` (both zigzag shards): ``(query rows, key rows, masked)``, local rows; a masked
    block sees key ``j`` from query ``i`` when ``i >= j`` locally. Blocks wholly in the
    future are left out, blocks wholly in the past are unmasked."""
    every = slice(0, n)
    if not causal:
        return [(every, every, False)]
    if world == 1:
        return [(every, every, True)]
    half = n // 2
    early, late = slice(0, half), slice(half, n)
    if src == rank:  # local order is global order; the early queries never see the late keys
        return [(early, early, True), (late, every, True)]
    if src < rank:  # src's early chunk precedes both of ours, its late chunk follows both
        return [(every, early, False)]
    return [(late, every, False)]  # our late chunk follows both of src's, our early one neither


TILE_ELEMENTS = 2**20
"""A score tile's elements over the batch and heads by default: 4 MiB in fp32."""


def _auto_tile(b: int, h: int) -> int:
    """The largest power of two ``t`` with ``b * h * t * t <= TILE_ELEMENTS`` (at least 16)."""
    side = math.isqrt(max(1, TILE_ELEMENTS // (b * h)))
    return max(16, 1 << (side.bit_length() - 1))


def _split(blocks: list[Block], tile: int):
    """Each block in ``tile`` x ``tile`` pieces: a masked piece wholly above the diagonal (every
    key after every query) is left out, one wholly below it needs no mask."""
    for rows, cols, masked in blocks:
        for r0 in range(rows.start, rows.stop, tile):
            r = slice(r0, min(r0 + tile, rows.stop))
            for c0 in range(cols.start, cols.stop, tile):
                c = slice(c0, min(c0 + tile, cols.stop))
                if masked and c.start > r.stop - 1:
                    continue
                yield r, c, masked and c.stop - 1 > r.start


def _mask(rows: slice, cols: slice, device: torch.device) -> torch.Tensor:
    """Where query ``rows.start + i`` may see key ``cols.start + j``: ``i - j >= cols.start -
    rows.start``, a lower triangle shifted by the offset of the two slices."""
    ones = torch.ones(rows.stop - rows.start, cols.stop - cols.start, dtype=torch.bool)
    return ones.tril(diagonal=rows.start - cols.start).to(device)


def _scores(q, k, rows, cols, masked, scale, docs=None) -> torch.Tensor:
    """Scaled scores of query ``rows`` (q: [b, h_kv, g, n, d]) against key ``cols``
    (k: [b, h_kv, 1, n, d]), fp32, with -inf where the mask hides a key: the causal one when
    ``masked``, and keys of another document when ``docs`` (the queries' and the keys'
    document ids, [b, n] each) is given."""
    s = torch.matmul(q[..., rows, :], k[..., cols, :].transpose(-1, -2)) * scale
    hide = ~_mask(rows, cols, s.device) if masked else None
    if docs is not None:
        apart = (docs[0][:, rows, None] != docs[1][:, None, cols])[:, None, None]
        hide = apart if hide is None else hide | apart
    return s if hide is None else s.masked_fill(hide, float("-inf"))


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``q`` [b, h, n, d] as fp32 [b, h_kv, g, n, d]: the query heads grouped by the key-value
    head they share (grouped-query attention; ``repeat_interleave``'s order), so keys and values
    broadcast over ``g`` instead of being copied per query head."""
    b, h, n, d = q.shape
    return q.float().reshape(b, kv_heads, h // kv_heads, n, d)


def _kv(t: torch.Tensor) -> torch.Tensor:
    return t.float().unsqueeze(2)  # [b, h_kv, 1, n, d]: broadcast over the query group


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, docs, axis, causal, scale, tile):
        world, rank = axis.size, axis.rank
        b, h, n, d = q.shape
        qg = _grouped(q, k.shape[1])
        acc = qg.new_zeros(qg.shape)  # sum over keys of exp(s - m) * v, per query row
        m = qg.new_full(qg.shape[:-1], float("-inf"))  # running maximum score of each row
        total = qg.new_zeros(qg.shape[:-1])  # running sum of exp(s - m)
        held = [k, v] if docs is None else [k, v, docs]
        for step in range(world):
            if step:
                held = axis.ring_shift(held)
            kf, vf = _kv(held[0]), _kv(held[1])
            pair = None if docs is None else (docs, held[2])
            blocks = _blocks(rank, (rank - step) % world, world, n, causal)
            for rows, cols, masked in _split(blocks, tile):
                s = _scores(qg, kf, rows, cols, masked, scale, pair)
                new = torch.maximum(m[..., rows], s.amax(dim=-1))
                # a row that has seen no key yet (a tile wholly of other documents) keeps its -inf
                # maximum: 0 stands in, so exp gives 0 and not exp(-inf + inf) = nan
                safe = new.masked_fill(new == float("-inf"), 0.0)
                p = torch.exp(s - safe.unsqueeze(-1))
                alpha = torch.exp(m[..., rows] - safe)  # rescales what was summed to the new max
                total[..., rows] = total[..., rows] * alpha + p.sum(dim=-1)
                acc[..., rows, :] = acc[..., rows, :] * alpha.unsqueeze(-1) + p @ vf[..., cols, :]
                m[..., rows] = new
        lse = m + total.log()
        out = (acc / total.unsqueeze(-1)).reshape(b, h, n, d).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, docs)
        ctx.axis, ctx.causal, ctx.scale, ctx.tile = axis, causal, scale, tile
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, docs = ctx.saved_tensors
        axis, causal, scale = ctx.axis, ctx.causal, ctx.scale
        world, rank = axis.size, axis.rank
        b, h, n, d = q.shape
        kv_heads = k.shape[1]
        qg, do = _grouped(q, kv_heads), _grouped(grad, kv_heads)
        delta = (do * _grouped(out, kv_heads)).sum(dim=-1)  # rowsum(dout * out): softmax's term
        dq = torch.zeros_like(qg)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)  # travel with k and v
        dv = torch.zeros_like(dk)
        held = [k, v] if docs is None else [k, v, docs]
        for step in range(world):
            if step:
                *held, dk, dv = axis.ring_shift([*held, dk, dv])
            kf, vf = _kv(held[0]), _kv(held[1])
            pair = None if docs is None else (docs, held[2])
            blocks = _blocks(rank, (rank - step) % world, world, n, causal)
            for rows, cols, masked in _split(blocks, ctx.tile):
                s = _scores(qg, kf, rows, cols, masked, scale, pair)
                p = torch.exp(s - lse[..., rows].unsqueeze(-1))  # recomputed from the saved lse
                g_rows = do[..., rows, :]
                dv[..., cols, :] += (p.transpose(-1, -2) @ g_rows).sum(dim=2)
                ds = p * (g_rows @ vf[..., cols, :].transpose(-1, -2) - delta[..., rows, None])
                dq[..., rows, :] += (ds @ kf[..., cols, :]) * scale
                dk[..., cols, :] += (ds.transpose(-1, -2) @ qg[..., rows, :]).sum(dim=2) * scale
        # the last chunk held is rank + 1's: one more step brings every gradient to its owner
        dk, dv = axis.ring_shift([dk, dv])
        dq = dq.reshape(b, h, n, d).to(q.dtype)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _run(*args):
    return _RingAttention.apply(*args)


# Under torch.compile the ring runs eagerly, as the collectives of zerostack.comm.functional do:
# its exchanges post through Comm (its CommLog), which dynamo cannot trace.
_apply = torch.compiler.disable(_run, recursive=True)


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    world: int,
    causal: bool,
    docs: torch.Tensor | None,
) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "ring_attention: q, k and v are [batch, heads, sequence, head_dim]; got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"ring_attention: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    b, h, n, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, n, d):
        raise ValueError(
            f"ring_attention: k and v {tuple(k.shape)} do not match q {tuple(q.shape)} in batch, "
            "sequence or head_dim"
        )
    if h % k.shape[1]:
        raise ValueError(
            f"ring_attention: {h} query heads do not split into groups over {k.shape[1]} "
            "key-value heads"
        )
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"ring_attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if docs is not None and (docs.shape != (b, n) or docs.is_floating_point()):
        raise ValueError(
            f"ring_attention: document_ids are integers of shape [batch, sequence] = {(b, n)}; "
            f"got {docs.dtype} of shape {tuple(docs.shape)}"
        )
    if causal and world > 1 and n % 2:
        raise ValueError(
            f"ring_attention: a local sequence of {n} does not split into the two zigzag chunks "
            f"of a causal ring of {world} ranks (the whole sequence must divide by 2 * world = "
            f"{2 * world})"
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    axis: cf.Axis,
    *,
    causal: bool = True,
    scale: float | None = None,
    document_ids: torch.Tensor | None = None,
    tile: int | None = None,
) -> torch.Tensor:
    """Softmax attention of this rank's queries over the whole sequence, which lies in shards
    on the ranks of ``axis``; returns this rank's rows, [b, h, s_local, d], in q's dtype.

    ``q`` is [b, h, s_local, d]; ``k`` and ``v`` are [b, h_kv, s_local, d] with ``h_kv``
    dividing ``h`` (grouped-query attention: query head ``i`` reads key-value head
    ``i // (h // h_kv)``, as ``repeat_interleave`` would expand them). With ``causal`` every
    rank holds its :func:`zigzag_shard` of the sequence; without, any equal split in rank order
    works (zigzag too). ``scale`` defaults to ``1 / sqrt(d)``. ``document_ids`` ([b, s_local]
    integers, this rank's tokens' documents) packs several documents in a row: a query sees
    only the keys of its own document; they travel with the keys. Scores are made ``tile`` x
    ``tile`` positions at a time (None: a tile's fp32 scores within 4 MiB). The arithmetic is
    fp32 whatever the inputs' dtype. Inputs that do not fit are a ``ValueError`` before any
    communication.
    """
    _check(q, k, v, axis.size, causal, document_ids)
    if tile is None:
        tile = _auto_tile(q.shape[0], q.shape[1])
    if not isinstance(tile, int) or tile < 1:
        raise ValueError(
            f"ring_attention: tile must be a positive number of positions, got {tile!r}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    docs = None if document_ids is None else document_ids.contiguous()
    return _apply(q, k, v, docs, axis, causal, scale, tile)
