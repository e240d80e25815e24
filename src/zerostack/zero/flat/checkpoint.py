"""What a checkpoint reads and writes of ZeRO stages 0-2 (the strategy's
:class:`~..strategy.CheckpointView`, delegated to :class:`FlatCheckpoint`).

This rank's slice of each parameter (:meth:`FlatCheckpoint.owned_slices`; frozen parameters,
held whole, in ``frozen_slices``), each master's value and optimizer state through the master
store (``read_master`` / ``write_master``), the full parameters for a consolidated state dict
(``full_master``, all-gathering the pieces at stages 1-2), and what goes back into the
compute-dtype parameters after a load (``after_load``). It is given what it reads: the
:class:`~.buffers.FlatBuffers` (groups, buckets, the parameter index), the masters'
``store`` and the :class:`~.write_back.WriteBack`.
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm import Comm
from ...core.storage import same_storage
from ..strategy import tally
from .buffers import FlatBuffers
from .write_back import WriteBack


class FlatCheckpoint:
    """The checkpoint's view of ``flat`` (of ``module``, whose other parameters are frozen):
    ``sharded``: each rank holds its own part of the state (stages 1-2), else dp rank
    ``rank`` 0 writes it all."""

    def __init__(
        self,
        flat: FlatBuffers,
        *,
        module: nn.Module,
        comm: Comm,
        store,
        writer: WriteBack,
        sharded: bool,
        rank: int,
    ) -> None:
        self.flat, self.module, self.comm = flat, module, comm
        self.store, self.writer = store, writer
        self.sharded, self.rank = sharded, rank

    def full_master(self) -> dict[nn.Parameter, torch.Tensor]:
        """Every trained parameter's fp32 value (all-gathering the pieces at stages 1-2, over
        each flat group's axis)."""
        out = {}
        for fg in self.flat.groups:
            full = torch.empty(
                fg.layout.padded_numel, dtype=torch.float32, device=fg.params_flat.device
            )
            for b in fg.buckets:
                st = self.flat.buckets[b]
                region = full[st.bucket.start : st.bucket.end]
                master = self.master_value(st.master).to(full.device, torch.float32)
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
        return self.sharded or self.rank == 0

    def owned_slices(self):
        """``(param, lo, hi, master, a, b)``: this rank's master holds elements ``[lo, hi)`` of
        the flattened parameter at ``master[a:b]`` (at stage 0, every rank holds all of them)."""
        for st in self.flat.buckets:
            fg = self.flat.group_of(st)
            piece_lo, _ = fg.layout.piece(st.bucket, fg.cut.piece_rank)
            for a, b, p in st.segments:
                start = self.flat.locate(p)[1].start
                yield p, piece_lo + a - start, piece_lo + b - start, st.master, a, b

    def frozen_extents(self):
        """``(param, lo, hi)`` of :meth:`frozen_slices`, without touching the values."""
        for p in self.module.parameters():
            if p not in self.flat:
                yield p, 0, p.numel()

    def frozen_slices(self, writes: bool = True):
        """``(param, lo, hi, held)`` for each parameter the optimizer does not train (frozen):
        every rank holds it whole, so ``[lo, hi)`` is all of it and ``held`` the flattened
        parameter itself, in the compute dtype (a checkpoint reads it and loads into it in
        place, so ``writes`` changes nothing)."""
        for p in self.module.parameters():
            if p not in self.flat:
                if not p.data.is_contiguous():  # so that ``held`` is a view, not a copy
                    p.data = p.data.contiguous()
                yield p, 0, p.numel(), p.data.view(-1)

    def after_load(self) -> None:
        """Loaded masters into the compute-dtype parameters (frozen ones were loaded in place)."""
        self.writer.finish()

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
        st = next(st for st in self.flat.buckets if st.master is master)
        dtype = self.flat.group_of(st).params_flat.dtype
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
        params = [fg.params_flat for fg in self.flat.groups]
        params += [p for p in self.module.parameters() if p not in self.flat]
        grads = [buf for fg in self.flat.groups for buf in (fg.grads_flat, fg.grad_shard)]
        grads += [st.host_grad for st in self.flat.buckets]
        masters = []
        for st in self.flat.buckets:
            base = self.flat.group_of(st).params_flat
            if not same_storage(st.master, base):
                masters.append(st.master)
        scratch = list(self.flat.pool.kept())  # bucket-sized buffers kept for the next backward
        kinds = {"params": params, "grads": grads, "master": masters, "scratch": scratch}
        for kind, tensors in kinds.items():
            for t in tensors:
                if t is not None:
                    yield kind, t
