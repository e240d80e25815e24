"""The process grid: pipeline x data x tensor parallel ranks on one named DeviceMesh.

One :class:`Topology` object is built per job and passed to whatever needs a process group
(joining and leaving the world, ``init_distributed`` and ``shutdown``, is :mod:`zerostack.world`).
Ranks are laid out with tensor parallelism innermost (adjacent ranks share a tp group, as
Megatron does, so tp traffic stays on one node), then data parallelism, then pipeline stages
outermost::

    topo = Topology.build(pp=1, dp=2, tp=1)
    topo.dp_rank, topo.dp_size, topo.group("dp")

Ulysses sequence parallelism (``sp``, DeepSpeed's ``sequence_parallel_size``) splits the dp axis
into runs of ``sp`` neighbouring ranks that read one batch, each a shard of its sequence. The dp
axis keeps every rank that holds the same parameters (DeepSpeed's sequence-data-parallel group):
ZeRO shards and reduces over all of it, while the batch is split over
``data_parallel_size = dp // sp`` replicas.

Ring attention splits the sp ranks again (``ring``, the config's ``ring_parallel_size``): the
sp ranks of a batch are ``ring`` groups of ``ulysses = sp // ring`` neighbours. Ulysses'
all-to-alls run inside each group of neighbours (axis 'ulysses'); the ring passes keys and
values between the groups (axis 'ring': the ranks ``ulysses`` apart). Sequence-parallel rank
``s`` is ring rank ``s // ulysses`` and Ulysses rank ``s % ulysses``.

Expert parallelism (``ep``, a MoE layer's ``ep_size``) is a mesh axis of its own, between dp and
tp: the ``ep`` ranks of a group hold different experts and read different batches. The dp axis
is then the expert-data-parallel group (the ranks holding the same experts), which ZeRO shards
and reduces over; the batch is split over ``data_parallel_size = dp * ep`` replicas. The
parameters every ep rank holds (all but the experts) are held by the ``dp * ep`` ranks of the
``dp_ep`` axis, over which ZeRO stages 1-2 cut their state (DeepSpeed's data-parallel group,
beside its expert-data-parallel one).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from itertools import product
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import ConfigError
from .world import (
    DEFAULT_TIMEOUT,
    _bind_local_device,
    _set_group_timeout,
    hold_groups,
    init_distributed,
    world_device_type,
    world_timeout,
)

AXES = ("pp", "dp", "tp")
EP_AXES = ("pp", "dp", "ep", "tp")  # the mesh's dimensions when ep > 1


class TopologyError(ConfigError):
    """The requested grid does not fit the world (sizes, divisibility) or combines axes that do
    not run together yet; a ``ConfigError``, as ``initialize`` raises it when it builds the grid
    from the config."""


_META = [False]  # inside on_meta(): every engine keeps its tensors on the meta device


@contextmanager
def on_meta():
    """Engines built and run inside keep every tensor on the meta device (shapes, no storage):
    :mod:`zerostack.dryrun`, under torch's fake process group."""
    _META[0] = True
    try:
        yield
    finally:
        _META[0] = False


@dataclass
class Topology:
    """Sizes, this rank's coordinates, and one process group per axis of the pp x dp x tp grid."""

    pp: int
    dp: int
    tp: int
    mesh: DeviceMesh = field(repr=False)
    timeout: timedelta = DEFAULT_TIMEOUT
    sp: int = 1
    """Ulysses sequence-parallel ranks per batch: consecutive runs of the dp axis."""
    ep: int = 1
    """Expert-parallel ranks: a mesh axis between dp and tp (see the module doc)."""
    ring: int = 1
    """Ring-attention ranks among the sp ranks of a batch (``ring`` divides ``sp``)."""
    # the grid's Comm, made by zerostack.comm.grid.comm_for (this module builds none)
    _comm: Any = field(default=None, init=False, repr=False, compare=False)
    _subgroups: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        *,
        pp: int = 1,
        dp: int | None = None,
        tp: int = 1,
        sp: int = 1,
        ep: int = 1,
        ring: int = 1,
        timeout: timedelta | None = None,
    ) -> Topology:
        """Build the grid over the initialised world; ``dp`` defaults to what pp and tp leave.

        ``dp`` counts the sp ranks too (``sp`` must divide it), and ``sp`` counts the ring
        ranks (``ring`` must divide it). Every axis group gets ``timeout``; by default, the
        world group's own timeout.
        """
        if not dist.is_initialized():
            init_distributed(timeout=timeout)
        timeout = timeout or world_timeout()
        world = dist.get_world_size()
        for name, size in (("pp", pp), ("tp", tp), ("sp", sp), ("ep", ep), ("ring", ring)):
            if size < 1:
                raise TopologyError(f"{name}: size must be >= 1, got {size}")
        if dp is None:
            if world % (pp * tp * ep):
                raise TopologyError(
                    f"world size {world} is not divisible by pp * tp * ep = {pp} * {tp} * {ep}"
                )
            dp = world // (pp * tp * ep)
        if pp * dp * ep * tp != world:
            shown = f"{pp} * {dp} * {tp}" + (f" * ep {ep}" if ep > 1 else "")
            raise TopologyError(f"pp * dp * tp = {shown} != world size {world}")
        if dp % sp:
            raise TopologyError(f"sp {sp} does not divide the dp axis of {dp} ranks")
        if sp % ring:
            raise TopologyError(
                f"ring_parallel_size {ring} does not divide sequence_parallel_size {sp} (the "
                "sp ranks are ring groups of Ulysses ranks)"
            )
        device_type = world_device_type()
        if device_type == "cuda":
            _bind_local_device()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # size-1 dims warn about reusing the world group
            if ep > 1:
                mesh = init_device_mesh(device_type, (pp, dp, ep, tp), mesh_dim_names=EP_AXES)
            else:
                mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=AXES)
        topo = cls(pp=pp, dp=dp, tp=tp, mesh=mesh, timeout=timeout, sp=sp, ep=ep, ring=ring)
        for axis in EP_AXES if ep > 1 else AXES:
            _set_group_timeout(topo.group(axis), timeout)
        hold_groups(topo)
        if sp > 1:
            topo.dp_subgroup(sp)  # a collective: made here, while every rank builds the grid
        if 1 < ring < sp:  # both collectives too; at ring 1 or sp the sp group is the other's
            topo.dp_subgroup(sp // ring)
            topo._ring_groups()
        if ep > 1:
            topo._dp_ep_groups()  # a collective too
        return topo

    def _dp_ep_groups(self) -> None:
        """The ``dp_ep`` axis: the ``dp * ep`` ranks at this rank's pp and tp coordinates, in
        rank order (so this rank's place is ``dp_rank * ep + ep_rank``). Every rank makes every
        group, in one order."""
        mine = None
        for p, t in product(range(self.pp), range(self.tp)):
            ranks = [int(r) for r in self.mesh.mesh[p, :, :, t].reshape(-1)]
            group = dist.new_group(ranks, timeout=self.timeout)
            if self.global_rank in ranks:
                mine = group
        self._subgroups["dp_ep"] = mine

    def _ring_groups(self) -> None:
        """The 'ring' axis: in each run of ``sp`` dp neighbours, the ``ring`` ranks
        ``ulysses`` apart. Every rank makes every group, in one order."""
        mesh, mine, u = self.mesh.mesh, None, self.ulysses
        if self.ep == 1:
            mesh = mesh.unsqueeze(2)
        runs = product(range(self.pp), range(self.ep), range(self.tp), range(self.dp // self.sp))
        for p, e, t, run in runs:
            for j in range(u):
                ranks = [int(mesh[p, run * self.sp + g * u + j, e, t]) for g in range(self.ring)]
                group = dist.new_group(ranks, timeout=self.timeout)
                if self.global_rank in ranks:
                    mine = group
        self._subgroups["ring"] = mine

    @property
    def ulysses(self) -> int:
        """Ulysses ranks per ring group: ``sp // ring``."""
        return self.sp // self.ring

    def release_groups(self) -> None:
        """Drop the mesh's references to its groups (:func:`shutdown`; the grid is unusable
        after it)."""
        registry = getattr(self.mesh, "_pg_registry", None)  # torch >= 2.9 keeps the objects
        if registry is not None:
            registry.clear()
        self._subgroups.clear()

    def dp_subgroup(self, size: int) -> dist.ProcessGroup:
        """This rank's group among the dp ranks cut into consecutive runs of ``size`` (ZeRO++
        hpZ's secondary partition: neighbours in dp, so on one node when ``size * tp`` divides
        the ranks per node). A collective: every rank makes every run's group, in one order."""
        if size not in self._subgroups:
            if size < 1 or self.dp % size:
                raise TopologyError(f"a dp subgroup of {size} ranks does not divide dp {self.dp}")
            mesh, mine = self.mesh.mesh, None
            if self.ep == 1:  # the mesh is (pp, dp, tp): one ep coordinate
                mesh = mesh.unsqueeze(2)
            runs = product(range(self.pp), range(self.ep), range(self.tp), range(self.dp // size))
            for p, e, t, run in runs:
                ranks = [int(mesh[p, run * size + j, e, t]) for j in range(size)]
                group = dist.new_group(ranks, timeout=self.timeout)
                if self.global_rank in ranks:
                    mine = group
            self._subgroups[size] = mine
        return self._subgroups[size]

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of this rank along ``axis`` ('pp', 'dp', 'tp'; 'sp' when sp > 1:
        the ranks sharing this rank's batch, and 'ulysses' and 'ring' within it when their size
        is above 1; 'ep' and 'dp_ep' when ep > 1, the latter the ranks holding the same shared
        parameters, the dp axis itself when ep is 1)."""
        if axis == "dp_ep" and self.ep == 1:
            axis = "dp"
        if axis == "dp_ep":
            return self._subgroups["dp_ep"]
        if axis in ("ulysses", "ring"):
            if self.size(axis) == 1:
                raise TopologyError(f"the grid has no {axis} axis (its size is 1)")
            if self.size(axis) == self.sp:
                axis = "sp"
            else:
                return self._subgroups["ring" if axis == "ring" else self.ulysses]
        if axis == "sp":
            if self.sp == 1:
                raise TopologyError("the grid has no sp axis (sp is 1)")
            return self._subgroups[self.sp]
        if axis == "ep" and self.ep == 1:
            raise TopologyError("the grid has no ep axis (ep is 1)")
        return self.mesh.get_group(axis)

    def size(self, axis: str) -> int:
        if axis == "dp_ep":
            return self.dp * self.ep
        sizes = {"pp": self.pp, "dp": self.dp, "tp": self.tp, "sp": self.sp, "ep": self.ep}
        return sizes[axis] if axis in sizes else {"ring": self.ring, "ulysses": self.ulysses}[axis]

    def rank(self, axis: str) -> int:
        """This rank's coordinate along ``axis`` (along 'sp': its sequence shard)."""
        if axis == "sp":
            return self.mesh.get_local_rank("dp") % self.sp
        if axis == "ulysses":
            return self.rank("sp") % self.ulysses
        if axis == "ring":
            return self.rank("sp") // self.ulysses
        if axis == "ep" and self.ep == 1:
            return 0
        if axis == "dp_ep":
            return self.dp_rank * self.ep + self.rank("ep")
        return self.mesh.get_local_rank(axis)

    @property
    def data_parallel_size(self) -> int:
        """Replicas that read different batches: dp * ep / sp (DeepSpeed's
        ``dp_world_size``)."""
        return self.dp * self.ep // self.sp

    @property
    def data_parallel_rank(self) -> int:
        """Which of the :attr:`data_parallel_size` batches this rank reads."""
        return self.dp_rank // self.sp * self.ep + self.rank("ep")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.ep * self.tp

    @property
    def global_rank(self) -> int:
        return dist.get_rank()

    @property
    def dp_rank(self) -> int:
        return self.rank("dp")

    @property
    def dp_size(self) -> int:
        return self.dp

    @property
    def device(self) -> torch.device:
        """The rank's device: its GPU, the CPU, or, inside :func:`on_meta` (a dry run,
        :mod:`zerostack.dryrun`), the meta device, where tensors have shapes and no data."""
        if _META[0]:
            return torch.device("meta")
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def coords(self) -> dict[str, int]:
        return {axis: self.rank(axis) for axis in AXES}
