"""Stage-3 parameter shards: the per-parameter record (:class:`ShardState` as ``p._zs``), and
gathering and releasing the whole parameter from the dp ranks' pieces.

A sharded parameter keeps its full shape in ``p._zs`` and holds in ``p.data`` an empty tensor
until gathered. Every rank stores piece ``r`` of the parameter, flattened and padded to ``dp``
equal pieces of whole 16-byte blocks (:func:`.partition.piece_numel`); with expert parallelism,
what every ep rank holds is cut over the ``dp * ep`` ranks of the ``dp_ep`` axis instead
(``p._zs.axis``). ``zero.Init`` and
``GatheredParameters`` (:mod:`.init`), the coordinator and the stage build on these.
"""

from __future__ import annotations

import enum
import itertools
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..comm import Comm
from ..config import ConfigError
from ..core import scratch
from . import partition, quantize


class StorageMeter:
    """Bytes of parameter storage held (shards and gathered copies), and the peak.

    Counted where zerostack allocates and frees parameter storage, so the figure is what the
    program holds, not an estimate from the allocator and not the process RSS.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def sub(self, nbytes: int) -> None:
        self.live -= nbytes

    def track(self, t: torch.Tensor) -> torch.Tensor:
        """Count ``t`` until its Python object is freed (for shards, which nothing else holds)."""
        self.add(t.nbytes)
        weakref.finalize(t, self.sub, t.nbytes)
        return t


@dataclass
class ShardState:
    """What a stage-3 parameter is when it is not gathered."""

    shape: torch.Size
    numel: int
    piece: torch.Tensor  # this rank's piece of the flattened, padded parameter
    persistent: bool = False  # small parameters stay gathered (stage3_param_persistence_threshold)
    active: int = 0  # how many gathers hold it (a tied parameter can be held by two modules)
    by_modules: int = 0  # of those, modules running with it (not GatheredParameters)
    kept: bool = False  # released by its unit but kept whole for a reuse soon (max_reuse_distance)
    held_bytes: int = 0  # bytes of the gathered copy, while there is one
    master: torch.Tensor | None = None  # fp32 view into the group's master shard (engine)
    grad: torch.Tensor | None = None  # fp32 view into the group's gradient shard (engine)
    comm: Comm | None = None  # whose dp group holds the other pieces
    meter: StorageMeter | None = None  # counts the piece and gathered copies
    swapper: object | None = None  # zero.Init(remote_device=...): the store holding the piece
    secondary: torch.Tensor | None = None  # hpZ: a forward's copy of this rank's subgroup piece
    # the grid axis whose ranks hold the pieces ('dp'; 'dp_ep' for what every ep rank holds of
    # a MoE model), how many they are, and this rank's place among them
    axis: str = "dp"
    world: int = 1
    rank: int = 0
    owner: weakref.ref | None = None  # the parameter, whose ds_tensor is the piece

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        if name == "piece" and (owner := self.__dict__.get("owner")) is not None:
            p = owner()
            if p is not None:
                p.ds_tensor = value  # DeepSpeed's name for this rank's partition

    @property
    def gathered(self) -> bool:
        return self.active > 0 or self.persistent or self.kept

    def extent(self, rank: int | None = None) -> tuple[int, int]:
        """``[lo, hi)`` of the flattened parameter that piece ``rank`` holds (this rank's by
        default)."""
        rank = self.rank if rank is None else rank
        return partition.piece_extent(self.numel, self.piece.numel(), rank)

    def like(self, piece: torch.Tensor) -> ShardState:
        """A record of ``piece`` cut as this parameter is (to gather it)."""
        cut = {"axis": self.axis, "world": self.world, "rank": self.rank}
        return ShardState(self.shape, self.numel, piece, **cut)


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's ``ds_status`` of a stage-3 parameter (same names and values)."""

    AVAILABLE = 1  # gathered: ``p.data`` is the whole parameter
    NOT_AVAILABLE = 2  # released: ``p.data`` is empty, only this rank's piece is held
    INFLIGHT = 3  # DeepSpeed's state while a gather runs; zerostack's gathers complete in place


_ds_ids = itertools.count()


class ActiveUses:
    """``param.ds_active_sub_modules``: the modules now holding a stage-3 parameter gathered,
    as DeepSpeed's set of them is read and cleared (TRL clears it before taking the hooks off);
    here they are counted (``ShardState.by_modules``), not named."""

    def __init__(self, state: ShardState) -> None:
        self._state = state

    def __len__(self) -> int:
        return self._state.by_modules

    def __bool__(self) -> bool:
        return self._state.by_modules > 0

    def clear(self) -> None:
        """No module holds the parameter any more: it is released as soon as nothing else
        (``GatheredParameters``, persistence, a reuse soon) keeps it."""
        self._state.active -= self._state.by_modules
        self._state.by_modules = 0

    def __repr__(self) -> str:
        return f"ActiveUses({self._state.by_modules})"


def _mark_ds(p: nn.Parameter, state: ShardState) -> None:
    """DeepSpeed's attributes on a stage-3 parameter, which Transformers, PEFT and TRL read
    (``ds_shape`` and ``ds_numel`` for the real size of a parameter whose ``shape`` is empty;
    ``ds_tensor``, this rank's flat padded piece, which DeepSpeed-Chat's scripts test for)."""
    state.owner = weakref.ref(p)
    p.ds_tensor = state.piece
    p.ds_id = next(_ds_ids)
    p.ds_shape = state.shape
    p.ds_numel = state.numel
    p.ds_persist = False
    p.ds_status = ZeroParamStatus.NOT_AVAILABLE
    p.ds_active_sub_modules = ActiveUses(state)


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a stage-3 parameter (its value is this rank's piece, ``p._zs``)."""
    return hasattr(p, "_zs")


def full_shape(p: torch.Tensor) -> torch.Size:
    """``p``'s shape, the whole parameter's even when only a piece is held (stage 3)."""
    return p._zs.shape if is_sharded(p) else p.shape


def empty_like_released(p: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=p.dtype, device=p.device)


def hold(p: nn.Parameter, full: torch.Tensor, meter: StorageMeter | None, copied: bool) -> None:
    """Point ``p`` at its gathered value (counted in ``meter`` when it is a fresh copy)."""
    p.data = full
    p.ds_status = ZeroParamStatus.AVAILABLE
    if meter is not None and p._zs.held_bytes:
        meter.sub(p._zs.held_bytes)
        p._zs.held_bytes = 0
    if copied and meter is not None:
        p._zs.held_bytes = full.nbytes
        meter.add(full.nbytes)


def release(p: nn.Parameter, meter: StorageMeter | None) -> None:
    """Drop ``p``'s gathered value, keeping only the shard."""
    p.data = empty_like_released(p)
    p.ds_status = ZeroParamStatus.NOT_AVAILABLE
    if meter is not None:
        meter.sub(p._zs.held_bytes)
    p._zs.held_bytes = 0


def shard_param(
    p: nn.Parameter, comm: Comm, meter: StorageMeter | None = None, axis: str = "dp"
) -> ShardState:
    """Replace ``p``'s data by this rank's piece of it cut over ``axis`` (after broadcasting
    the values of that axis's rank 0)."""
    n, world, rank = p.numel(), comm.topo.size(axis), comm.topo.rank(axis)
    # on the device before anything else (a module builds its parameters in host memory, and
    # NCCL broadcasts device tensors only); frozen ones too, even with nothing to broadcast
    full = p.data.to(comm.topo.device).contiguous()
    if world > 1:
        comm.broadcast(full, src=0, axis=axis)
    piece_numel = partition.piece_numel(n, world)
    padded = torch.zeros(piece_numel * world, dtype=full.dtype, device=full.device)
    padded[:n].copy_(full.reshape(-1))
    piece = padded[rank * piece_numel : (rank + 1) * piece_numel].clone()
    if meter is not None:
        meter.track(piece)
    state = ShardState(p.shape, n, piece, comm=comm, meter=meter, axis=axis, world=world, rank=rank)
    p._zs = state
    p.data = empty_like_released(p)
    _mark_ds(p, state)
    return state


def cut_all(params: list[nn.Parameter], comm: Comm, meter: StorageMeter, wide: set) -> None:
    """Make each of ``params`` a stage-3 parameter counted in ``meter``: cut over dp, or over
    the dp_ep axis for those in ``wide`` (what every ep rank holds and trains). One built under
    ``zero.Init`` (cut over dp: a MoE model built so is refused at initialize) keeps its piece
    where it is cut as the grid cuts it; one cut over other ranks is refused."""
    topo = comm.topo
    for p in params:
        axis = "dp_ep" if p in wide else "dp"
        if not is_sharded(p):
            shard_param(p, comm, meter, axis)
        elif (p._zs.world, p._zs.rank) != (topo.size(axis), topo.rank(axis)):
            raise ConfigError(
                f"zero.Init with this grid (ep {topo.ep}, tp {topo.tp}, pp {topo.pp}): it cut "
                f"each parameter over {p._zs.world} ranks, the grid's ZeRO-3 over "
                f"{topo.size(axis)}; build the model outside zero.Init, or give zero.Init this "
                "grid's topology"
            )
        else:
            meter.track(p._zs.piece)
        p._zs.comm, p._zs.meter = comm, meter


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
    axes = sorted({s.axis for s in states})
    if len(axes) > 1:  # one collective per axis, in one order on every rank
        parts = [[i for i, s in enumerate(states) if s.axis == axis] for axis in axes]
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


def _gather_quantized(states, pieces, comm: Comm, async_op: bool, record: bool = False):
    """:func:`gather_full` of int8 blocks: one uint8 payload per rank (:func:`.quantize.pack`)."""
    world = states[0].world
    payload = quantize.pack(pieces)
    out = torch.empty(world * payload.numel(), dtype=torch.uint8, device=payload.device)
    handle = comm.all_gather(out, payload, axis=states[0].axis, async_op=True)
    del payload

    def finish() -> list[torch.Tensor]:
        handle.wait()
        if record:
            out.record_stream(torch.cuda.current_stream())
        rows = out.view(world, -1)
        numels = [pc.numel() for pc in pieces]
        values = quantize.unpack(rows, numels, pieces[0].dtype)
        return [v.reshape(-1)[: s.numel].view(s.shape) for v, s in zip(values, states, strict=True)]

    return finish if async_op else finish()
