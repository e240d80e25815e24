"""How stage-3 pieces travel: :func:`gather_full` all-gathers several parameters' pieces in one
collective per axis (plain, as ZeRO++ qwZ's int8 blocks, or as the int8 blocks frozen pieces are
held in), and ZeRO++ hpZ's :class:`Subgroup` and :func:`secondary_piece`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...comm import Comm
from ...config import ConfigError
from ...core import scratch
from .. import partition
from . import quantize
from .params import ShardState


@dataclass
class Subgroup:
    """ZeRO++ hpZ: ``size`` consecutive dp ranks (``group``), this rank ``rank`` among them."""

    size: int
    rank: int
    group: object

    @classmethod
    def of(cls, size: int, topo) -> Subgroup | None:
        """``size`` consecutive dp ranks of ``topo``'s grid (None for 1: no hpZ)."""
        if size == 1:
            return None
        if topo.dp % size:
            raise ConfigError(
                f"zero_optimization.zero_hpz_partition_size: {size} does not divide the "
                f"data-parallel size {topo.dp}"
            )
        return cls(size, topo.dp_rank % size, topo.dp_subgroup(size))


def gather_full(
    states: list[ShardState],
    comm: Comm,
    dtype=None,
    async_op=False,
    quantized: bool = False,
    secondary: Subgroup | None = None,
    record: bool = False,
):
    """All-gather several parameters in one collective; returns their full tensors.

    With ``async_op`` returns a function that waits and returns them. ``quantized`` sends int8
    blocks (ZeRO++ qwZ, :mod:`.quantize`) and returns the dequantized values, in the pieces'
    dtype (or ``dtype``). ``secondary`` gathers the states' secondary pieces (ZeRO++ hpZ, see
    :func:`secondary_piece`) within that subgroup instead of the pieces over dp. ``record``:
    launched on a side stream, the receive buffer is marked used by the stream that waits
    (``Tensor.record_stream``), which reads it and may free it.
    """
    if secondary is not None:
        pieces = [s.secondary for s in states]
        return _gather_rows(states, pieces, comm, secondary.size, async_op, "hpz", secondary.group)
    keys = [(s.axis, _held_quantized(s)) for s in states]
    if len(set(keys)) > 1:  # one collective per axis and kind, in one order on all ranks
        parts = [[i for i, k in enumerate(keys) if k == key] for key in sorted(set(keys))]
        waits = [
            (idx, gather_full([states[i] for i in idx], comm, dtype, True, quantized, None, record))
            for idx in parts
        ]

        def joined() -> list[torch.Tensor]:
            out: list = [None] * len(states)
            for idx, wait in waits:
                for i, full in zip(idx, wait(), strict=True):
                    out[i] = full
            return out

        return joined if async_op else joined()
    axis, world = states[0].axis, states[0].world
    pieces = [s.piece if dtype is None else s.piece.to(dtype) for s in states]
    if world == 1:
        fulls = [pc[: s.numel].view(s.shape) for pc, s in zip(pieces, states, strict=True)]
        return (lambda: fulls) if async_op else fulls
    if keys[0][1]:  # frozen pieces held as int8 blocks: gathered as they are held
        return _gather_held(states, comm, dtype, async_op, record)
    if quantized:
        return _gather_quantized(states, pieces, comm, async_op, record)
    return _gather_rows(states, pieces, comm, world, async_op, axis, None, record)


def _gather_rows(
    states, pieces, comm: Comm, world: int, async_op: bool, axis: str, group, record=False
):
    """One all-gather of the ``pieces`` (each rank's, equal widths) over ``axis`` (or ``group``,
    of ``world`` ranks); rank ``r``'s row holds piece ``r`` of every state. Over gloo each
    piece goes straight into its parameter's full tensor; elsewhere the pieces are sent as one
    concatenation and copied out of what arrives."""
    if comm.gathers_each(axis, group):
        fulls = [scratch.empty(world * pc.numel(), pc.dtype, pc.device) for pc in pieces]
        handle = comm.all_gather_each(fulls, pieces, axis=axis, async_op=True, group=group)

        def received() -> list[torch.Tensor]:
            handle.wait()
            return [f[: s.numel].view(s.shape) for f, s in zip(fulls, states, strict=True)]

        return received if async_op else received()
    flat = pieces[0]  # one piece is sent as it is
    if len(pieces) > 1:
        flat = scratch.empty(sum(pc.numel() for pc in pieces), flat.dtype, flat.device)
        torch.cat(pieces, out=flat)
    width = flat.numel()
    out = scratch.empty(world * width, flat.dtype, flat.device)
    handle = comm.all_gather(out, flat, axis=axis, async_op=True, group=group)
    del flat  # the collective keeps what it sends alive until it completes

    def finish() -> list[torch.Tensor]:
        handle.wait()
        if record:
            out.record_stream(torch.cuda.current_stream())
        rows = out.view(world, width)
        fulls, off = [], 0
        for s, pc in zip(states, pieces, strict=True):
            pn = pc.numel()
            full = out  # a unit of one parameter: a view of the fresh ``out``
            if len(states) > 1:  # one copy of the strided column block
                full = scratch.empty(world * pn, out.dtype, out.device)
                full.view(world, pn).copy_(rows[:, off : off + pn])
            fulls.append(full[: s.numel].view(s.shape))
            off += pn
        return fulls

    return finish if async_op else finish()


def secondary_piece(full: torch.Tensor, sub: Subgroup) -> torch.Tensor:
    """This rank's piece of ``full`` cut ``sub.size`` ways (padded), a copy: ZeRO++ hpZ keeps it
    from a forward's gather so that the backward gathers within the subgroup."""
    flat = full.reshape(-1)
    width = partition.piece_numel(flat.numel(), sub.size)
    lo, hi = partition.piece_extent(flat.numel(), width, sub.rank)
    piece = torch.zeros(width, dtype=flat.dtype, device=flat.device)
    piece[: hi - lo].copy_(flat[lo:hi])
    return piece


def _held_quantized(s: ShardState) -> bool:
    """Whether ``s`` holds its piece as int8 blocks (:mod:`.frozen_pieces`)."""
    return "payload" in s.__dict__


def _gather_bytes(states, payload: torch.Tensor, comm: Comm, async_op: bool, record: bool, decode):
    """All-gather one uint8 ``payload`` per rank over the states' axis; ``decode(rows)`` turns
    the (world, bytes) rows into the states' full tensors."""
    world = states[0].world
    out = torch.empty(world * payload.numel(), dtype=torch.uint8, device=payload.device)
    handle = comm.all_gather(out, payload, axis=states[0].axis, async_op=True)
    del payload  # the collective keeps what it sends alive until it completes

    def finish() -> list[torch.Tensor]:
        handle.wait()
        if record:
            out.record_stream(torch.cuda.current_stream())
        return decode(out.view(world, -1))

    return finish if async_op else finish()


def _gather_held(states, comm: Comm, dtype, async_op: bool, record: bool = False):
    """:func:`gather_full` of pieces held as qwZ payloads: each piece's payload sent as it is,
    every rank's dequantized on arrival (in ``dtype``, or the piece's)."""
    payloads = [s.payload for s in states]
    flat = payloads[0] if len(payloads) == 1 else torch.cat(payloads)

    def decode(rows: torch.Tensor) -> list[torch.Tensor]:
        fulls, off = [], 0
        for s, pl in zip(states, payloads, strict=True):
            part = rows[:, off : off + pl.numel()].contiguous()
            value = quantize.unpack(part, [s.width], dtype or s.dtype)[0]
            fulls.append(value.reshape(-1)[: s.numel].view(s.shape))
            off += pl.numel()
        return fulls

    return _gather_bytes(states, flat, comm, async_op, record, decode)


def _gather_quantized(states, pieces, comm: Comm, async_op: bool, record: bool = False):
    """:func:`gather_full` of int8 blocks: one uint8 payload per rank (:func:`.quantize.pack`)."""
    numels = [pc.numel() for pc in pieces]

    def decode(rows: torch.Tensor) -> list[torch.Tensor]:
        values = quantize.unpack(rows, numels, pieces[0].dtype)
        return [v.reshape(-1)[: s.numel].view(s.shape) for v, s in zip(values, states, strict=True)]

    return _gather_bytes(states, quantize.pack(pieces), comm, async_op, record, decode)
