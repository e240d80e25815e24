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

Stage 0 is the state replicated, stages 1-2 sharded over dp; the gradients
are held in a :class:`~.grad_buffers.GradBuffer`, full (stages 0-1) or sharded (stage 2): the
builder (:mod:`.build`) makes both choices. The gradients held are in
``data_types.grad_accum_dtype`` when it is given (stages 1-2; stage 0 only takes the compute
dtype), and reduced in ``communication_data_type`` (see :mod:`.grad_buffers`).

With expert parallelism, each optimizer group's parameters are two flat groups: the experts,
summed and cut over dp (the expert-data-parallel ranks), and the rest, which every ep rank
holds, summed and cut over the ``dp * ep`` ranks of the grid's ``dp_ep`` axis, so no rank holds
their state twice (DeepSpeed's MoE groups; each flat group's :class:`~.flat_params.Cut`).

The optimizer sees, per group, one fp32 tensor per bucket: this rank's piece (with the default
bucket size that is one tensor per flat group). In fp32 training at stages 0-2 those tensors are
views of the parameter buffer itself, so no master copy exists; in fp16/bf16 they are separate
fp32 masters made from the original fp32 weights. After a step at stages 1-2 the updated pieces
are all-gathered into every rank's parameter buffer, overlapping the step where the optimizer
allows it (:mod:`.write_back`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm
from ..core import scratch
from ..core.pinned import host_empty, host_zeros
from ..core.precision import Precision
from .flat_params import BucketState, FlatGroup, flat_parts, sync_from_rank0
from .flat_state import FlatState
from .grad_buffers import GradBuffer
from .masters import master_store
from .offload import Downloads, HostMeter, Uploads, host_device
from .params import hook_grads
from .partition import FlatLayout
from .reducer import GradReducer
from .strategy import StepSequence
from .write_back import WriteBack


class ShardedDataParallel(FlatState, StepSequence):
    """Owns parameters, gradients and master weights at ZeRO stage 0, 1 or 2: the state
    replicated (stage 0) or cut (``sharded_state``, stages 1-2) over each flat group's ranks,
    the gradients held in ``grads`` (a :class:`~.grad_buffers.GradBuffer`: full, stages 0-1, or
    sharded, stage 2). ``shared``: at ep > 1, the parameters every ep rank holds."""

    def __init__(
        self,
        module: nn.Module,
        groups: list[dict],
        *,
        comm: Comm,
        precision: Precision,
        stage: int,
        sharded_state: bool,
        grads: type[GradBuffer],
        bucket_numel: int,
        prescale: float = 1.0,
        offload=None,
        sub_group_numel: int | None = None,
        reduce_scatter: bool = True,
        shared: set[nn.Parameter] | frozenset = frozenset(),
    ) -> None:
        # offload_optimizer: fp32 masters and optimizer state in host memory ("cpu") or files
        # ("nvme"); the optimizer steps on the host either way.
        self.offload = offload.device if offload is not None else "none"
        self._pin = bool(offload is not None and offload.pin_memory)
        self.uploads = Uploads(comm.topo.device, self._pin)  # offloaded masters to the device
        self.downloads = Downloads(comm.topo.device)  # stage 2's pieces to an offloaded shard
        self.buffers = scratch.Pool()  # bucket-sized buffers of one backward, or one step
        self.host_meter = HostMeter()
        self.module, self.comm, self.precision = module, comm, precision
        self.stage = stage  # a label (the Protocol's): the choices are the two below
        topo = comm.topo
        self.dp, self.rank = topo.dp, topo.dp_rank
        self.sharded_state = sharded_state
        self.grads = grads(self)
        self.reduces_each_backward = self.grads.every_micro_step  # stage 2 (the Protocol's)
        self.prescale = prescale
        self.reduce_scatter = reduce_scatter  # sharded state; else all-reduce, keep the piece
        self.reduce_dtype = precision.reduce_dtype
        self.accum_dtype = precision.accum_dtype(stage)
        self.groups: list[FlatGroup] = []
        self.buckets: list[BucketState] = []
        # param -> (bucket state index, its range in the group's flat buffer)
        self._where: dict[nn.Parameter, tuple[int, slice]] = {}
        self.boundary = True
        device = next(module.parameters()).device
        dtype = precision.compute_dtype
        # a sharded buffer keeps gradient pieces (on the host when offloaded), else full ones
        shard_device = host_device() if self.offload != "none" else device
        shard_device = shard_device if self.grads.shard_held else None

        def master_for(numel: int) -> torch.Tensor | None:
            """A zeroed fp32 master: in host memory when offloaded (pinned if asked and a GPU
            is there), else on the device; None where the master is the parameter buffer's
            own piece (fp32, not offloaded)."""
            if self.offload != "none":
                return host_zeros(numel, torch.float32, self._pin)
            if dtype == torch.float32:
                return None
            return torch.zeros(numel, dtype=torch.float32, device=device)  # padding stays 0

        self._of_group = [[] for _ in groups]
        parts = flat_parts(groups, shared, topo, sharded=sharded_state, prescale=prescale)
        for g, (i, options, fcut, params) in enumerate(parts):
            self._of_group[i].append(g)
            numel = bucket_numel
            if self.offload == "nvme" and sub_group_numel:
                # a rank's piece of a bucket is one sub-group: the unit swapped with the disk
                numel = min(bucket_numel, sub_group_numel * fcut.world)
            layout = FlatLayout.build(
                [tuple(p.shape) for p in params], world=fcut.world, bucket_numel=numel
            )
            pieces = [layout.piece(bucket, fcut.piece_rank) for bucket in layout.buckets]
            fg, masters = FlatGroup.build(
                params,
                options,
                layout,
                comm=comm,
                cut=fcut,
                dtype=dtype,
                device=device,
                grad_shard_device=shard_device,
                grad_dtype=self.accum_dtype,
                pieces=pieces,
                master_for=master_for,
            )
            for bucket, (lo, hi), master in zip(layout.buckets, pieces, masters, strict=True):
                fg.buckets.append(len(self.buckets))
                st = BucketState.build(g, bucket, nn.Parameter(master), lo, hi, fg)
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
        # what the pool keeps between steps: one bucket's staged gradients (DeepSpeed keeps one
        # bucket-sized buffer too); a step's other buffers come back to the system at its end
        biggest = max((st.bucket.numel for st in self.buckets), default=0)
        self.rest_bytes = biggest * self.reduce_dtype.itemsize
        self.writer = WriteBack(
            self.groups, self.buckets, comm=comm, uploads=self.uploads, buffers=self.buffers
        )
        self._sync_untracked(dtype)
        # fixed by the flat groups' cuts, read in every gradient hook and every step: whether
        # any gradient is summed over other ranks (not at dp 1 without ep), whether each rank
        # holds another part of the gradients (the norm needs a sum), and what every ep rank
        # holds cut over dp x ep (each rank counts and saves its own piece of it)
        self.reduces = any(fg.cut.size > 1 for fg in self.groups)
        self.grads_sharded = any(fg.cut.world > 1 for fg in self.groups)
        self.cut_over_ep = {p for fg in self.groups if fg.cut.world > 1 and fg.cut.axis == "dp_ep"
                            for p in fg.params}  # fmt: skip
        done = self.grads.done()
        sizes = [len(st.bucket.slots) for st in self.buckets]
        self.reducer = GradReducer(sizes, self.grads.launch, done)
        self._hooks = hook_grads(list(self._where), self.grads.on_grad_ready)

    def _sync_untracked(self, dtype) -> None:
        others = [p for p in self.module.parameters() if p not in self._where]
        sync_from_rank0(others + list(self.module.buffers()), self.comm, dtype)

    # ----------------------------------------------------------------------------- step
    def optimizer_groups(self) -> list[dict]:
        out = []
        for flats in self._of_group:
            masters = [self.buckets[b].master for g in flats for b in self.groups[g].buckets]
            out.append({"params": masters, **self.groups[flats[0]].options})
        return out


    def end_backward(self) -> None:
        self.grads.end_backward()

    def accumulated_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        return self.grads.accumulated_grad(p)

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
        self.grads.before_step()
        self.downloads.settle()
        on_device = not self.grads.shard_held  # a shard is where the optimizer steps already
        down = self.downloads.gpu and self.offload != "none" and on_device
        for st in self.buckets:
            grad = self.grads.grad_piece(st)
            if self.offload != "none" and on_device:
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
        return self.grad_post(loss_scale)

    def grad_post(self, loss_scale: float) -> float:
        """The factor that turns the summed, scaled gradients into the mean over the global
        batch, unscaled (at dp = 1 nothing was reduced or prescaled)."""
        return 1.0 / (loss_scale * self.prescale * self.dp) if self.dp > 1 else 1.0 / loss_scale

    def scale_grads(self, factor: float) -> None:
        for st in self.buckets:
            st.master.grad.mul_(factor)

    def step_optimizer(self, optimizer) -> None:
        """``optimizer.step()`` on the masters (sub-group by sub-group when they are in files,
        each new value kept for :meth:`write_back`; bucket by bucket, each gathered once
        stepped, when the write-back can overlap them)."""
        if self.writer.steps_by_bucket(optimizer, self.offload):
            self.writer.step_and_gather(optimizer)
            return
        bucket_of = {st.master: st for st in self.buckets}

        def keep(master: nn.Parameter, value: torch.Tensor) -> None:
            st = bucket_of[master]
            st.updated = self.writer.on_device(st, value)

        self.store.step(optimizer, keep)

    def write_back(self) -> None:
        """Bring the updated masters into every rank's compute-dtype parameter buffer."""
        self.writer.finish()

    def zero_grad(self) -> None:
        self.downloads.settle()  # no late add after the zeros
        for fg in self.groups:
            for buf in (fg.grads_flat, fg.grad_shard):
                if buf is not None:
                    buf.zero_()
        for st in self.buckets:
            st.master.grad = None
            st.shard_clean = True
        self.buffers.trim(self.rest_bytes)
