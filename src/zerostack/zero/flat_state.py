"""What a checkpoint reads and writes of ZeRO stages 0-2 (mixed into
:class:`~.sharded_optimizer.ShardedDataParallel`).

This rank's slice of each parameter (:meth:`FlatState.owned_slices`; frozen parameters, held
whole, in ``frozen_slices``), each master's value and optimizer state through the master store
(``read_master`` / ``write_master``), the full parameters for a consolidated state dict
(``full_master``, all-gathering the pieces at stages 1-2), and what goes back into the
compute-dtype parameters after a load (``after_load``). It uses the strategy's own parts:
``groups`` (flat buffers and layouts), ``buckets`` (each bucket's master and segments),
``store`` and ``_where``.
"""

from __future__ import annotations

import torch
from torch import nn

from .strategy import tally


class FlatState:
    def full_master(self) -> dict[nn.Parameter, torch.Tensor]:
        """Every trained parameter's fp32 value (all-gathering the pieces at stages 1-2, over
        each flat group's axis)."""
        out = {}
        for fg in self.groups:
            full = torch.empty(
                fg.layout.padded_numel, dtype=torch.float32, device=fg.params_flat.device
            )
            for b in fg.buckets:
                st = self.buckets[b]
                region = full[st.bucket.start : st.bucket.end]
                master = self.master_value(st.master).to(full.device)
                if fg.cut.world == 1:
                    region.copy_(master)
                else:
                    self.comm.all_gather(region, master.clone(), axis=fg.cut.axis)
            for slot in fg.layout.slots:
                out[fg.params[slot.index]] = full[slot.offset : slot.end].view(slot.shape)
        return out

    @property
    def owns_replica(self) -> bool:
        """Whether this rank writes the state it holds: its own part, or dp rank 0 the whole
        (replicated, stage 0)."""
        return self.sharded_state or self.rank == 0

    def group_params(self) -> list[list[nn.Parameter]]:
        """Each optimizer group's trained parameters, in the group's order."""
        return [[p for g in flats for p in self.groups[g].params] for flats in self._of_group]

    def owned_slices(self):
        """``(param, lo, hi, master, a, b)``: this rank's master holds elements ``[lo, hi)`` of
        the flattened parameter at ``master[a:b]`` (at stage 0, every rank holds all of them)."""
        for st in self.buckets:
            fg = self.groups[st.group]
            piece_lo, _ = fg.layout.piece(st.bucket, fg.cut.piece_rank)
            for a, b, p in st.segments:
                start = self._where[p][1].start
                yield p, piece_lo + a - start, piece_lo + b - start, st.master, a, b

    def frozen_extents(self):
        """``(param, lo, hi)`` of :meth:`frozen_slices`, without touching the values."""
        for p in self.module.parameters():
            if p not in self._where:
                yield p, 0, p.numel()

    def frozen_slices(self, writes: bool = True):
        """``(param, lo, hi, held)`` for each parameter the optimizer does not train (frozen):
        every rank holds it whole, so ``[lo, hi)`` is all of it and ``held`` the flattened
        parameter itself, in the compute dtype (a checkpoint reads it and loads into it in
        place, so ``writes`` changes nothing)."""
        for p in self.module.parameters():
            if p not in self._where:
                if not p.data.is_contiguous():  # so that ``held`` is a view, not a copy
                    p.data = p.data.contiguous()
                yield p, 0, p.numel(), p.data.view(-1)

    def after_load(self) -> None:
        """Loaded masters into the compute-dtype parameters (frozen ones were loaded in place)."""
        self.write_back()

    # ------------------------------------------------------------------ one parameter
    def state_axis(self, p: nn.Parameter) -> str | None:
        """The axis over which ``p``'s master is cut, None where every rank holds it whole."""
        b, _ = self._where[p]
        fcut = self.groups[self.buckets[b].group].cut
        return fcut.axis if fcut.world > 1 else None

    def is_trained(self, p: nn.Parameter) -> bool:
        """Whether the optimizer steps ``p`` (it has a master and gradients here)."""
        return p in self._where

    def window_grad(self, p: nn.Parameter) -> torch.Tensor:
        """``p``'s gradient so far in this accumulation window, whole and flat in fp32, summed
        over dp and scaled as its master gets it at the step (times :meth:`grad_post` is the
        mean). A collective over dp: at stages 0-1 it waits for the boundary's reduction if
        backward launched it, or sums a copy of the local gradients mid-window."""
        b, rng = self._where[p]
        return self.grads.window_grad(p, self.buckets[b], rng)

    def hold_grad(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Make ``value`` (flat fp32, summed over dp and scaled, as :meth:`window_grad` gives
        it) ``p``'s gradient in this window, where the step reads it."""
        b, rng = self._where[p]
        self.grads.hold_grad(self.buckets[b], rng, value)

    def write_param(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Set the compute-dtype parameter to ``value`` (flat, this rank's whole parameter):
        every rank holds all of it, so nothing is gathered."""
        p.data.copy_(value.view_as(p))

    def master_value(self, master: nn.Parameter) -> torch.Tensor:
        """A master's current fp32 value (read back from its file when it is on NVMe)."""
        return self.store.read(master)

    def read_master(self, master: nn.Parameter, optimizer, kinds=()) -> dict[str, torch.Tensor]:
        """``master``'s fp32 value (``"master"``) and its optimizer-state tensors, flat, for a
        checkpoint: the live tensors (a load fills them in place), or on NVMe copies read from
        the files, which :meth:`write_master` stores back. State ``kinds`` it lacks are zeros."""
        return self.store.read_state(master, optimizer, kinds)

    def master_kinds(self, master: nn.Parameter, optimizer) -> list[tuple[str, torch.dtype]]:
        """``(kind, dtype)`` of what :meth:`read_master` gives, nothing read (a save plans its
        file's header with it)."""
        return self.store.state_kinds(master, optimizer)

    def write_master(self, master: nn.Parameter, optimizer, values: dict) -> None:
        """Store what :meth:`read_master` gave, filled by a load: on NVMe into the files, and the
        value kept for ``after_load`` to write into the parameters (in memory: already there)."""
        if self.store.in_memory:
            return
        self.store.write_state(master, optimizer, values)
        st = next(st for st in self.buckets if st.master is master)
        dtype = self.groups[st.group].params_flat.dtype
        st.updated = values["master"].to(device=self.comm.topo.device, dtype=dtype, copy=True)

    def close(self) -> None:
        """Remove the NVMe files (also done at process exit)."""
        self.store.close()

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients and separate fp32 master weights
        (offloaded masters count as host bytes; on NVMe only those swapped in right now)."""
        return tally(self.held())

    def held(self):
        """``(kind, device type, bytes)`` of every buffer :meth:`memory_breakdown` counts."""
        for kind, t in self.state_tensors():
            yield kind, t.device.type, t.nbytes

    def state_tensors(self):
        """``(kind, tensor)`` of every buffer this rank keeps between steps: ``params`` (the
        flat compute-dtype buffers and frozen parameters), ``grads``, ``master`` (separate
        fp32 masters only) and ``scratch`` (bucket buffers kept for the next backward)."""
        params = [fg.params_flat for fg in self.groups]
        params += [p for p in self.module.parameters() if p not in self._where]
        grads = [buf for fg in self.groups for buf in (fg.grads_flat, fg.grad_shard)]
        grads += [st.host_grad for st in self.buckets]
        masters = []
        for st in self.buckets:
            base = self.groups[st.group].params_flat
            if not base.data_ptr() <= st.master.data_ptr() < base.data_ptr() + base.nbytes:
                masters.append(st.master)
        scratch = list(self.buffers.kept())  # bucket-sized buffers kept for the next backward
        kinds = {"params": params, "grads": grads, "master": masters, "scratch": scratch}
        for kind, tensors in kinds.items():
            for t in tensors:
                if t is not None:
                    yield kind, t
