"""Stage-3 parameter shards: the per-parameter record (:class:`ShardState` as ``p._zs``), and
gathering and releasing the whole parameter from the dp ranks' pieces.

A sharded parameter keeps its full shape in ``p._zs`` and holds in ``p.data`` an empty tensor
until gathered. Every rank stores piece ``r`` of the parameter, flattened and padded to ``dp``
equal pieces of whole 16-byte blocks (:func:`..partition.piece_numel`); with expert parallelism,
what every ep rank holds is cut over the ``dp * ep`` ranks of the ``dp_ep`` axis instead
(``p._zs.axis``). ``zero.Init`` and
``GatheredParameters`` (:mod:`..init`), the coordinator and the stage build on these.
"""

from __future__ import annotations

import enum
import itertools
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ...comm import Comm
from ...config import ConfigError
from .. import partition


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
                p.ds_tensor = self.stored  # DeepSpeed's name for this rank's partition

    @property
    def stored(self) -> torch.Tensor:
        """The tensor whose storage holds the piece (a quantized piece's: its payload)."""
        return self.piece

    def write(self, value: torch.Tensor) -> None:
        """Set the piece's values to ``value`` (this rank's, padded), in place."""
        self.piece.copy_(value)

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
