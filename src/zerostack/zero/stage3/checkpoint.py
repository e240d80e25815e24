"""What a checkpoint reads and writes of ZeRO stage 3 (mixed into :class:`~.stage3.Stage3`).

This rank's slice of each parameter (:meth:`Stage3State.owned_slices`, ``frozen_slices``), its
master's value and optimizer state through the master store (``read_master`` /
``write_master``), the full parameters for a consolidated state dict (``full_master``, a
collective), and what goes back into the compute-dtype pieces after a load (``after_load``).
It uses the strategy's own parts: ``groups`` (fp32 masters by sub-group), ``store`` (the
masters' store), ``param_swapper`` (where the pieces live), ``_owner`` and ``_trainable``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..strategy import tally
from .collectives import gather_full


class Stage3State:
    def full_master(self) -> dict[nn.Parameter, torch.Tensor]:
        """Every parameter's full value, fp32 for trained ones (a collective over dp)."""
        out = {}
        params = list(self._owner)
        states = [p._zs for p in params]
        trained: dict[nn.Parameter, torch.Tensor] = {}
        for g in self.groups:
            value, off = self.store.read(g.master), 0
            for p in g.params:
                trained[p] = value[off : off + p._zs.piece.numel()]
                off += p._zs.piece.numel()
        device = self.comm.topo.device
        self.param_swapper.fetch([p for p in params if p not in self._trainable])
        masters = []
        for p, st in zip(params, states, strict=True):
            m = trained[p] if p in trained else st.piece.float()
            m = m.to(device)
            masters.append(st.like(m))
        for p, full in zip(params, gather_full(masters, self.comm), strict=True):
            out[p] = full
        self.param_swapper.drop([p for p in params if p not in self._trainable])
        return out

    @property
    def owns_replica(self) -> bool:
        """Every rank writes its own shard."""
        return True

    def state_axis(self, p: nn.Parameter) -> str | None:
        """The axis over which ``p``'s master is cut, None where one rank holds all of it."""
        return p._zs.axis if p._zs.world > 1 else None

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
        self._write_pieces(self._group_of[master], values["master"])

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
        for p in self._owner:
            if p not in self._trainable:
                yield p, *p._zs.extent()

    def frozen_slices(self, writes: bool = True):
        """``(param, lo, hi, held)`` for each parameter the optimizer does not train (frozen):
        this rank's piece ``held`` (compute dtype) holds elements ``[lo, hi)`` of the flattened
        parameter (padding excluded); a checkpoint reads it and loads into it. A piece kept in a
        file (offload_param) is read in for that, one at a time, and written back after (a load
        may have filled it; a save, ``writes=False``, leaves the file alone)."""
        for p, lo, hi in self.frozen_extents():
            swapped = self.param_swapper.holds(p)
            self.param_swapper.fetch([p])
            yield p, lo, hi, p._zs.piece[: hi - lo]
            if swapped:
                if writes:
                    self.param_swapper.update(p, p._zs.piece)
                self.param_swapper.drop([p])

    def after_load(self) -> None:
        """Loaded masters into the pieces, and loaded frozen pieces into the gathered copies of
        persistent parameters (a collective over dp)."""
        self.write_back()
        self._refresh_persistent([p for p in self._persistent if p not in self._trainable])

    # ------------------------------------------------------------------ one parameter
    def is_trained(self, p: nn.Parameter) -> bool:
        """Whether the optimizer steps ``p`` (it has a master and gradient pieces here)."""
        return p in self._trainable

    def window_grad(self, p: nn.Parameter) -> torch.Tensor:
        """``p``'s gradient so far in this accumulation window, whole and flat in fp32, summed
        over dp and scaled as its master gets it (times :meth:`grad_post` is the mean): every
        rank's piece, all-gathered (a collective over dp). ``p.grad`` is None after backward
        at stage 3; the pieces are where the gradient is."""
        st = p._zs
        self.downloads.settle()
        piece = self.grads.piece(p).to(device=self.comm.topo.device, dtype=torch.float32)
        return gather_full([st.like(piece)], self.comm)[0].reshape(-1)

    def local_grad(self, p: nn.Parameter) -> torch.Tensor:
        """This rank's piece of ``p``'s gradient (padding included), summed and scaled."""
        self.downloads.settle()
        return self.grads.piece(p).to(torch.float32, copy=True)

    def hold_grad(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Make ``value`` (flat fp32, summed over dp and scaled, as :meth:`window_grad` gives
        it) ``p``'s gradient in this window: this rank's piece of it."""
        self.hold_local_grad(p, self._own_piece(p, value))

    def hold_local_grad(self, p: nn.Parameter, piece: torch.Tensor) -> None:
        """Make ``piece`` (this rank's, padded, summed and scaled as :meth:`local_grad`
        gives it) ``p``'s gradient piece, in its shard or its file."""
        lo, hi = p._zs.extent()
        piece = piece.to(torch.float32, copy=True)
        piece[hi - lo :] = 0.0  # the padding is no part of the gradient
        self.grads.replace(p, piece)  # a shard in memory, or a file and its norm

    def _own_piece(self, p: nn.Parameter, value: torch.Tensor) -> torch.Tensor:
        """This rank's piece (padded with zeros) of ``value``, ``p``'s whole flat value."""
        lo, hi = p._zs.extent()
        piece = torch.zeros(p._zs.piece.numel(), dtype=torch.float32, device=value.device)
        piece[: hi - lo] = value[lo:hi]
        return piece

    def write_param(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Set the compute-dtype parameter to ``value`` (flat, this rank's whole parameter):
        this rank's piece (in memory or its file), and the gathered copy a persistent one
        keeps."""
        st = p._zs
        piece = self._own_piece(p, value)
        if self.param_swapper.holds(p):  # its file (offload_param)
            self.param_swapper.update(p, piece)
        if st.piece.stride() != (0,):  # in memory (a swapped-out piece is a placeholder)
            st.write(piece)
        if st.gathered and p.numel() == st.numel:
            p.data.copy_(value.view_as(p))

    def close(self) -> None:
        """Remove the NVMe files (also done at process exit)."""
        self.store.close()
        self.param_swapper.close()

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds in parameter shards (and gathered copies), gradient shards and
        separate fp32 masters."""
        return tally(self.held())

    def held(self):
        """``(kind, device type, bytes)`` of every buffer :meth:`memory_breakdown` counts."""
        device = self.comm.topo.device.type
        for kind, t in self.state_tensors(gathered=False):
            yield kind, t.device.type, t.nbytes
        for p in self._owner:  # gathered copies held right now, on the compute device
            yield "params", device, p._zs.held_bytes

    def state_tensors(self, gathered: bool = True):
        """``(kind, tensor)`` of every buffer this rank keeps between steps: ``params`` (the
        pieces in memory, and with ``gathered`` the whole values of the parameters gathered
        now: persistent ones, and those kept or in use), ``grads`` (gradient shards) and
        ``master`` (separate fp32 masters)."""
        if not self.param_swapper.offloads:
            pieces = [g.pieces for g in self.groups]
            pieces += [p._zs.stored for p in self._owner if p not in self._trainable]
        else:  # pieces in memory now (a swapped-out one is a stride-0 placeholder)
            pieces = [p._zs.stored for p in self._owner if p._zs.piece.stride() != (0,)]
        if gathered:
            pieces += [p.data for p in self._owner if p._zs.gathered]
        for t in pieces:
            yield "params", t
        for g in self.groups:  # in files the masters hold no storage between steps
            if self.store.in_memory and (
                g.pieces is None or g.pieces.data_ptr() != g.master.data_ptr()
            ):
                yield "master", g.master
            if g.grad_shard is not None:
                yield "grads", g.grad_shard
