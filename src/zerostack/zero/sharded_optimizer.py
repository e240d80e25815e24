"""ZeRO stages 0, 1 and 2: flat buffers, bucketed overlapped gradient reduction, sharded masters.

Each optimizer group's trainable parameters become views into one flat buffer in the compute
dtype (see :mod:`.partition` for the layout: buckets padded to a multiple of the dp size, rank
``r`` owning piece ``r`` of each bucket). A post-accumulate-grad hook counts the ready parameters
of each bucket and launches its collective asynchronously while backward goes on. Buckets launch
strictly in order, so every rank issues the same collectives in the same order even when gradients
become ready in a different order.

========  ==========================  ===============================  =========================
stage     gradients held              reduction                        fp32 master + optimizer
========  ==========================  ===============================  =========================
0         full, compute dtype         all-reduce, on the boundary      full
1         full, compute dtype         reduce-scatter, on the boundary  this rank's pieces
2         this rank's pieces, fp32    reduce-scatter, every micro-step this rank's pieces
========  ==========================  ===============================  =========================

The optimizer sees, per group, one fp32 tensor per bucket: this rank's piece (with the default
bucket size that is one tensor per group). In fp32 training at stages 0-2 those tensors are views of
the parameter buffer itself, so no master copy exists; in fp16/bf16 they are separate fp32 masters
made from the original fp32 weights. After a step at stages 1-2 the updated pieces are all-gathered
into every rank's parameter buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..comm import Comm, Handle
from ..precision import Precision
from .offload import HostMeter, NVMeStore, OptimizerSwapper, host_device, to_host
from .partition import Bucket, FlatLayout
from .reducer import GradReducer
from .strategy import StepSequence


def sync_from_rank0(tensors: list[torch.Tensor], comm: Comm, dtype: torch.dtype) -> None:
    """Broadcast tensors the optimizer does not own (frozen parameters, buffers) from dp rank 0,
    so every rank starts alike, and cast the floating-point ones to the compute dtype."""
    for t in tensors:
        if comm.topo.dp > 1:
            comm.broadcast(t.data, src=0, axis="dp")
        if t.is_floating_point() and t.dtype != dtype:
            t.data = t.data.to(dtype)


def live_state(master: nn.Parameter, optimizer, kinds=()) -> dict[str, torch.Tensor]:
    """A master in memory and its optimizer-state tensors of its size, as flat views (see
    ``ShardedDataParallel.read_master``); state ``kinds`` it lacks are added, zeros."""
    if kinds:
        state = optimizer.state[master]
        for k in kinds:
            if k not in state:
                state[k] = torch.zeros_like(master)
    out = {"master": master.detach().view(-1)}
    for k, v in optimizer.state.get(master, {}).items():
        if torch.is_tensor(v) and v.dim() > 0 and v.numel() == master.numel():
            out[k] = v.detach().view(-1)
    return out


@dataclass
class _BucketState:
    group: int
    bucket: Bucket
    master: nn.Parameter
    staging: torch.Tensor | None = None  # stage 2: the bucket's full gradients, until reduced
    piece: torch.Tensor | None = None  # stages 1-2: this rank's reduced piece, until consumed
    # (start, end, param) of each parameter's elements inside ``master``
    segments: list[tuple[int, int, nn.Parameter]] = field(default_factory=list)
    host_grad: torch.Tensor | None = None  # offload: the fp32 gradient piece, in host memory
    updated: torch.Tensor | None = None  # nvme: the stepped piece in the compute dtype


@dataclass
class FlatGroup:
    """One optimizer group: its parameters and buffers."""

    params: list[nn.Parameter]
    options: dict
    layout: FlatLayout
    params_flat: torch.Tensor
    grads_flat: torch.Tensor | None  # stages 0-1
    grad_shard: torch.Tensor | None  # stage 2, fp32
    buckets: list[int] = field(default_factory=list)  # indices into ShardedDataParallel.buckets


class ShardedDataParallel(StepSequence):
    """Owns parameters, gradients and master weights at ZeRO stage 0, 1 or 2."""

    def __init__(
        self,
        module: nn.Module,
        groups: list[dict],
        *,
        comm: Comm,
        precision: Precision,
        stage: int,
        bucket_numel: int,
        prescale: float = 1.0,
        offload=None,
        sub_group_numel: int | None = None,
    ) -> None:
        if stage not in (0, 1, 2):
            raise ValueError(f"ShardedDataParallel handles ZeRO stages 0-2, not {stage}")
        # offload_optimizer: fp32 masters and optimizer state in host memory ("cpu") or files
        # ("nvme"); the optimizer steps on the host either way.
        self.offload = offload.device if offload is not None else "none"
        self._pin = bool(offload is not None and offload.pin_memory)
        self.host_meter = HostMeter()
        self.module, self.comm, self.precision, self.stage = module, comm, precision, stage
        self.dp, self.rank = comm.topo.dp, comm.topo.dp_rank
        self.prescale = prescale
        self.groups: list[FlatGroup] = []
        self.buckets: list[_BucketState] = []
        # param -> (bucket state index, its range in the group's flat buffer)
        self._where: dict[nn.Parameter, tuple[int, slice]] = {}
        self._ready: set[nn.Parameter] = set()
        self.boundary = True
        device = next(module.parameters()).device
        dtype = precision.compute_dtype
        shard_world = 1 if stage == 0 else self.dp
        shard_rank = 0 if stage == 0 else self.rank
        if self.offload == "nvme" and sub_group_numel:
            # a rank's piece of a bucket is one sub-group: the unit swapped to and from the disk
            bucket_numel = min(bucket_numel, sub_group_numel * shard_world)
        host = host_device()

        for g, group in enumerate(groups):
            params = list(group["params"])
            layout = FlatLayout.build(
                [tuple(p.shape) for p in params], world=shard_world, bucket_numel=bucket_numel
            )
            full = torch.zeros(layout.padded_numel, dtype=torch.float32, device=device)
            for slot in layout.slots:
                full[slot.offset : slot.end].copy_(params[slot.index].detach().reshape(-1))
            if self.dp > 1:
                comm.broadcast(full, src=0, axis="dp")
            params_flat = full if dtype == torch.float32 else full.to(dtype)
            grads_flat = grad_shard = None
            if stage < 2:
                grads_flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
            else:
                grad_shard = torch.zeros(
                    layout.shard_numel,
                    dtype=torch.float32,
                    device=host if self.offload != "none" else device,
                )
            for slot in layout.slots:
                p = params[slot.index]
                p.data = params_flat[slot.offset : slot.end].view(slot.shape)
                p.grad = (
                    None
                    if grads_flat is None
                    else grads_flat[slot.offset : slot.end].view(slot.shape)
                )
            options = {k: v for k, v in group.items() if k != "params"}
            fg = FlatGroup(params, options, layout, params_flat, grads_flat, grad_shard)
            for bucket in layout.buckets:
                lo, hi = layout.piece(bucket, shard_rank)
                # fp32: the master *is* this rank's piece of the parameter buffer (a view);
                # offloaded, it is a host copy whatever the dtype.
                if self.offload != "none":
                    master = nn.Parameter(to_host(full[lo:hi], self._pin))
                else:
                    master = nn.Parameter(
                        full[lo:hi] if dtype == torch.float32 else full[lo:hi].clone()
                    )
                fg.buckets.append(len(self.buckets))
                segments = []
                for pos in bucket.slots:
                    slot = layout.slots[pos]
                    self._where[params[slot.index]] = (
                        len(self.buckets),
                        slice(slot.offset, slot.end),
                    )
                    a, b = max(slot.offset, lo), min(slot.end, hi)
                    if a < b:
                        segments.append((a - lo, b - lo, params[slot.index]))
                self.buckets.append(_BucketState(g, bucket, master, segments=segments))
            self.groups.append(fg)

        self.swapper = None
        if self.offload == "nvme":
            masters = [st.master for st in self.buckets]
            need = sum(m.numel() for m in masters) * 4 * 3  # master + two Adam moments
            what = "zero_optimization.offload_optimizer"
            store = NVMeStore(offload.nvme_path, comm.topo.global_rank, need, what)
            self.swapper = OptimizerSwapper(masters, store, offload.buffer_count, self.host_meter)
        self._sync_untracked(dtype)
        self.reducer = GradReducer([len(st.bucket.slots) for st in self.buckets], self._launch)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._where
        ]

    def _sync_untracked(self, dtype) -> None:
        others = [p for p in self.module.parameters() if p not in self._where]
        sync_from_rank0(others + list(self.module.buffers()), self.comm, dtype)

    # ----------------------------------------------------------------------------- backward
    @property
    def _communicates_now(self) -> bool:
        """Stage 2 reduces every micro-step (only pieces are kept); 0-1 only on the boundary."""
        return self.dp > 1 and (self.stage == 2 or self.boundary)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        b, rng = self._where[p]
        st = self.buckets[b]
        fg = self.groups[st.group]
        if fg.grads_flat is not None:
            view = fg.grads_flat[rng].view_as(p)
            if p.grad.data_ptr() != view.data_ptr():
                # Someone replaced .grad (e.g. set it to None): fold it back into the flat buffer.
                view.add_(p.grad)
                p.grad = view
        if not self._communicates_now and self.stage < 2:
            return
        if p in self._ready:
            raise RuntimeError(
                f"a parameter of shape {tuple(p.shape)} got its gradient twice in one backward "
                "(reentrant activation checkpointing?); use use_reentrant=False"
            )
        self._ready.add(p)
        if self.stage == 2:
            if st.staging is None:
                st.staging = torch.zeros(st.bucket.numel, dtype=p.grad.dtype, device=p.device)
            st.staging[rng.start - st.bucket.start : rng.stop - st.bucket.start].copy_(
                p.grad.view(-1)
            )
            p.grad = None  # the full-size gradient does not outlive its bucket
        self.reducer.arrived(b, launch=self._communicates_now)

    def _launch(self, b: int) -> Handle:
        st = self.buckets[b]
        fg = self.groups[st.group]
        if self.stage == 2:
            if st.staging is None:  # no parameter of this bucket got a gradient
                st.staging = torch.zeros(
                    st.bucket.numel,
                    dtype=self.precision.compute_dtype,
                    device=fg.params_flat.device,
                )
            chunk = st.staging
        else:
            chunk = fg.grads_flat[st.bucket.start : st.bucket.end]
        if self.prescale != 1.0:
            chunk.mul_(self.prescale)
        if self.stage == 0:
            return self.comm.all_reduce(chunk, axis="dp", async_op=True)
        st.piece = chunk.new_empty(st.bucket.piece_numel)
        return self.comm.reduce_scatter(st.piece, chunk, axis="dp", async_op=True)

    def _flush(self) -> None:
        """Launch buckets whose parameters got no gradient, then wait for every collective
        (at dp = 1 there is nothing to reduce)."""
        if self.dp > 1:
            self.reducer.flush()
        else:
            self.reducer.reset()
        self._ready.clear()

    def end_backward(self) -> None:
        """Stage 2: finish this micro-step's reduction and add the pieces into the fp32 shard."""
        if self.stage != 2:
            return
        if self.dp == 1:  # nothing to reduce: the staged bucket is the whole piece
            for st in self.buckets:
                st.piece, st.staging = st.staging, None
        self._flush()
        for st in self.buckets:
            fg = self.groups[st.group]
            if st.piece is not None:
                off = st.bucket.shard_offset
                fg.grad_shard[off : off + st.bucket.piece_numel].add_(st.piece)
            st.piece = st.staging = None

    # ----------------------------------------------------------------------------- step
    def optimizer_groups(self) -> list[dict]:
        return [
            {"params": [self.buckets[b].master for b in fg.buckets], **fg.options}
            for fg in self.groups
        ]

    def _grad_piece(self, st: _BucketState) -> torch.Tensor:
        """This rank's summed gradient for the bucket (fp32 where the master can take it as is)."""
        fg = self.groups[st.group]
        if self.stage == 2:
            off = st.bucket.shard_offset
            return fg.grad_shard[off : off + st.bucket.piece_numel]
        if self.stage == 1 and self.dp > 1:
            return st.piece
        return fg.grads_flat[st.bucket.start : st.bucket.end]

    @property
    def grads_sharded(self) -> bool:
        """Whether each rank holds a different part of the gradient (the norm needs a reduce)."""
        return self.stage > 0 and self.dp > 1

    def masters(self) -> list[nn.Parameter]:
        return [st.master for st in self.buckets]

    def grad_norm_sq(self, skip: set[nn.Parameter]) -> torch.Tensor:
        """Sum of squares of this rank's master gradients, leaving out the parameters in
        ``skip`` (tp replicas counted on another rank)."""
        sq = torch.zeros((), dtype=torch.float32, device=self.comm.topo.device)
        for st in self.buckets:
            g = st.master.grad
            if not skip or not any(p in skip for _, _, p in st.segments):
                sq += torch.linalg.vector_norm(g, dtype=torch.float32).square()
                continue
            for lo, hi, p in st.segments:
                if p not in skip:
                    sq += torch.linalg.vector_norm(g[lo:hi], dtype=torch.float32).square()
        return sq

    def _prepare_step(self, loss_scale: float) -> float:
        """Wait for the reduction and hand each master its fp32 gradient, still summed over dp
        and scaled; return the factor that averages and unscales it."""
        if self.stage < 2:
            self._flush()
        for st in self.buckets:
            grad = self._grad_piece(st)
            if self.offload != "none" and self.stage < 2:  # stage 2's shard is on the host
                if st.host_grad is None:  # fp32, in host memory, where the optimizer steps
                    st.host_grad = torch.empty(
                        grad.numel(),
                        dtype=torch.float32,
                        device=host_device(),
                        pin_memory=self._pin and torch.cuda.is_available(),
                    )
                grad = st.host_grad.copy_(grad)
            st.master.grad = grad if grad.dtype == torch.float32 else grad.to(torch.float32)
            st.piece = None
        return 1.0 / (loss_scale * self.prescale * self.dp) if self.dp > 1 else 1.0 / loss_scale

    def scale_grads(self, factor: float) -> None:
        for st in self.buckets:
            st.master.grad.mul_(factor)

    def step_optimizer(self, optimizer) -> None:
        """``optimizer.step()`` on the masters (sub-group by sub-group when they are on NVMe)."""
        if self.swapper is None:
            optimizer.step()
            return
        bucket_of = {st.master: st for st in self.buckets}

        def keep(master: nn.Parameter, value: torch.Tensor) -> None:
            st = bucket_of[master]
            dtype = self.groups[st.group].params_flat.dtype
            st.updated = value.to(device=self.comm.topo.device, dtype=dtype, copy=True)

        self.swapper.step(optimizer, keep)

    def after_step(self) -> None:
        """Bring the updated masters into every rank's compute-dtype parameter buffer."""
        handles = []
        for st in self.buckets:
            fg = self.groups[st.group]
            full = fg.params_flat[st.bucket.start : st.bucket.end]
            master = st.updated if st.updated is not None else st.master.detach()
            st.updated = None
            if self.stage == 0 or self.dp == 1:
                if master.data_ptr() != full.data_ptr():
                    full.copy_(master)
            else:
                # A copy even in fp32, where the master is a view into ``full``: gather's input
                # must not overlap its output.
                src = master.to(device=full.device, dtype=full.dtype, copy=True)
                handles.append(self.comm.all_gather(full, src, axis="dp", async_op=True))
        for h in handles:
            h.wait()

    def zero_grad(self) -> None:
        for fg in self.groups:
            for buf in (fg.grads_flat, fg.grad_shard):
                if buf is not None:
                    buf.zero_()
        for st in self.buckets:
            st.master.grad = None

    # ----------------------------------------------------------------------------- state
    def full_master(self) -> dict[nn.Parameter, torch.Tensor]:
        """Every trained parameter's fp32 value (all-gathering the pieces at stages 1-2)."""
        out = {}
        for fg in self.groups:
            full = torch.empty(
                fg.layout.padded_numel, dtype=torch.float32, device=fg.params_flat.device
            )
            for b in fg.buckets:
                st = self.buckets[b]
                region = full[st.bucket.start : st.bucket.end]
                master = self.master_value(st.master).to(full.device)
                if self.stage == 0 or self.dp == 1:
                    region.copy_(master)
                else:
                    self.comm.all_gather(region, master.clone(), axis="dp")
            for slot in fg.layout.slots:
                out[fg.params[slot.index]] = full[slot.offset : slot.end].view(slot.shape)
        return out

    @property
    def owns_replica(self) -> bool:
        """Whether this rank writes the (replicated) state at stage 0: dp rank 0 does."""
        return self.stage > 0 or self.rank == 0

    def owned_slices(self):
        """``(param, lo, hi, master, a, b)``: this rank's master holds elements ``[lo, hi)`` of
        the flattened parameter at ``master[a:b]`` (at stage 0, every rank holds all of them)."""
        shard_rank = 0 if self.stage == 0 else self.rank
        for st in self.buckets:
            fg = self.groups[st.group]
            piece_lo, _ = fg.layout.piece(st.bucket, shard_rank)
            for a, b, p in st.segments:
                start = self._where[p][1].start
                yield p, piece_lo + a - start, piece_lo + b - start, st.master, a, b

    def frozen_slices(self):
        """``(param, lo, hi, held)`` for each parameter the optimizer does not train (frozen):
        every rank holds it whole, so ``[lo, hi)`` is all of it and ``held`` the flattened
        parameter itself, in the compute dtype (a checkpoint reads it and loads into it)."""
        for p in self.module.parameters():
            if p not in self._where:
                if not p.data.is_contiguous():  # so that ``held`` is a view, not a copy
                    p.data = p.data.contiguous()
                yield p, 0, p.numel(), p.data.view(-1)

    def after_load(self) -> None:
        """Loaded masters into the compute-dtype parameters (frozen ones were loaded in place)."""
        self.after_step()

    def master_value(self, master: nn.Parameter) -> torch.Tensor:
        """A master's current fp32 value (read back from its file when it is on NVMe)."""
        return self.swapper.read(master) if self.swapper is not None else master.detach()

    def read_master(self, master: nn.Parameter, optimizer, kinds=()) -> dict[str, torch.Tensor]:
        """``master``'s fp32 value (``"master"``) and its optimizer-state tensors, flat, for a
        checkpoint: the live tensors (a load fills them in place), or on NVMe copies read from
        the files, which :meth:`write_master` stores back. State ``kinds`` it lacks are zeros."""
        if self.swapper is not None:
            return self.swapper.read_state(master, kinds)
        return live_state(master, optimizer, kinds)

    def write_master(self, master: nn.Parameter, optimizer, values: dict) -> None:
        """Store what :meth:`read_master` gave, filled by a load: on NVMe into the files, and the
        value kept for ``after_load`` to write into the parameters (in memory: already there)."""
        if self.swapper is None:
            return
        self.swapper.write_state(master, values, optimizer)
        st = next(st for st in self.buckets if st.master is master)
        dtype = self.groups[st.group].params_flat.dtype
        st.updated = values["master"].to(device=self.comm.topo.device, dtype=dtype, copy=True)

    def close(self) -> None:
        """Remove the NVMe files (also done at process exit)."""
        if self.swapper is not None:
            self.swapper.close()

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients and separate fp32 master weights
        (offloaded masters count as host bytes; on NVMe only those swapped in right now)."""
        params = sum(fg.params_flat.nbytes for fg in self.groups)
        params += sum(p.nbytes for p in self.module.parameters() if p not in self._where)
        grads = sum(
            buf.nbytes
            for fg in self.groups
            for buf in (fg.grads_flat, fg.grad_shard)
            if buf is not None
        )
        grads += sum(st.host_grad.nbytes for st in self.buckets if st.host_grad is not None)
        master = 0
        for st in self.buckets:
            fg = self.groups[st.group]
            base = fg.params_flat
            inside = base.data_ptr() <= st.master.data_ptr() < base.data_ptr() + base.nbytes
            master += 0 if inside else st.master.nbytes
        return {"params": params, "grads": grads, "master": master}
