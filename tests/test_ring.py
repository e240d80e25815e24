"""Ring attention: the zigzag layout and its inverse, the causal blocks each step computes, and
ring_attention on 1, 2 and 4 gloo ranks against whole-sequence attention on one process
(outputs and the gradients of q, k, v; causal or not; grouped-query or not; over a grid's Comm
and over a bare process group), a bf16 run, the exchanges it makes, refusals.

Tolerance: fp32 parity is 1e-6 of the reference's largest value, per tensor. The reference is
F.scaled_dot_product_attention in float64 on the same inputs, so the difference measured is the
ring's own fp32 rounding (a few 1e-7 at these sizes), not the sum of two fp32 round-offs.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from zerostack import Topology
from zerostack.comm import functional as cf
from zerostack.comm.grid import comm_for
from zerostack.sequence import ring_attention, zigzag_shard, zigzag_unshard
from zerostack.sequence.ring import _blocks, _split

from tests.support.ranks import run_distributed

B, H, S, D = 2, 4, 32, 8
CASES = [(causal, kv) for causal in (True, False) for kv in (2, 4)]  # kv 2: grouped-query


# --------------------------------------------------------------------------- pure: the layout
def test_zigzag_chunk_order_for_two_and_four_ranks():
    seq = torch.arange(16)
    two = [zigzag_shard(seq, r, 2, dim=0).tolist() for r in range(2)]
    assert two == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]  # chunks 0+3, 1+2
    four = [zigzag_shard(seq, r, 4, dim=0).tolist() for r in range(4)]
    assert four == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]  # r, 7 - r


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zigzag_unshard_inverts_shard(world):
    x = torch.randn(2, 3, 24, 5)
    for dim in (2, -2):
        parts = [zigzag_shard(x, r, world, dim=dim) for r in range(world)]
        assert all(p.shape == (2, 3, 24 // world, 5) for p in parts)
        assert torch.equal(zigzag_unshard(parts, world, dim=dim), x)


def test_zigzag_refuses_a_sequence_that_does_not_split():
    with pytest.raises(ValueError, match="a sequence of 12 .* 2 \\* world = 8 equal chunks"):
        zigzag_shard(torch.zeros(12), 0, 4, dim=0)
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        zigzag_shard(torch.zeros(8), 2, 2, dim=0)


@pytest.mark.parametrize("tile", [None, 1, 3])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_causal_blocks_cover_exactly_the_causal_mask_and_balance_the_work(world, tile):
    """Over the ``world`` steps a rank's blocks see exactly the keys at or before each query's
    position, none twice; the blocks left out are wholly in the future; and every rank
    computes the same number of scores. Cut in ``tile`` x ``tile`` pieces, the same holds
    (a piece wholly above the diagonal left out, one wholly below it unmasked), but for the
    balance (a rank's pieces straddle the diagonal differently)."""
    n = 12  # per rank: two chunks of 6
    pos = [zigzag_shard(torch.arange(n * world), r, world, dim=0) for r in range(world)]
    work = []
    for rank in range(world):
        seen = torch.zeros(n, n * world, dtype=torch.int64)
        computed = 0
        for src in range(world):
            blocks = _blocks(rank, src, world, n, causal=True)
            for rows, cols, masked in blocks if tile is None else _split(blocks, tile):
                qp, kp = pos[rank][rows], pos[src][cols]
                visible = qp[:, None] >= kp[None, :]
                assert visible.any()  # nothing wholly in the future is computed
                if masked:  # the local triangle is the global mask
                    local = torch.arange(n)[rows][:, None] >= torch.arange(n)[cols][None, :]
                    assert torch.equal(local, visible)
                else:
                    assert visible.all()  # an unmasked block is wholly in the past
                seen[rows.start : rows.stop, kp] += visible.long()
                computed += visible.numel()
        assert torch.equal(seen, (pos[rank][:, None] >= torch.arange(n * world)).long())
        work.append(computed)
    assert tile is not None or len(set(work)) == 1, work


# --------------------------------------------------------------------------- refusals
class _Silent:
    """An axis of two ranks whose exchange fails the test: refusals come before any."""

    class topo:  # noqa: N801 - what Axis reads of a topology
        sp = 2

        @staticmethod
        def rank(axis):
            return 0

    def p2p(self, *args, **kwargs):
        raise AssertionError("communicated before refusing")


def test_the_default_tile_keeps_a_tiles_scores_within_4_mib():
    from zerostack.sequence.ring import _auto_tile

    for b, h, want in [(1, 8, 256), (1, 4, 512), (2, 4, 256), (1, 32, 128), (8, 64, 32)]:
        assert _auto_tile(b, h) == want, (b, h)
        assert b * h * want * want * 4 <= 4 * 2**20 < b * h * (2 * want) ** 2 * 4, (b, h)
    assert _auto_tile(128, 128) == 16  # the floor: no smaller tiles, whatever the heads


def test_bad_inputs_are_refused_before_any_communication():
    axis = cf.Axis("sp", comm=_Silent())
    q, kv = torch.zeros(1, 4, 8, 2), torch.zeros(1, 2, 8, 2)
    with pytest.raises(ValueError, match="4 query heads do not split into groups over 3 key"):
        ring_attention(q, torch.zeros(1, 3, 8, 2), torch.zeros(1, 3, 8, 2), axis)
    odd = torch.zeros(1, 4, 7, 2), torch.zeros(1, 2, 7, 2)
    with pytest.raises(ValueError, match="local sequence of 7 does not split into the two zigzag"):
        ring_attention(odd[0], odd[1], odd[1], axis)
    with pytest.raises(ValueError, match=r"k \(1, 2, 8, 2\) and v \(1, 2, 4, 2\) differ"):
        ring_attention(q, kv, torch.zeros(1, 2, 4, 2), axis)
    with pytest.raises(ValueError, match="do not match q"):
        ring_attention(q, torch.zeros(1, 2, 4, 2), torch.zeros(1, 2, 4, 2), axis)
    with pytest.raises(ValueError, match=r"\[batch, heads, sequence, head_dim\]"):
        ring_attention(q[0], kv, kv, axis)
    with pytest.raises(ValueError, match="dtypes differ"):
        ring_attention(q, kv, kv.double(), axis)
    with pytest.raises(ValueError, match="tile must be a positive number of positions, got 0"):
        ring_attention(q, kv, kv, axis, tile=0)


# --------------------------------------------------------------------------- on gloo ranks
def _inputs(kv: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(kv)
    q, k, v, up = (torch.randn(B, h, S, D, generator=g).to(dtype) for h in (H, kv, kv, H))
    return [q, k, v], up


def _ring(rank, world, path):
    """Every case on this rank's zigzag shards: the output, the gradients of q, k, v and the
    exchanges made (CommLog records on the Comm path; on both, what torch.distributed's
    batch_isend_irecv was handed), forward and backward apart.

    Paths: 'comm' is the grid's sp axis; 'group' the world as a process group; 'rings' two
    rings of two over world 4, ranks (0, 2) and (1, 3), so group ranks are not global ranks."""
    if path == "comm":
        topo = Topology.build(sp=world)
        axis, log = cf.on_axis(comm_for(topo), "sp"), comm_for(topo).log.records
    elif path == "group":
        axis, log = cf.on_group(dist.group.WORLD, "ring"), []
    else:
        group, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
        axis, log = cf.on_group(group, "ring"), []
    handed, real = [], dist.batch_isend_irecv

    def counting(ops):
        handed.append([(p.op.__name__, p.tensor.numel() * p.tensor.element_size()) for p in ops])
        return real(ops)

    dist.batch_isend_irecv = counting
    out = {}
    try:
        for causal, kv in [*CASES, (True, -2)]:  # kv -2: bf16 inputs, 2 kv heads
            dtype = torch.bfloat16 if kv < 0 else torch.float32
            qkv, up = _inputs(abs(kv), dtype)
            mine = [zigzag_shard(t, axis.rank, axis.size, 2).requires_grad_(True) for t in qkv]
            before = len(log), len(handed)
            y = ring_attention(*mine, axis, causal=causal)
            middle = len(log), len(handed)
            (y * zigzag_shard(up, axis.rank, axis.size, 2)).sum().backward()  # y's grad: up
            exchanges = [
                ([(r.op, r.axis, r.bytes) for r in log[a:b]], handed[c:d])
                for (a, c), (b, d) in [(before, middle), (middle, (len(log), len(handed)))]
            ]
            out[causal, kv] = [y.detach(), *(t.grad for t in mine)], exchanges
    finally:
        dist.batch_isend_irecv = real
    return out


@functools.cache
def _results(world: int, path: str) -> list[dict]:
    return run_distributed(_ring, world, args=(path,))


def _reference(causal: bool, kv: int):
    """Whole-sequence attention on one process: output and the gradients of q, k, v, the key
    and value heads expanded for the query heads and their gradients summed back; in float64,
    on the inputs (and upstream gradient) as the ranks had them."""
    (q, k, v), up = _inputs(abs(kv), torch.bfloat16 if kv < 0 else torch.float32)
    q, k, v = (t.double().requires_grad_(True) for t in (q, k, v))
    rep = H // abs(kv)
    y = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=causal
    )
    (y * up.double()).sum().backward()
    return [y.detach(), q.grad, k.grad, v.grad]


def _whole(results: list[dict], ranks: list[int], case) -> list[torch.Tensor]:
    return [zigzag_unshard([results[r][case][0][i] for r in ranks], len(ranks), dim=2)
            for i in range(4)]  # fmt: skip


RUNS = [(1, "comm"), (2, "comm"), (2, "group"), (4, "comm"), (4, "rings")]


@pytest.mark.distributed
@pytest.mark.parametrize("world,path", RUNS)
def test_ring_attention_is_attention_over_the_whole_sequence(world, path):
    results = _results(world, path)
    rings = [[0, 2], [1, 3]] if path == "rings" else [list(range(world))]
    for case in CASES:
        ref = _reference(*case)
        for ranks in rings:
            got = _whole(results, ranks, case)
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
                assert a.dtype == torch.float32 and a.shape == b.shape, (name, a.dtype)
                rel = float((a.double() - b).abs().max() / b.abs().max())
                assert rel <= 1e-6, f"causal, kv heads {case}, {name}: {rel:.2e}"


# Rounding the exact result to bf16 moves it by at most 2**-8 of itself (8 significant bits);
# the fp32 arithmetic before adds ~1e-6 of the largest value. bf16 arithmetic (matmuls and
# accumulators in the input dtype) lands at 4e-3 to 1.3e-2 here: well outside.
BF16_ROUNDING = 2**-8 * (1 + 1e-3) + 1e-6


@pytest.mark.distributed
@pytest.mark.parametrize("world,path", [(1, "comm"), (2, "comm"), (4, "comm")])
def test_bf16_inputs_are_accumulated_in_fp32(world, path):
    """bf16 in, bf16 out (and bf16 gradients), each within one bf16 rounding of exact
    attention on the same bf16 inputs and upstream gradient: the arithmetic in between is fp32.
    """
    ref = _reference(True, -2)
    for name, a, b in zip(("out", "dq", "dk", "dv"), _whole(_results(world, path),
                          list(range(world)), (True, -2)), ref, strict=True):  # fmt: skip
        assert a.dtype == torch.bfloat16, (name, a.dtype)
        rel = float((a.double() - b).abs().max() / b.abs().max())
        assert rel <= BF16_ROUNDING, f"{name}: {rel:.2e}"


@pytest.mark.distributed
@pytest.mark.parametrize("world,path", RUNS)
def test_forward_passes_k_and_v_around_the_ring_world_minus_one_times(world, path):
    """Forward: ``world - 1`` exchanges, each k and v sent to the next rank and received from
    the previous one, posted together. Backward: ``world - 1`` exchanges of k, v and their fp32
    gradients, and one more of the gradients, which brings them to their owner."""
    n = S // (world if path != "rings" else 2)  # ring size
    ring = 2 if path == "rings" else world
    for result in _results(world, path):
        for (_, kv), (_, (fwd, bwd)) in result.items():
            kv_bytes = B * abs(kv) * n * D * (2 if kv < 0 else 4)
            grad_bytes = B * abs(kv) * n * D * 4
            pair = [kv_bytes, kv_bytes]
            assert fwd[1] == [[("isend", b) for b in pair] + [("irecv", b) for b in pair]] * (
                ring - 1
            )
            moving = pair + [grad_bytes, grad_bytes]
            step = [("isend", b) for b in moving] + [("irecv", b) for b in moving]
            home = [("isend", grad_bytes)] * 2 + [("irecv", grad_bytes)] * 2
            assert bwd[1] == ([step] * (ring - 1) + [home] if ring > 1 else [])
            if path == "comm":  # the same, in the Comm's log, on its sp axis
                for log, calls in (fwd, bwd):
                    assert log == [(op[1:], "sp", b) for call in calls for op, b in call]


# --------------------------------------------------------------------------- packed documents
# Row 0 packs documents of 5, 11, 9 and 7 tokens, row 1 is one document: cuts fall inside the
# zigzag chunks and across them, and row 1 checks that a row of one document is plain causal.
DOC_LENGTHS = [[5, 11, 9, 7], [S]]


def _documents() -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
                        for row in DOC_LENGTHS])  # fmt: skip


def _ring_documents(rank, world, causal, tile):
    topo = Topology.build(sp=world)
    axis = cf.on_axis(comm_for(topo), "sp")
    qkv, up = _inputs(2)
    mine = [zigzag_shard(t, axis.rank, world, 2).requires_grad_(True) for t in qkv]
    docs = zigzag_shard(_documents(), axis.rank, world, 1)
    y = ring_attention(*mine, axis, causal=causal, document_ids=docs, tile=tile)
    (y * zigzag_shard(up, axis.rank, world, 2)).sum().backward()
    return [y.detach(), *(t.grad for t in mine)]


@pytest.mark.distributed
@pytest.mark.parametrize("world,tile", [(1, None), (2, None), (4, None), (2, 3), (4, 3)])
@pytest.mark.parametrize("causal", [True, False])
def test_packed_documents_attend_only_within_themselves(world, tile, causal):
    """With ``document_ids`` a query sees the keys of its own document only (and, causal, none
    after it), as whole-sequence attention with that mask in float64. In tiles of 3 positions
    a row's first tile can hold only other documents' keys: its running maximum stays -inf
    there, which must not turn the accumulators into nan."""
    got = run_distributed(_ring_documents, world, args=(causal, tile))
    (q, k, v), up = _inputs(2)
    q, k, v = (t.double().requires_grad_(True) for t in (q, k, v))
    docs = _documents()
    mask = (docs[:, :, None] == docs[:, None, :])[:, None]
    if causal:
        mask = mask & torch.ones(S, S, dtype=torch.bool).tril()
    y = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                       attn_mask=mask)  # fmt: skip
    (y * up.double()).sum().backward()
    wants = (y.detach(), q.grad, k.grad, v.grad)
    for i, (name, want) in enumerate(zip(("out", "dq", "dk", "dv"), wants, strict=True)):
        whole = zigzag_unshard([r[i] for r in got], world, dim=2)
        rel = float((whole.double() - want).abs().max() / want.abs().max())
        assert rel <= 1e-6, f"causal {causal}, world {world}, tile {tile}, {name}: {rel:.2e}"
