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

The gradients held are in ``data_types.grad_accum_dtype`` when it is given (stages 1-2; stage 0
only takes the compute dtype), and reduced in ``communication_data_type`` (see
:mod:`.flat_reduce`).

The optimizer sees, per group, one fp32 tensor per bucket: this rank's piece (with the default
bucket size that is one tensor per group). In fp32 training at stages 0-2 those tensors are views of
the parameter buffer itself, so no master copy exists; in fp16/bf16 they are separate fp32 masters
made from the original fp32 weights. After a step at stages 1-2 the updated pieces are all-gathered
into every rank's parameter buffer. With torch's Adam, AdamW or SGD (each parameter updated on its
own) the optimizer steps one bucket's master at a time and each bucket's all-gather starts as soon
as its master is stepped, so the gathers overlap the rest of the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..comm import Comm
from ..core import scratch
from ..pinned import host_empty, host_zeros
from ..precision import Precision
from .flat_reduce import FlatBackward
from .flat_state import FlatState
from .masters import master_store
from .offload import Downloads, HostMeter, Uploads, host_device
from .partition import Bucket, FlatLayout
from .reducer import GradReducer
from .strategy import StepSequence

# Optimizers whose step updates each parameter from its own gradient and state alone: stepping
# the masters one bucket at a time gives what one step of all of them gives.
_ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def sync_from_rank0(tensors: list[torch.Tensor], comm: Comm, dtype: torch.dtype) -> None:
    """Broadcast tensors the optimizer does not own (frozen parameters, buffers) from dp rank 0,
    so every rank starts alike, and cast the floating-point ones to the compute dtype."""
    for t in tensors:
        if comm.topo.dp > 1:
            comm.broadcast(t.data, src=0, axis="dp")
        if t.is_floating_point() and t.dtype != dtype:
            t.data = t.data.to(dtype)


@dataclass
class _BucketState:
    group: int
    bucket: Bucket
    master: nn.Parameter
    staging: torch.Tensor | None = None  # stage 2: the bucket's full gradients, until reduced
    piece: torch.Tensor | None = None  # stages 1-2: this rank's reduced piece, until consumed
    shard_clean: bool = True  # stage 2: its part of the gradient shard is zero since the step
    # (start, end, param) of each parameter's elements inside ``master``
    segments: list[tuple[int, int, nn.Parameter]] = field(default_factory=list)
    host_grad: torch.Tensor | None = None  # offload: the fp32 gradient piece, in host memory
    updated: torch.Tensor | None = None  # nvme: the stepped piece in the compute dtype
    # (param, its range in the group's flat buffer) of each parameter in the bucket
    ranges: list[tuple[nn.Parameter, slice]] = field(default_factory=list)

    @classmethod
    def build(cls, g: int, bucket: Bucket, master: nn.Parameter, lo: int, hi: int, fg):
        """Bucket ``bucket`` of group ``g``, whose master holds ``[lo, hi)`` of the flat buffer."""
        st = cls(g, bucket, master)
        for pos in bucket.slots:
            slot = fg.layout.slots[pos]
            p = fg.params[slot.index]
            st.ranges.append((p, slice(slot.offset, slot.end)))
            a, b = max(slot.offset, lo), min(slot.end, hi)
            if a < b:
                st.segments.append((a - lo, b - lo, p))
        return st


@dataclass
class FlatGroup:
    """One optimizer group: its parameters and buffers."""

    params: list[nn.Parameter]
    options: dict
    layout: FlatLayout
    params_flat: torch.Tensor
    grads_flat: torch.Tensor | None  # stages 0-1
    grad_shard: torch.Tensor | None  # stage 2, in the accumulation dtype (fp32 by default)
    buckets: list[int] = field(default_factory=list)  # indices into ShardedDataParallel.buckets

    @classmethod
    def build(
        cls,
        params: list[nn.Parameter],
        options: dict,
        layout: FlatLayout,
        *,
        comm: Comm,
        dtype: torch.dtype,
        device: torch.device,
        grad_shard_device: torch.device | None,
        grad_dtype: torch.dtype,
        pieces: list[tuple[int, int]],
        master_for,
    ) -> tuple[FlatGroup, list[torch.Tensor]]:
        """The group's buffers, its parameters made views of them, and the fp32 masters of
        ``pieces`` (this rank's ``[lo, hi)`` of each bucket, dp rank 0's values).

        Parameter by parameter, so the start costs little more than the steady state (not a
        whole fp32 copy of the model beside the model and its 16-bit buffer): each value is
        broadcast from dp rank 0 in fp32, written into the masters it overlaps and, cast, into
        the parameter buffer, whose view then replaces the parameter (its own storage goes).
        ``master_for(numel)`` makes a zeroed master (where it lives: the device, or pinned host
        memory when offloaded); in fp32 without offload the master is a view of the parameter
        buffer itself (None). Gradients, in ``grad_dtype``: a full flat buffer (whose views are
        the parameters' ``.grad`` when it is in ``dtype``), or, given ``grad_shard_device``, a
        shard there (stage 2), made once the parameters' own storage is gone."""
        params_flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        masters = [master_for(hi - lo) for lo, hi in pieces]
        bucket_of = {pos: b for b, bucket in enumerate(layout.buckets) for pos in bucket.slots}
        for pos, slot in enumerate(layout.slots):
            p = params[slot.index]
            dst = params_flat[slot.offset : slot.end]
            # In fp32, broadcast in the buffer itself: a collective's worker thread may hold its
            # tensor a while after the wait returns (gloo does), and the buffer stays anyway.
            # Otherwise the value goes in fp32 too (an fp32 parameter already on the device
            # as it is, its own storage going next).
            if dtype == torch.float32:
                value = dst.copy_(p.detach().reshape(-1))
            else:
                value = p.detach().reshape(-1).to(device=device, dtype=torch.float32)
            if comm.topo.dp > 1:
                comm.broadcast(value, src=0, axis="dp")
            if value is not dst:
                dst.copy_(value)
            lo, hi = pieces[bucket_of[pos]]
            a, b = max(slot.offset, lo), min(slot.end, hi)
            master = masters[bucket_of[pos]]
            if a < b and master is not None:
                master[a - lo : b - lo].copy_(value[a - slot.offset : b - slot.offset])
            p.data = params_flat[slot.offset : slot.end].view(slot.shape)
            del value
        masters = [
            params_flat[lo:hi] if m is None else m
            for m, (lo, hi) in zip(masters, pieces, strict=True)
        ]
        grads_flat = grad_shard = None
        if grad_shard_device is None:
            grads_flat = torch.zeros(layout.padded_numel, dtype=grad_dtype, device=device)
        else:
            shard = layout.shard_numel
            grad_shard = torch.zeros(shard, dtype=grad_dtype, device=grad_shard_device)
        for slot in layout.slots:
            p = params[slot.index]
            # autograd sums into the buffer itself when it is in the parameters' dtype
            as_grad = grads_flat is not None and grad_dtype == dtype
            p.grad = grads_flat[slot.offset : slot.end].view(slot.shape) if as_grad else None
        return cls(params, options, layout, params_flat, grads_flat, grad_shard), masters


class ShardedDataParallel(FlatBackward, FlatState, StepSequence):
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
        reduce_scatter: bool = True,
    ) -> None:
        if stage not in (0, 1, 2):
            raise ValueError(f"ShardedDataParallel handles ZeRO stages 0-2, not {stage}")
        # offload_optimizer: fp32 masters and optimizer state in host memory ("cpu") or files
        # ("nvme"); the optimizer steps on the host either way.
        self.offload = offload.device if offload is not None else "none"
        self._pin = bool(offload is not None and offload.pin_memory)
        self.uploads = Uploads(comm.topo.device, self._pin)  # offloaded masters to the device
        self.downloads = Downloads(comm.topo.device)  # stage 2's pieces to an offloaded shard
        self.ep_shared: set[nn.Parameter] = set()  # MoE: averaged over ep at the step
        self.buffers = scratch.Pool()  # bucket-sized buffers of one backward, or one step
        self._gathering: list[tuple] | None = None  # all-gathers launched as buckets stepped
        self.host_meter = HostMeter()
        self.module, self.comm, self.precision, self.stage = module, comm, precision, stage
        self.dp, self.rank = comm.topo.dp, comm.topo.dp_rank
        self.prescale = prescale
        self.reduce_scatter = reduce_scatter  # stages 1-2; else all-reduce and keep the piece
        self.reduce_dtype = precision.reduce_dtype
        self.accum_dtype = precision.accum_dtype(stage)
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
        # stage 2 keeps gradient pieces (on the host when offloaded), stages 0-1 full ones
        shard_device = host_device() if self.offload != "none" else device
        shard_device = shard_device if stage == 2 else None

        def master_for(numel: int) -> torch.Tensor | None:
            """A zeroed fp32 master: in host memory when offloaded (pinned if asked and a GPU
            is there), else on the device; None where the master is the parameter buffer's
            own piece (fp32, not offloaded)."""
            if self.offload != "none":
                return host_zeros(numel, torch.float32, self._pin)
            if dtype == torch.float32:
                return None
            return torch.zeros(numel, dtype=torch.float32, device=device)  # padding stays 0

        for g, group in enumerate(groups):
            params = list(group["params"])
            layout = FlatLayout.build(
                [tuple(p.shape) for p in params], world=shard_world, bucket_numel=bucket_numel
            )
            options = {k: v for k, v in group.items() if k != "params"}
            pieces = [layout.piece(bucket, shard_rank) for bucket in layout.buckets]
            fg, masters = FlatGroup.build(
                params,
                options,
                layout,
                comm=comm,
                dtype=dtype,
                device=device,
                grad_shard_device=shard_device,
                grad_dtype=self.accum_dtype,
                pieces=pieces,
                master_for=master_for,
            )
            for bucket, (lo, hi), master in zip(layout.buckets, pieces, masters, strict=True):
                fg.buckets.append(len(self.buckets))
                st = _BucketState.build(g, bucket, nn.Parameter(master), lo, hi, fg)
                self._where.update({p: (len(self.buckets), rng) for p, rng in st.ranges})
                self.buckets.append(st)
            self.groups.append(fg)

        # The masters' store: in memory, or with their optimizer state in files ("nvme").
        need = sum(st.master.numel() for st in self.buckets) * 4 * 3  # master + two Adam moments
        self.store, _ = master_store(
            offload, rank=comm.topo.global_rank, need_bytes=need, meter=self.host_meter
        )
        for st in self.buckets:
            self.store.add(st.master)
        self._sync_untracked(dtype)
        # stages 1-2: each bucket is waited for (and, at stage 2, added into the shard and its
        # buffers freed) while backward goes on, at most two in flight
        done = self._reduced if stage > 0 else None
        sizes = [len(st.bucket.slots) for st in self.buckets]
        self.reducer = GradReducer(sizes, self._launch, done)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._where
        ]

    def _sync_untracked(self, dtype) -> None:
        others = [p for p in self.module.parameters() if p not in self._where]
        sync_from_rank0(others + list(self.module.buffers()), self.comm, dtype)

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
        # Parameter by parameter, as stage 3 and DeepSpeed: a norm over a whole bucket sums
        # in another order, and its last digits (1e-6 measured) then change the clipping factor
        # with the bucket's cut (how the optimizer groups the parameters).
        views = [
            st.master.grad[lo:hi]
            for st in self.buckets
            for lo, hi, p in st.segments
            if hi > lo and p not in skip
        ]
        if not views:
            return torch.zeros((), dtype=torch.float32, device=self.comm.topo.device)
        return torch.stack(torch._foreach_norm(views)).square().sum()

    def _prepare_step(self, loss_scale: float) -> float:
        """Wait for the reduction and hand each master its fp32 gradient, still summed over dp
        and scaled; return the factor that averages and unscales it."""
        if self.stage < 2:
            self._flush()
        self.downloads.settle()
        down = self.downloads.gpu and self.offload != "none" and self.stage < 2
        for st in self.buckets:
            grad = self._grad_piece(st)
            if self.offload != "none" and self.stage < 2:  # stage 2's shard is on the host
                if st.host_grad is None:  # fp32, in host memory, where the optimizer steps
                    st.host_grad = host_empty(grad.numel(), torch.float32, self._pin)
                # queued one after another (pinned: without stopping the host), waited for
                # once below, where each blocking copy waited for the whole stream
                grad = st.host_grad.copy_(grad, non_blocking=down)
            st.master.grad = grad if grad.dtype == torch.float32 else grad.to(torch.float32)
            st.piece = None
        if down:
            copied = torch.cuda.Event()
            copied.record()
            copied.synchronize()
        if self.ep_shared:
            self._average_over_ep()
        return self.grad_post(loss_scale)

    def _average_over_ep(self) -> None:
        """MoE at ep > 1: the gradients every ep rank holds (all but the experts; the ep ranks
        read different batches) summed over the ep ranks and divided by ep, once per step on
        this rank's reduced fp32 pieces, in bucket-sized all-reduces (a hook all-reduced each
        parameter's whole gradient at every micro-step before; the experts' hook divides
        theirs by ep, :mod:`zerostack.moe.sync`)."""
        views = [
            st.master.grad[lo:hi]
            for st in self.buckets
            for lo, hi, p in st.segments
            if hi > lo and p in self.ep_shared
        ]
        ep, device = self.comm.topo.ep, self.comm.topo.device
        limit = max(st.bucket.numel for st in self.buckets)
        while views:
            chunk, numel = [], 0
            while views and (not chunk or numel + views[0].numel() <= limit):
                numel += views[0].numel()
                chunk.append(views.pop(0))
            flat = torch.cat([v.reshape(-1) for v in chunk]).to(device)  # offloaded: up and back
            self.comm.all_reduce(flat, axis="ep")
            flat.div_(ep)
            for v, part in zip(chunk, flat.split([v.numel() for v in chunk]), strict=True):
                v.copy_(part.view_as(v))

    def grad_post(self, loss_scale: float) -> float:
        """The factor that turns the summed, scaled gradients into the mean over the global
        batch, unscaled (at dp = 1 nothing was reduced or prescaled)."""
        return 1.0 / (loss_scale * self.prescale * self.dp) if self.dp > 1 else 1.0 / loss_scale

    def scale_grads(self, factor: float) -> None:
        for st in self.buckets:
            st.master.grad.mul_(factor)

    def _steps_by_bucket(self, optimizer) -> bool:
        """Whether the optimizer may step one bucket's master at a time: an optimizer of torch
        that updates each parameter from its own gradient and state alone, masters in memory,
        and gathers to overlap."""
        return (
            self.stage > 0
            and self.dp > 1
            and self.offload == "none"
            and len(self.buckets) > 1
            and type(optimizer) in _ELEMENTWISE
        )

    def step_optimizer(self, optimizer) -> None:
        """``optimizer.step()`` on the masters (sub-group by sub-group when they are in files,
        each new value kept for :meth:`after_step`; bucket by bucket, each gathered once
        stepped, when :meth:`_steps_by_bucket`)."""
        if self._steps_by_bucket(optimizer):
            self._gathering = self._step_and_gather(optimizer)
            return
        bucket_of = {st.master: st for st in self.buckets}

        def keep(master: nn.Parameter, value: torch.Tensor) -> None:
            st = bucket_of[master]
            st.updated = self._on_device(st, value)

        self.store.step(optimizer, keep)

    def _step_and_gather(self, optimizer) -> list[tuple]:
        """Step each bucket's master alone (the others' gradients hidden for the call) and
        launch its all-gather; the gathers still in flight."""
        grads = [st.master.grad for st in self.buckets]
        for st in self.buckets:
            st.master.grad = None
        handles: list[tuple] = []
        try:
            for st, grad in zip(self.buckets, grads, strict=True):
                st.master.grad = grad
                optimizer.step()
                st.master.grad = None
                self._gather(st, handles)
        finally:
            for st, grad in zip(self.buckets, grads, strict=True):
                st.master.grad = grad
        return handles

    def after_step(self) -> None:
        """Bring the updated masters into every rank's compute-dtype parameter buffer."""
        handles, self._gathering = self._gathering, None
        if handles is None:
            handles = []
            for st in self.buckets:
                if self.stage == 0 or self.dp == 1:
                    fg = self.groups[st.group]
                    full = fg.params_flat[st.bucket.start : st.bucket.end]
                    master = st.updated if st.updated is not None else st.master.detach()
                    st.updated = None
                    if master.data_ptr() != full.data_ptr():  # offloaded: without blocking
                        self.uploads.copy(st.master, full, master)
                else:
                    self._gather(st, handles)
        for h, src in handles:
            self._gathered(h, src)

    def _gather(self, st: _BucketState, handles: list[tuple]) -> None:
        """Launch the all-gather of bucket ``st``'s updated master into every rank's parameter
        buffer, appended to ``handles`` as ``(handle, input copy or None)``; at most two stay in
        flight (their inputs are buckets' pieces)."""
        full = self.groups[st.group].params_flat[st.bucket.start : st.bucket.end]
        src, st.updated = st.updated, None  # (nvme: the stepped piece, already a copy)
        in_place = False
        if src is None:
            # In fp32 the master is this rank's row of ``full``: gathered in place
            master, own = st.master.detach(), full[self.rank * st.bucket.piece_numel :]
            in_place = master.data_ptr() == own.data_ptr() and master.dtype == own.dtype
            src = master if in_place else self._on_device(st, master)
        handle = self.comm.all_gather(full, src, axis="dp", async_op=True)
        handles.append((handle, None if in_place else src))
        if len(handles) > 2:
            self._gathered(*handles.pop(0))

    def _gathered(self, handle, src: torch.Tensor) -> None:
        handle.wait()
        self.buffers.give(src)

    def _on_device(self, st: _BucketState, value: torch.Tensor) -> torch.Tensor:
        """A copy of a bucket's fp32 master piece in the compute dtype on the device (from host
        memory when offloaded: through the bucket's staging buffer, without blocking)."""
        dtype = self.groups[st.group].params_flat.dtype
        out = self.buffers.take(value.numel(), dtype, self.comm.topo.device).view(value.shape)
        self.uploads.copy(st.master, out, value)
        return out

    def zero_grad(self) -> None:
        self.downloads.settle()  # no late add after the zeros
        for fg in self.groups:
            for buf in (fg.grads_flat, fg.grad_shard):
                if buf is not None:
                    buf.zero_()
        for st in self.buckets:
            st.master.grad = None
            st.shard_clean = True
