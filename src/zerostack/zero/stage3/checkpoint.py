"""What a checkpoint reads and writes of ZeRO stage 3 (the strategy's
:class:`~..strategy.CheckpointView`, delegated to :class:`Stage3Checkpoint`).

This rank's slice of each parameter (:meth:`Stage3Checkpoint.owned_slices`, ``frozen_slices``),
its master's value and optimizer state through the master store (``read_master`` /
``write_master``), the full parameters for a consolidated state dict (``full_master``, a
collective), what goes back into the compute-dtype pieces after a load (``after_load``), and
the bytes this rank holds. It is given what it reads: the (sub-)groups, the coordinator's
``owner`` (every parameter, in unit order), the trained parameters, each master's group, the
masters' ``store``, the piece ``swapper`` and the :class:`~.write_back.Stage3WriteBack`.
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm import Comm
from ..offload.param_swap import ParamSwapper, ResidentPieces
from ..strategy import tally
from .collectives import gather_full
from .groups import Group
from .write_back import Stage3WriteBack


class Stage3Checkpoint:
    """The checkpoint's view of stage 3's ``groups``; ``owner`` holds every parameter of the
    module (the others than ``trainable`` are frozen)."""

    def __init__(
        self,
        groups: list[Group],
        *,
        owner: dict[nn.Parameter, int],
        trainable: set[nn.Parameter],
        group_of: dict[nn.Parameter, Group],
        store,
        swapper: ParamSwapper | ResidentPieces,
        writer: Stage3WriteBack,
        comm: Comm,
    ) -> None:
        self.groups, self.owner, self.trainable = groups, owner, trainable
        self.store, self.swapper, self.writer, self.comm = store, swapper, writer, comm
        self.group_of = group_of  # master -> its (sub-)group

    def full_master(self) -> dict[nn.Parameter, torch.Tensor]:
        """Every parameter's full value, fp32 for trained ones (a collective over dp)."""
        out = {}
        params = list(self.owner)
        states = [p._zs for p in params]
        trained: dict[nn.Parameter, torch.Tensor] = {}
        for g in self.groups:
            value, off = self.store.read(g.master), 0
            for p in g.params:
                trained[p] = value[off : off + p._zs.piece.numel()]
                off += p._zs.piece.numel()
        device = self.comm.topo.device
        self.swapper.fetch([p for p in params if p not in self.trainable])
        masters = []
        for p, st in zip(params, states, strict=True):
            m = trained[p] if p in trained else st.piece
            m = m.to(device, torch.float32)  # a 16-bit master too
            masters.append(st.like(m))
        for p, full in zip(params, gather_full(masters, self.comm), strict=True):
            out[p] = full
        self.swapper.drop([p for p in params if p not in self.trainable])
        return out

    @property
    def owns_replica(self) -> bool:
        """Every rank writes its own shard."""
        return True

    def read_master(self, master: nn.Parameter, optimizer, kinds=()) -> dict[str, torch.Tensor]:
        """As :meth:`ShardedDataParallel.read_master`."""
        return self.store.read_state(master, optimizer, kinds)

    def master_kinds(self, master: nn.Parameter, optimizer) -> list[tuple[str, torch.dtype]]:
        """As :meth:`ShardedDataParallel.master_kinds`."""
        return self.store.state_kinds(master, optimizer)

    def write_master(self, master: nn.Parameter, optimizer, values: dict) -> None:
        """Store what :meth:`read_master` gave, filled by a load: on NVMe into the files and the
        compute-dtype pieces (or their files) at once; in memory ``after_load`` writes pieces."""
        if self.store.in_memory:
            return
        self.store.write_state(master, optimizer, values)
        self.writer.write(self.group_of[master], values["master"])

    def group_params(self) -> list[list[nn.Parameter]]:
        """Each optimizer group's trained parameters, in the group's order."""
        count = max((g.index for g in self.groups), default=-1) + 1  # none: forward-only
        out: list[list[nn.Parameter]] = [[] for _ in range(count)]
        for g in self.groups:
            out[g.index].extend(g.params)
        return out

    def owned_slices(self):
        """``(param, lo, hi, master, a, b)``: this rank's master holds elements ``[lo, hi)`` of
        the flattened parameter at ``master[a:b]`` (padding excluded)."""
        for g in self.groups:
            off = 0
            for p in g.params:
                lo, hi = p._zs.extent()
                yield p, lo, hi, g.master, off, off + (hi - lo)
                off += p._zs.piece.numel()

    def frozen_extents(self):
        """``(param, lo, hi)`` of :meth:`frozen_slices`, no piece read in."""
        for p in self.owner:
            if p not in self.trainable:
                yield p, *p._zs.extent()

    def frozen_slices(self, writes: bool = True):
        """``(param, lo, hi, held)`` for each parameter the optimizer does not train (frozen):
        this rank's piece ``held`` (compute dtype) holds elements ``[lo, hi)`` of the flattened
        parameter (padding excluded); a checkpoint reads it and loads into it. A piece kept in a
        file (offload_param) is read in for that, one at a time, and written back after (a load
        may have filled it; a save, ``writes=False``, leaves the file alone)."""
        for p, lo, hi in self.frozen_extents():
            swapped = self.swapper.holds(p)
            self.swapper.fetch([p])
            yield p, lo, hi, p._zs.piece[: hi - lo]
            if swapped:
                if writes:
                    self.swapper.update(p, p._zs.piece)
                self.swapper.drop([p])

    def after_load(self) -> None:
        """Loaded masters into the pieces, and loaded frozen pieces into the gathered copies of
        persistent parameters (a collective over dp)."""
        self.writer.finish()
        self.writer.refresh(self.writer.frozen)

    def close(self) -> None:
        """Remove the NVMe files (also done at process exit)."""
        self.store.close()
        self.swapper.close()

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds in parameter shards (and gathered copies), gradient shards and
        separate fp32 masters."""
        return tally(self.held())

    def held(self):
        """``(kind, device type, bytes)`` of every buffer :meth:`memory_breakdown` counts."""
        device = self.comm.topo.device.type
        for kind, t in self.state_tensors(gathered=False):
            yield kind, t.device.type, t.nbytes
        for p in self.owner:  # gathered copies held right now, on the compute device
            yield "params", device, p._zs.held_bytes

    def state_tensors(self, gathered: bool = True):
        """``(kind, tensor)`` of every buffer this rank keeps between steps: ``params`` (the
        pieces in memory, and with ``gathered`` the whole values of the parameters gathered
        now: persistent ones, and those kept or in use), ``grads`` (gradient shards) and
        ``master`` (separate fp32 masters)."""
        if not self.swapper.offloads:
            pieces = [g.pieces for g in self.groups]
            pieces += [p._zs.stored for p in self.owner if p not in self.trainable]
        else:  # pieces in memory now (a swapped-out one is a stride-0 placeholder)
            pieces = [p._zs.stored for p in self.owner if p._zs.piece.stride() != (0,)]
        if gathered:
            pieces += [p.data for p in self.owner if p._zs.gathered]
        for t in pieces:
            yield "params", t
        for g in self.groups:  # in files the masters hold no storage between steps
            if self.store.in_memory and g.separate_master:
                yield "master", g.master
            if g.grad_shard is not None:
                yield "grads", g.grad_shard
