"""ZeRO stages 0, 1 and 2: flat buffers, bucketed overlapped gradient reduction, sharded masters.

Each optimizer group's trainable parameters become views into one flat buffer in the compute
dtype (see :mod:`..partition` for the layout: buckets padded to a multiple of the dp size, rank
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
are held in a :class:`~.grads.GradBuffer`, full (stages 0-1) or sharded (stage 2): the
builder (:mod:`..build`) makes both choices. The gradients held are in
``data_types.grad_accum_dtype`` when it is given (stages 1-2; stage 0 only takes the compute
dtype), and reduced in ``communication_data_type`` (see :mod:`.grads`).

With expert parallelism, each optimizer group's parameters are two flat groups: the experts,
summed and cut over dp (the expert-data-parallel ranks), and the rest, which every ep rank
holds, summed and cut over the ``dp * ep`` ranks of the grid's ``dp_ep`` axis, so no rank holds
their state twice (DeepSpeed's MoE groups; each flat group's :class:`~.params.Cut`).

The optimizer sees, per group, one fp32 tensor per bucket: this rank's piece (with the default
bucket size that is one tensor per flat group). In fp32 training at stages 0-2 those tensors are
views of the parameter buffer itself, so no master copy exists; in fp16/bf16 they are separate
fp32 masters made from the original fp32 weights. After a step at stages 1-2 the updated pieces
are all-gathered into every rank's parameter buffer, overlapping the step where the optimizer
allows it (:mod:`.write_back`). The words (flat group, bucket, piece, cut, master) are the
vocabulary note's in :mod:`zerostack.zero`.
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm import Comm
from ...core.pinned import host_empty
from ...core.precision import Precision
from ..offload.host import HostOffload, host_offload
from ..offload.masters import master_store
from ..reducer import hook_grads
from ..strategy import ForwardsCheckpointView, StepSequence, sync_from_rank0
from ..whole_params import WholeParams
from .buffers import FlatBuffers
from .checkpoint import FlatCheckpoint
from .grads import GradBuffer
from .write_back import WriteBack


class ShardedDataParallel(StepSequence, ForwardsCheckpointView):
    """Sequences the step of ZeRO stage 0, 1 or 2 over the parts it composes: ``flat`` (a
    :class:`~.buffers.FlatBuffers`: the flat groups, buckets and parameter index), the
    state replicated (stage 0) or cut (``sharded_state``, stages 1-2) over each flat group's
    ranks; ``grads`` (a :class:`~.grads.GradBuffer`: full, stages 0-1, or sharded,
    stage 2); ``writer`` (the :class:`~.write_back.WriteBack`); ``checkpoint`` (the
    :class:`~.checkpoint.FlatCheckpoint`, which the checkpoint view's calls go to).
    ``host``: the offload set-up (:func:`~..offload.host.host_offload`); ``shared``: at ep > 1, the
    parameters every ep rank holds."""

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
        host: HostOffload | None = None,
        sub_group_numel: int | None = None,
        reduce_scatter: bool = True,
        shared: set[nn.Parameter] | frozenset = frozenset(),
    ) -> None:
        # offload_optimizer: fp32 masters and optimizer state in host memory ("cpu") or files
        # ("nvme"); the optimizer steps on the host either way.
        self.host = host if host is not None else host_offload(None, comm.topo.device)
        self.offload = self.host.device
        self.uploads = self.host.uploads  # offloaded masters to the device
        self.downloads = self.host.downloads  # stage 2's pieces to an offloaded shard
        self.host_meter = self.host.meter
        self.module, self.comm, self.precision = module, comm, precision
        self.stage = stage  # a label (the Protocol's): the choices are the two below
        topo = comm.topo
        self.dp, self.rank = topo.dp, topo.dp_rank
        self.sharded_state = sharded_state
        self.prescale = prescale
        self.boundary = True
        dtype = precision.compute_dtype
        self.flat = FlatBuffers(
            groups,
            comm=comm,
            precision=precision,
            stage=stage,
            sharded=sharded_state,
            shard_grads=grads.shard_held,
            bucket_numel=bucket_numel,
            prescale=prescale,
            host=self.host,
            device=next(module.parameters()).device,
            sub_group_numel=sub_group_numel,
            shared=shared,
        )
        self.grads = grads(
            self.flat, comm=comm, downloads=self.downloads, reduce_scatter=reduce_scatter
        )
        self.reduces_each_backward = self.grads.every_micro_step  # stage 2 (the Protocol's)

        # The masters' store: in memory, or with their optimizer state in files ("nvme").
        need = sum(st.master.numel() for st in self.flat.buckets) * 4 * 3  # master + two moments
        self.store, _ = master_store(
            self.host.config, rank=topo.global_rank, need_bytes=need, meter=self.host_meter
        )
        for st in self.flat.buckets:
            self.store.add(st.master)
        self.writer = WriteBack(self.flat, comm=comm, uploads=self.uploads)
        self.checkpoint = FlatCheckpoint(
            self.flat,
            module=module,
            comm=comm,
            store=self.store,
            writer=self.writer,
            sharded=sharded_state,
            rank=self.rank,
        )
        self._sync_untracked(dtype)
        self.grads_sharded = self.flat.grads_sharded  # the Protocol's
        self.cut_over_ep = self.flat.cut_over_ep
        self._hooks = hook_grads(self.flat.params(), self.grads.on_grad_ready)

    def _sync_untracked(self, dtype) -> None:
        others = [p for p in self.module.parameters() if p not in self.flat]
        sync_from_rank0(others + list(self.module.buffers()), self.comm, dtype)

    # ----------------------------------------------------------------------------- step
    def optimizer_groups(self) -> list[dict]:
        return self.flat.optimizer_groups()

    def begin_backward(self, boundary: bool) -> None:
        super().begin_backward(boundary)
        self.grads.begin_backward(boundary)

    def end_backward(self) -> None:
        self.grads.end_backward()

    def accumulated_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        return self.grads.accumulated_grad(p)

    def grad_norm_sq(self, skip: set[nn.Parameter]) -> torch.Tensor:
        """Sum of squares of this rank's master gradients, leaving out the parameters in
        ``skip`` (tp replicas counted on another rank)."""
        # Parameter by parameter, as stage 3 and DeepSpeed: a norm over a whole bucket sums
        # in another order, and its last digits (1e-6 measured) then change the clipping factor
        # with the bucket's cut (how the optimizer groups the parameters).
        views = [
            st.master.grad[lo:hi]
            for st in self.flat.buckets
            for lo, hi, p in st.segments
            if hi > lo and p not in skip
        ]
        if not views:
            return torch.zeros((), dtype=torch.float32, device=self.comm.topo.device)
        return torch.stack(torch._foreach_norm(views, 2, dtype=torch.float32)).square().sum()

    def _prepare_step(self, loss_scale: float) -> float:
        """Wait for the reduction and hand each master its gradient in the master's dtype
        (fp32, or 16 bits), still summed over dp and scaled; return the factor that averages and
        unscales it."""
        self.grads.finish_grad_sync()
        self.downloads.settle()
        on_device = not self.grads.shard_held  # a shard is where the optimizer steps already
        down = self.downloads.gpu and self.offload != "none" and on_device
        for st in self.flat.buckets:
            grad, dtype = self.grads.grad_piece(st), st.master.dtype
            if self.offload != "none" and on_device:
                if st.host_grad is None:  # the master's dtype, in host memory, where it steps
                    st.host_grad = host_empty(grad.numel(), dtype, self.host.pin)
                # queued one after another (pinned: without stopping the host), waited for
                # once below, where each blocking copy waited for the whole stream
                grad = st.host_grad.copy_(grad, non_blocking=down)
            st.master.grad = grad if grad.dtype == dtype else grad.to(dtype)
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
        for st in self.flat.buckets:
            st.master.grad.mul_(factor)

    def step_optimizer(self, optimizer) -> None:
        """``optimizer.step()`` on the masters (sub-group by sub-group when they are in files,
        each new value kept for :meth:`write_back`; bucket by bucket, each gathered once
        stepped, when the write-back can overlap them)."""
        if self.writer.steps_by_bucket(optimizer, self.offload):
            self.writer.step_and_gather(optimizer)
            return
        bucket_of = {st.master: st for st in self.flat.buckets}

        def keep(master: nn.Parameter, value: torch.Tensor) -> None:
            st = bucket_of[master]
            st.updated = self.writer.on_device(st, value)

        self.store.step(optimizer, keep)

    def write_back(self) -> None:
        """Bring the updated masters into every rank's compute-dtype parameter buffer."""
        self.writer.finish()

    def zero_grad(self) -> None:
        self.downloads.settle()  # no late add after the zeros
        for fg in self.flat.groups:
            for buf in (fg.grads_flat, fg.grad_shard):
                if buf is not None:
                    buf.zero_()
        for st in self.flat.buckets:
            st.master.grad = None
            st.shard_clean = True
        self.flat.pool.trim(self.flat.rest_bytes)

    # ------------------------------------------------------------------ one parameter
    def is_trained(self, p: nn.Parameter) -> bool:
        """Whether the optimizer steps ``p`` (it has a master and gradients here)."""
        return p in self.flat

    def state_axis(self, p: nn.Parameter) -> str | None:
        return self.flat.state_axis(p)

    def window_grad(self, p: nn.Parameter) -> torch.Tensor:
        """``p``'s gradient so far in this accumulation window, whole and flat in fp32, summed
        over dp and scaled as its master gets it at the step (times :meth:`grad_post` is the
        mean). A collective over dp: at stages 0-1 it waits for the boundary's reduction if
        backward launched it, or sums a copy of the local gradients mid-window."""
        return self.grads.window_grad(p)

    def hold_grad(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Make ``value`` (flat fp32, summed over dp and scaled, as :meth:`window_grad` gives
        it) ``p``'s gradient in this window, where the step reads it."""
        self.grads.hold_grad(p, value)

    def write_param(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Set the compute-dtype parameter to ``value`` (flat, this rank's whole parameter):
        every rank holds all of it, so nothing is gathered."""
        p.data.copy_(value.view_as(p))

    def describe_pieces(self, pieces: WholeParams) -> None:
        """Each bucket's master: rank ``w`` of its cut holds piece ``w`` of the bucket, and each
        parameter is a range of it (see :mod:`..whole_params`)."""
        for st in self.flat.buckets:
            fg = self.flat.group_of(st)
            spans = [fg.layout.piece(st.bucket, w) for w in range(fg.layout.world)]
            matrices = []
            for p, rng in st.ranges:
                runs = [
                    (w, max(rng.start, lo) - lo, min(rng.stop, hi) - lo)
                    for w, (lo, hi) in enumerate(spans)
                    if max(rng.start, lo) < min(rng.stop, hi)
                ]
                matrices.append((p, p.shape, runs))
            cut = fg.cut
            pieces.add(
                st.master, axis=cut.axis, world=cut.world, rank=cut.piece_rank, matrices=matrices
            )

    # ------------------------------------------------------------------ the checkpoint's view
    # (the masters from the flat buffers; the rest of :class:`~..strategy.CheckpointView` from
    # :class:`~..strategy.ForwardsCheckpointView`)
    def masters(self) -> list[nn.Parameter]:
        return self.flat.masters()

    def group_params(self) -> list[list[nn.Parameter]]:
        return self.flat.group_params()
