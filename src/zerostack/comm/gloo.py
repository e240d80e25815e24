"""How zerostack's collectives reach torch.distributed: over gloo, its own reduce-scatter and
all-gather (faster there than torch's), elsewhere torch's own calls.

gloo's reduce-scatter is an all-to-all and a sum in rank order (:class:`_SummedRows`); its
all-gather is one batch of point-to-point sends and receives straight into the outputs
(:class:`_PeerGather`), for one pair of tensors or several. On NCCL (and any group that is not
gloo, or of one rank) torch's ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` run.
:class:`~.grid.Comm` names and counts each call; this module only moves the bytes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..core import scratch

# torch 2.13 renamed the tensor-in/tensor-out collectives and deprecates the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _SummedRows:
    """gloo's reduce-scatter as zerostack runs it: an all-to-all hands rank ``r`` row ``r`` of
    every rank's input, and :meth:`wait` sums the received rows in rank order into the output.
    The same bytes cross the wire as in a ring reduce-scatter ((N-1)/N of the input per rank);
    torch's gloo reduce-scatter of a 4M-element bucket took 1.6-2.3x as long at 2 ranks
    (``benchmarks/collectives.py``). The received rows (a whole bucket, in a mapping of its own
    from :data:`~zerostack.core.scratch.MIN_BYTES` up) live until the sum; taken from and
    handed back to ``pool`` (a :class:`~zerostack.core.scratch.Pool`) when one is given."""

    def __init__(
        self, output: torch.Tensor, input: torch.Tensor, group, async_op: bool, pool=None
    ) -> None:
        world = dist.get_world_size(group)
        if input.numel() != output.numel() * world:
            raise ValueError(
                f"reduce_scatter: input of {input.numel()} elements for an output of "
                f"{output.numel()} over {world} ranks (want {output.numel() * world})"
            )

        self._out, self._pool = output, pool
        make = pool.take if pool is not None else scratch.empty
        self._rows = make(input.numel(), input.dtype, input.device)
        self._work = dist.all_to_all_single(
            self._rows, input.reshape(-1), group=group, async_op=async_op
        )

    def wait(self) -> bool:
        if self._rows is not None:
            if self._work is not None:
                self._work.wait()
            rows = self._rows.view(-1, self._out.numel())
            torch.add(rows[0], rows[1], out=self._out.view(-1))
            for r in range(2, rows.shape[0]):
                self._out.view(-1).add_(rows[r])
            if self._pool is not None:
                self._pool.give(self._rows)
            self._rows = self._work = None
        return True


def _gloo(group) -> bool:
    """Whether ``group`` of 2 or more ranks runs on gloo, where zerostack's own reduce-scatter
    and all-gather beat torch's (on NCCL torch's are the ones to use)."""
    return dist.get_backend(group) == "gloo" and dist.get_world_size(group) >= 2


def _reduce_scatter_rows(output, input, *, op, group, async_op, pool=None):
    """A summing reduce-scatter into a contiguous output over a gloo group of 2 or more ranks:
    :class:`_SummedRows`; anything else: torch's."""
    if op != dist.ReduceOp.SUM or not output.is_contiguous() or not _gloo(group):
        return _reduce_scatter(output, input, op=op, group=group, async_op=async_op)
    summed = _SummedRows(output, input, group, async_op, pool)
    if not async_op:
        summed.wait()
        return None
    return summed


class _Each:
    """Several in-flight collectives, waited for as one."""

    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self) -> bool:
        for w in self._works:
            w.wait()
        self._works = []
        return True


class _PeerGather(_Each):
    """gloo's all-gather as zerostack runs it: each ``inputs[i]`` goes to every other rank of
    the group and each rank's lands in its row of ``outputs[i]``, all sends and receives of all
    the pairs posted together (``batch_isend_irecv``). The same bytes as a ring all-gather; for
    a 4M-element fp32 output at 2 ranks, 0.62x an all-reduce's time where torch's gloo
    all-gather took 0.77x (``benchmarks/collectives.py``). An input may be its rank's row of
    its output; several pairs need no send or receive buffer around them."""

    def __init__(self, outputs: list, inputs: list, group, async_op: bool) -> None:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        peers = [r for r in range(world) if r != rank]
        sends, recvs = [], []
        for output, input in zip(outputs, inputs, strict=True):
            if output.numel() != input.numel() * world:
                raise ValueError(
                    f"all_gather: output of {output.numel()} elements for an input of "
                    f"{input.numel()} over {world} ranks (want {input.numel() * world})"
                )
            rows = output.view(world, -1)
            src = input.reshape(-1)
            if rows[rank].data_ptr() != src.data_ptr():
                rows[rank].copy_(src)
            for r in peers:  # (a pair's transfers are matched in the order they are posted)
                peer = dist.get_global_rank(group, r)
                sends.append(dist.P2POp(dist.isend, src, peer, group))
                recvs.append(dist.P2POp(dist.irecv, rows[r], peer, group))
        super().__init__(dist.batch_isend_irecv(sends + recvs) if sends else [])
        if not async_op:
            self.wait()


def _in_place_row(output, input, group) -> bool:
    """Whether ``input`` is exactly this rank's row of ``output`` on an NCCL group, which
    gathers in place (NCCL documents it; torch's gloo does not promise it)."""
    if dist.get_backend(group) != "nccl" or not output.is_contiguous() or not input.is_contiguous():
        return False
    rank, n = dist.get_rank(group), input.numel()
    return input.data_ptr() == output.data_ptr() + rank * n * output.element_size()


def _all_gather_peers(output, input, *, group, async_op):
    """An all-gather into a contiguous output over a gloo group of 2 or more ranks:
    :class:`_PeerGather`; anything else: torch's."""
    if not output.is_contiguous() or not _gloo(group):
        start = output.data_ptr()
        overlaps = start <= input.data_ptr() < start + output.nbytes
        if overlaps and not _in_place_row(output, input, group):  # else not assumed
            input = input.clone()
        return _all_gather(output, input, group=group, async_op=async_op)
    gathered = _PeerGather([output], [input], group, async_op)
    return gathered if async_op else None


def _all_gather_each(outputs, inputs, *, group, async_op):
    """:meth:`Comm.all_gather_each`: one :class:`_PeerGather` over gloo, else one all-gather
    per pair."""
    if _gloo(group) and all(o.is_contiguous() for o in outputs):
        gathered = _PeerGather(outputs, inputs, group, async_op)
        return gathered if async_op else None
    works = [
        _all_gather_peers(o, i, group=group, async_op=True)
        for o, i in zip(outputs, inputs, strict=True)
    ]
    each = _Each(works)
    if not async_op:
        each.wait()
        return None
    return each
