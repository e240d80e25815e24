"""ZeRO stage 3: parameters sharded too, gathered per module just before use, freed right after.

Every parameter is stored as this rank's piece (see :mod:`..init`). :mod:`.coordinator` gathers
a module's parameters just before its forward and again before its backward, and frees them right
after (prefetching in the recorded order). When every trainable parameter of a unit has its
gradient (post-accumulate-grad hooks), its gradients are reduce-scattered, asynchronously and a
few modules to a bucket, into this rank's gradient shard (fp32, or ``data_types.grad_accum_dtype``;
reduced in ``communication_data_type``). Parameters smaller than
``stage3_param_persistence_threshold`` elements stay whole and are refreshed after each step.

The optimizer sees one fp32 tensor per group: the concatenation of this rank's pieces of the
group's parameters (in fp32 training, the parameter pieces themselves).

With expert parallelism the experts are cut and reduced over dp (the ranks holding the same
experts) and the trainable parameters every ep rank holds over the ``dp * ep`` ranks of the
``dp_ep`` axis (``p._zs.axis``), each axis its own reduce buckets, as at stages 1-2.
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm import Comm
from ...core.precision import Precision
from ..offload.host import HostOffload, host_device, host_offload
from ..offload.masters import GradFiles, GradShards, master_store
from ..offload.param_swap import ParamSwapper, ResidentPieces, offload_pieces
from ..reducer import hook_grads
from ..strategy import ForwardsCheckpointView, StepSequence, sync_from_rank0
from ..whole_params import WholeParams
from .checkpoint import Stage3Checkpoint
from .collectives import Subgroup
from .coordinator import ParamCoordinator
from .frozen_pieces import quantize_at_start
from .gather import gather_now
from .groups import Group, make_group, sub_groups
from .one_param import OneParam
from .params import StorageMeter, cut_all
from .reduce import piece_reducers
from .write_back import Stage3WriteBack


class Stage3(StepSequence, ForwardsCheckpointView):
    """Owns the parameter shards, gradient shards and fp32 masters at ZeRO stage 3."""

    stage = 3
    reduces_each_backward = True  # the Protocol's

    def __init__(
        self,
        module: nn.Module,
        groups: list[dict],
        *,
        comm: Comm,
        precision: Precision,
        prefetch_numel: int | None,
        persistence_threshold: int,
        reduce_bucket_numel: int = 4_000_000,
        max_live_numel: int = 1_000_000_000,
        max_reuse_numel: int = 0,
        prescale: float = 1.0,
        meter: StorageMeter | None = None,
        host: HostOffload | None = None,
        sub_group_numel: int | None = None,
        offload_param=None,
        quantized_weights: bool = False,
        quantized_gradients: bool = False,
        gradient_bits: int = 8,
        hpz_partition_size: int = 1,
        shared: set[nn.Parameter] | frozenset = frozenset(),
        quantized_frozen: bool = False,
    ) -> None:
        self.module, self.comm, self.precision = module, comm, precision
        # offload_optimizer: masters, gradient shards and optimizer state in host memory ("cpu")
        # or, masters and state, in files ("nvme"); the optimizer steps on the host.
        self.host = host if host is not None else host_offload(None, comm.topo.device)
        self.offload, pin = self.host.device, self.host.pin
        self.uploads = self.host.uploads  # offloaded masters to the device
        self.downloads = self.host.downloads  # reduced rows to offloaded gradients
        self.host_meter = self.host.meter
        self.dp, self.rank = comm.topo.dp, comm.topo.dp_rank
        self.prescale = prescale
        self.prefetch_numel = prefetch_numel
        self.meter = meter or StorageMeter()
        self.boundary = True
        dtype = precision.compute_dtype
        everything = list(dict.fromkeys(module.parameters()))
        trainable = [p for g in groups for p in g["params"]]
        self._trainable = set(trainable)
        cut_all(everything, comm, self.meter, wide=set(shared) & self._trainable)
        self.grads_sharded = any(p._zs.world > 1 for p in trainable)  # read at every step
        self.cut_over_ep = {p for p in trainable if p._zs.axis == "dp_ep" and p._zs.world > 1}

        # Where the parameter pieces live: in memory, or (offload_param) read in for each gather
        # from files or host memory. Those zero.Init put in files (remote_device="nvme") stay.
        self.param_swapper: ParamSwapper | ResidentPieces = ResidentPieces()
        if everything[0]._zs.swapper is not None:
            self.param_swapper = everything[0]._zs.swapper
            self.param_swapper.meter, self.param_swapper.device = self.host_meter, comm.topo.device
        # The masters' store (memory, or with their optimizer state in files: "nvme") and where
        # the fp32 gradients are summed (a shard per group, or files beside the masters).
        need = sum(p._zs.piece.numel() for p in trainable) * 4 * 4  # master, 2 moments, grad
        self.store, files = master_store(
            self.host.config, rank=comm.topo.global_rank, need_bytes=need, meter=self.host_meter
        )
        self._group_of: dict[nn.Parameter, Group] = {}  # master -> its (sub-)group
        if files is not None:  # built sub-group by sub-group: never all in memory at once
            self.grads = GradFiles(files, trainable, self._group_of)
            self.store.swapper.grad_source = self.grads.load
        else:
            device = host_device() if self.offload != "none" else comm.topo.device
            self.grads = GradShards(device, precision.accum_dtype(3))
        self.groups: list[Group] = []
        limit = sub_group_numel if self.offload == "nvme" else None
        for index, group in enumerate(groups):
            options = {k: v for k, v in group.items() if k != "params"}
            for params in sub_groups(list(group["params"]), limit):
                group = make_group(
                    params,
                    options,
                    index,
                    dtype=dtype,
                    pin=pin,
                    device=comm.topo.device,
                    offload=self.offload,
                    swapper=self.param_swapper,
                    grads=self.grads,
                    store=self.store,
                    meter=self.meter,
                    master_dtype=precision.master_dtype,
                )
                self.groups.append(group)
        self._group_of.update({g.master: g for g in self.groups})
        for p in everything:
            if self.param_swapper.holds(p):
                if p not in self._trainable:
                    self.param_swapper.fetch([p])
                    self.param_swapper.rewrite(p, p._zs.piece, dtype)
            elif p not in self._trainable and p._zs.piece.dtype != dtype:
                p._zs.piece = self.meter.track(p._zs.piece.to(dtype))
            p.data = torch.empty(0, dtype=dtype, device=p.device)
        sync_from_rank0(list(module.buffers()), comm, dtype)
        self.quantized_frozen = quantized_frozen  # zero_quantized_nontrainable_weights
        quantize_at_start(quantized_frozen, everything, self._trainable, self.param_swapper)

        self._persistent = [p for p in everything if p._zs.numel < persistence_threshold]
        for p in self._persistent:
            p._zs.persistent = True
            p.ds_persist = True
            if self.param_swapper.holds(p):
                self.param_swapper.keep(p)
        gather_now(self._persistent, comm, self.meter)
        # offload_param: every non-persistent piece lives in a file ("nvme") or in host memory
        # ("cpu"), and is read in for each gather
        wanted = offload_param is not None and offload_param.device != "none"
        if wanted and not self.param_swapper.offloads:
            swapped = [p for p in everything if not p._zs.persistent]
            self.param_swapper = offload_pieces(swapped, offload_param, comm, self.host_meter)
            for g in self.groups:  # the pieces live in the files; only persistent ones stay
                g.pieces = None

        self.coord = ParamCoordinator(
            module,
            comm=comm,
            meter=self.meter,
            prefetch_numel=prefetch_numel,
            trainable=self._trainable,
            swapper=self.param_swapper,
            max_live_numel=max_live_numel,
            max_reuse_numel=max_reuse_numel,
            quantized_weights=quantized_weights,
            hpz=Subgroup.of(hpz_partition_size, comm.topo),
        )
        owner = self._owner = self.coord.owner
        self._owned = [
            [p for p in ps if owner[p] == u and p in self._trainable]
            for u, ps in enumerate(self.coord.units)
        ]
        # Reduce buckets: owner units in reverse construction order (roughly the order backward
        # finishes them), a few modules to a bucket; one reducer per axis.
        self.reducers = piece_reducers(
            self._owned[::-1],
            comm=comm,
            prescale=prescale,
            dtype=precision.reduce_dtype,
            bucket_numel=reduce_bucket_numel,
            deliver=self._accumulate,
            to=self.grads.device,  # offloaded: the host
            quantized=quantized_gradients,
            bits=gradient_bits,
            downloads=self.downloads,
        )
        self.reduce = self.reducers["dp"]
        self.writer = Stage3WriteBack(
            self.groups,
            persistent=self._persistent,
            trainable=self._trainable,
            store=self.store,
            swapper=self.param_swapper,
            uploads=self.uploads,
            comm=comm,
            meter=self.meter,
        )
        self.checkpoint = Stage3Checkpoint(
            self.groups,
            owner=owner,
            trainable=self._trainable,
            group_of=self._group_of,
            store=self.store,
            swapper=self.param_swapper,
            writer=self.writer,
            comm=comm,
        )
        self.one = OneParam(
            comm=comm, grads=self.grads, downloads=self.downloads, swapper=self.param_swapper
        )
        self._hooks = hook_grads(trainable, self._on_grad_ready)

    # ----------------------------------------------------------------------------- gathering
    def coordinator(self) -> ParamCoordinator:
        return self.coord

    def release_gathered(self) -> None:
        """Release the parameters gathered ahead of use or kept for a reuse."""
        self.coord.release_gathered()

    @property
    def prefetched(self) -> int:
        """Units whose gather was launched ahead of need (for tests and reports)."""
        return self.coord.prefetched

    # ----------------------------------------------------------------------------- reducing
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        reducer = self.reducers[p._zs.axis]
        reducer.stage(p)
        self.coord.grad_arrived(p)  # p's gathered copy may go
        reducer.arrived(p)

    def begin_backward(self, boundary: bool) -> None:
        super().begin_backward(boundary)
        for reducer in self.reducers.values():
            reducer.final = boundary

    def _accumulate(self, pieces: list[tuple[nn.Parameter, torch.Tensor]], final: bool) -> None:
        """Add a bucket's reduced pieces into the fp32 gradients (a shard or files); ``final``:
        the window's last micro-step."""
        for p, piece in pieces:
            self.grads.add(p, piece, final=final)

    def end_backward(self) -> None:
        """Reduce what is left, add this rank's pieces into the fp32 gradients, free the rest."""
        for reducer in self.reducers.values():
            reducer.finish()
        self.coord.end_backward()

    # ----------------------------------------------------------------------------- step
    def optimizer_groups(self) -> list[dict]:
        out: list[dict] = []
        for g in self.groups:
            if len(out) <= g.index:
                out.append({"params": [], **g.options})
            out[g.index]["params"].append(g.master)
        return out

    def masters(self) -> list[nn.Parameter]:
        return [g.master for g in self.groups]

    def describe_pieces(self, pieces: WholeParams) -> None:
        """Each group's master: its parameters' pieces end to end, the same widths on every
        rank of their axis (see :mod:`..whole_params`)."""
        for g in self.groups:
            at, matrices = 0, []
            for p in g.params:
                st = p._zs
                runs = []
                for w in range(st.world):
                    lo, hi = st.extent(w)
                    if hi > lo:
                        runs.append((w, at, at + hi - lo))
                matrices.append((p, st.shape, runs))
                at += st.piece.numel()
            cuts = {(p._zs.axis, p._zs.world, p._zs.rank) for p in g.params}
            if len(cuts) != 1:
                raise ValueError(f"a group's parameters are cut in {len(cuts)} ways: {cuts}")
            axis, world, rank = cuts.pop()
            pieces.add(g.master, axis=axis, world=world, rank=rank, matrices=matrices)

    def grad_norm_sq(self, skip: set[nn.Parameter]) -> torch.Tensor:
        """Sum of squares of this rank's gradient shards, leaving out the parameters in ``skip``
        (tp replicas counted on another rank)."""
        # Parameter by parameter, summed over one vector in parameter order, so the sum does
        # not depend on how groups are cut into sub-groups (NVMe offload): offloaded or not, the
        # clipping factor is the same number; where the shards are (the device, or host memory
        # when offloaded).
        params = [p for g in self.groups for p in g.params if p not in skip]
        if not params:
            return torch.zeros((), dtype=torch.float32, device=self.grads.device)
        return self.grads.norms_sq(params).sum()

    def _prepare_step(self, loss_scale: float) -> float:
        """Hand each master its fp32 gradient shard (summed, scaled); return the factor that
        averages and unscales it (see ShardedDataParallel._prepare_step)."""
        self.downloads.settle()
        self.grads.hand_to(self.groups)
        return self.grad_post(loss_scale)

    def grad_post(self, loss_scale: float) -> float:
        """The factor that turns the summed, scaled gradients into the mean over the global
        batch, unscaled (the prescale is applied at dp = 1 too)."""
        return 1.0 / (loss_scale * self.prescale * self.dp)

    def scale_grads(self, factor: float) -> None:
        """Multiply the masters' gradients (in files: as each sub-group is read for the step)."""
        self.grads.scale(self.groups, factor)

    def step_optimizer(self, optimizer) -> None:
        """``optimizer.step()`` on the masters (in files: sub-group by sub-group, each written
        into the compute-dtype pieces while it is in memory)."""
        self.store.step(optimizer, lambda m, value: self.writer.write(self._group_of[m], value))

    def write_back(self) -> None:
        self.writer.finish()

    def zero_grad(self) -> None:
        self.downloads.settle()  # no late add after the zeros
        self.grads.clear(self.groups)

    # ------------------------------------------------------------------ one parameter
    def state_axis(self, p: nn.Parameter) -> str | None:
        """The axis over which ``p``'s master is cut, None where one rank holds all of it."""
        return p._zs.axis if p._zs.world > 1 else None

    def is_trained(self, p: nn.Parameter) -> bool:
        """Whether the optimizer steps ``p`` (it has a master and gradient pieces here)."""
        return p in self._trainable

    def window_grad(self, p: nn.Parameter) -> torch.Tensor:
        return self.one.window_grad(p)

    def local_grad(self, p: nn.Parameter) -> torch.Tensor:
        return self.one.local_grad(p)

    def hold_grad(self, p: nn.Parameter, value: torch.Tensor) -> None:
        self.one.hold_grad(p, value)

    def hold_local_grad(self, p: nn.Parameter, piece: torch.Tensor) -> None:
        self.one.hold_local_grad(p, piece)

    def write_param(self, p: nn.Parameter, value: torch.Tensor) -> None:
        self.one.write_param(p, value)
