"""ZeRO stage 3: parameters sharded too, gathered per module just before use, freed right after.

Every parameter is stored as this rank's piece (see :mod:`.init`). :mod:`.coordinator` gathers
a module's parameters just before its forward and again before its backward, and frees them right
after (prefetching in the recorded order). When every trainable parameter of a unit has its
gradient (post-accumulate-grad hooks), its gradients are reduce-scattered, asynchronously and a
few modules to a bucket, into this rank's fp32 gradient shard. Parameters smaller than
``stage3_param_persistence_threshold`` elements stay whole and are refreshed after each step.

The optimizer sees one fp32 tensor per group: the concatenation of this rank's pieces of the
group's parameters (in fp32 training, the parameter pieces themselves).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..comm import Comm, Handle
from ..precision import Precision
from .coordinator import ParamCoordinator, gather_now
from .init import StorageMeter, gather_full, is_sharded, shard_param
from .offload import (
    HostMeter,
    HostStore,
    NVMeStore,
    OptimizerSwapper,
    ParamSwapper,
    host_device,
    to_host,
)
from .reducer import GradReducer
from .sharded_optimizer import live_state, sync_from_rank0
from .strategy import StepSequence


@dataclass
class _Group:
    """A sub-group of one optimizer group's parameters (the whole group unless on NVMe)."""

    params: list[nn.Parameter]
    options: dict
    master: nn.Parameter  # fp32, this rank's pieces end to end
    pieces: torch.Tensor  # compute dtype (the master itself in fp32 training)
    grad_shard: torch.Tensor  # fp32
    index: int = 0  # the optimizer group it belongs to


def _sub_groups(params: list[nn.Parameter], limit: int | None) -> list[list[nn.Parameter]]:
    """Consecutive runs of parameters whose pieces add up to at most ``limit`` elements."""
    if not limit:
        return [params]
    out: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        n = p._zs.piece.numel()
        if out[-1] and size + n > limit:
            out.append([])
            size = 0
        out[-1].append(p)
        size += n
    return out


class Stage3(StepSequence):
    """Owns the parameter shards, gradient shards and fp32 masters at ZeRO stage 3."""

    stage = 3

    def __init__(
        self,
        module: nn.Module,
        groups: list[dict],
        *,
        comm: Comm,
        precision: Precision,
        prefetch_numel: int,
        persistence_threshold: int,
        reduce_bucket_numel: int = 4_000_000,
        prescale: float = 1.0,
        meter: StorageMeter | None = None,
        offload=None,
        sub_group_numel: int | None = None,
        offload_param=None,
    ) -> None:
        self.module, self.comm, self.precision = module, comm, precision
        # offload_optimizer: masters, gradient shards and optimizer state in host memory ("cpu")
        # or, masters and state, in files ("nvme"); the optimizer steps on the host.
        self.offload = offload.device if offload is not None else "none"
        pin = bool(offload is not None and offload.pin_memory)
        self.host_meter = HostMeter()
        self.dp, self.rank = comm.topo.dp, comm.topo.dp_rank
        self.prescale = prescale
        self.prefetch_numel = prefetch_numel
        self.meter = meter or StorageMeter()
        self.boundary = True
        dtype = precision.compute_dtype
        everything = list(dict.fromkeys(module.parameters()))
        trainable = [p for g in groups for p in g["params"]]
        self._trainable = set(trainable)
        for p in everything:
            if not is_sharded(p):
                shard_param(p, comm, self.meter)
            else:  # built under zero.Init: count its piece here too
                self.meter.track(p._zs.piece)
            p._zs_comm, p._zs_meter = comm, self.meter

        # Parameters zero.Init already put in files (remote_device="nvme") stay there.
        self.param_swapper: ParamSwapper | None = getattr(everything[0], "_zs_swapper", None)
        if self.param_swapper is not None:
            self.param_swapper.meter, self.param_swapper.device = self.host_meter, comm.topo.device
        # offload_optimizer "nvme": masters, optimizer state and fp32 gradients live in files,
        # built sub-group by sub-group so the whole state is never in memory at once.
        self.swapper = None
        self._grad_written: set[nn.Parameter] = set()
        self._sq: dict[nn.Parameter, torch.Tensor] = {}
        self._grad_scale = 1.0
        if self.offload == "nvme":
            need = sum(p._zs.piece.numel() for p in trainable) * 4 * 4  # master, 2 moments, grad
            what = "zero_optimization.offload_optimizer"
            store = NVMeStore(offload.nvme_path, comm.topo.global_rank, need, what)
            self.swapper = OptimizerSwapper([], store, offload.buffer_count, self.host_meter)
            self.swapper.grad_source = self._load_grad
            self._grad_key = {p: f"grad{i}" for i, p in enumerate(trainable)}
        self.groups: list[_Group] = []
        limit = sub_group_numel if self.offload == "nvme" else None
        for index, group in enumerate(groups):
            options = {k: v for k, v in group.items() if k != "params"}
            for params in _sub_groups(list(group["params"]), limit):
                self.groups.append(self._make_group(params, options, index, dtype, pin))
        self._group_of = {g.master: g for g in self.groups}  # master -> its (sub-)group
        for p in everything:
            if self.param_swapper is not None and self.param_swapper.holds(p):
                if p not in self._trainable:
                    self.param_swapper.fetch([p])
                    self.param_swapper.rewrite(p, p._zs.piece, dtype)
            elif p not in self._trainable and p._zs.piece.dtype != dtype:
                p._zs.piece = self.meter.track(p._zs.piece.to(dtype))
            p.data = torch.empty(0, dtype=dtype, device=p.device)
        sync_from_rank0(list(module.buffers()), comm, dtype)

        self._persistent = [p for p in everything if p._zs.numel < persistence_threshold]
        for p in self._persistent:
            p._zs.persistent = True
            if self.param_swapper is not None and self.param_swapper.holds(p):
                self.param_swapper.keep(p)
        self._refresh_persistent(self._persistent)
        # offload_param: every non-persistent piece lives in a file ("nvme") or in host memory
        # ("cpu"), and is read in for each gather
        wanted = offload_param is not None and offload_param.device != "none"
        if self.param_swapper is None and wanted:
            swapped = [p for p in everything if not p._zs.persistent]
            need = sum(p._zs.piece.nbytes for p in swapped)
            what = "zero_optimization.offload_param"
            if offload_param.device == "nvme":
                store = NVMeStore(offload_param.nvme_path, comm.topo.global_rank, need, what)
            else:
                store = HostStore(offload_param.pin_memory)
            self.param_swapper = ParamSwapper(swapped, store, self.host_meter, comm.topo.device)
            for g in self.groups:  # the pieces live in the files; only persistent ones stay
                g.pieces = None

        self.coord = ParamCoordinator(
            module,
            comm=comm,
            meter=self.meter,
            prefetch_numel=prefetch_numel,
            trainable=self._trainable,
            swapper=self.param_swapper,
        )
        owner = self._owner = self.coord.owner
        self._owned = [
            [p for p in ps if owner[p] == u and p in self._trainable]
            for u, ps in enumerate(self.coord.units)
        ]
        # Reduce buckets: owner units in reverse construction order (roughly the order backward
        # finishes them), grouped up to ``reduce_bucket_numel`` elements so that a few large
        # reduce-scatters replace one per module. ``_rs_at[p]`` is where p's piece sits.
        self._rs_params: list[list[nn.Parameter]] = []
        self._rs_width: list[int] = []
        self._rs_bucket: dict[nn.Parameter, int] = {}
        self._rs_at: dict[nn.Parameter, int] = {}
        for u in reversed(range(len(self.coord.units))):
            if not self._owned[u]:
                continue
            if not self._rs_params or self._rs_width[-1] * self.dp >= reduce_bucket_numel:
                self._rs_params.append([])
                self._rs_width.append(0)
            for p in self._owned[u]:
                self._rs_bucket[p] = len(self._rs_params) - 1
                self._rs_at[p] = self._rs_width[-1]
                self._rs_params[-1].append(p)
                self._rs_width[-1] += p._zs.piece.numel()
        self.reducer = GradReducer([len(ps) for ps in self._rs_params], self._launch)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in trainable]

        self._reset_backward()

    def _make_group(self, params, options, index, dtype, pin) -> _Group:
        device = self.comm.topo.device
        swapped = [p for p in params if self.param_swapper and self.param_swapper.holds(p)]
        if swapped:
            self.param_swapper.fetch(swapped)
        swapped = set(swapped)
        total = sum(p._zs.piece.numel() for p in params) or 1
        master = torch.zeros(total, dtype=torch.float32, device=device)
        off = 0
        for p in params:
            pn = p._zs.piece.numel()
            master[off : off + pn].copy_(p._zs.piece)
            off += pn
        # The group's pieces, end to end; the per-parameter pieces they replace are freed.
        pieces = master if dtype == torch.float32 else master.to(dtype)
        if self.offload != "none":
            master = to_host(master, pin)  # a host copy, separate even in fp32
        grad_shard = None if self.swapper is not None else torch.zeros_like(master)
        off = 0
        for p in params:
            st, pn = p._zs, p._zs.piece.numel()
            if p in swapped:  # back to its file, in the compute dtype
                self.param_swapper.rewrite(p, pieces[off : off + pn], dtype)
                st.master = st.grad = None
            else:
                st.piece, st.master = pieces[off : off + pn], master[off : off + pn]
                st.grad = None if grad_shard is None else grad_shard[off : off + pn]
            off += pn
        if swapped:
            pieces = None
        else:
            self.meter.track(pieces)
        group = _Group(params, options, nn.Parameter(master), pieces, grad_shard, index)
        if self.swapper is not None:
            for p in params:
                p._zs.master = None  # the master lives in a file now, not in views of it
            self.swapper.add(group.master)
        return group

    # ----------------------------------------------------------------------------- gradients
    def _save_grad(self, p: nn.Parameter, reduced: torch.Tensor) -> None:
        """Add this micro-step's reduced piece into p's gradient file (NVMe optimizer)."""
        store = self.swapper.store
        if p in self._grad_written:
            acc = torch.empty(reduced.numel(), dtype=torch.float32)
            store.read_into(self._grad_key[p], [acc])
            acc += reduced
        else:
            acc = reduced.to(torch.float32, copy=True)
        store.write(self._grad_key[p], [acc])
        self._grad_written.add(p)
        if self.boundary:  # the final value: its share of the global norm
            self._sq[p] = torch.linalg.vector_norm(acc, dtype=torch.float32).square()

    def _load_grad(self, master: nn.Parameter) -> torch.Tensor:
        """The sub-group's gradient, read from the files and scaled (the optimizer's input)."""
        g = self._group_of[master]
        out = torch.zeros(master.numel(), dtype=torch.float32)
        off = 0
        for p in g.params:
            pn = p._zs.piece.numel()
            if p in self._grad_written:
                self.swapper.store.read_into(self._grad_key[p], [out[off : off + pn]])
            off += pn
        return out.mul_(self._grad_scale)

    # ----------------------------------------------------------------------------- gathering
    def _refresh_persistent(self, params: list[nn.Parameter]) -> None:
        gather_now(params, self.comm, self.meter)

    def _write_pieces(self, g: _Group, value: torch.Tensor) -> None:
        """The stepped fp32 values of a (sub-)group into its compute-dtype pieces (or files)."""
        if self.param_swapper is None:
            g.pieces.copy_(value)
            return
        off = 0
        for p in g.params:
            pn = p._zs.piece.numel()
            if self.param_swapper.holds(p):
                self.param_swapper.update(p, value[off : off + pn])
            else:
                p._zs.piece.copy_(value[off : off + pn])
            off += pn

    @property
    def prefetched(self) -> int:
        """Units whose gather was launched ahead of need (for tests and reports)."""
        return self.coord.prefetched

    # ----------------------------------------------------------------------------- reducing
    def _reset_backward(self) -> None:
        self._staging: dict[int, torch.Tensor] = {}
        self._reduced: dict[int, torch.Tensor] = {}  # bucket -> this rank's pieces, in flight

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        b = self._rs_bucket[p]
        if b not in self._staging:
            size = (self.dp, self._rs_width[b])
            self._staging[b] = torch.zeros(size, dtype=p.grad.dtype, device=p.device)
        at, pn = self._rs_at[p], p._zs.piece.numel()
        grad = p.grad.reshape(-1)
        if grad.numel() != pn * self.dp:  # pad to whole pieces first
            grad = torch.cat([grad, grad.new_zeros(pn * self.dp - grad.numel())])
        self._staging[b][:, at : at + pn].copy_(grad.view(self.dp, pn))
        p.grad = None  # the full gradient does not outlive this hook
        self.coord.grad_arrived(p)
        self.reducer.arrived(b)

    def _launch(self, b: int) -> Handle | None:
        staging = self._staging.pop(b, None)
        if staging is None:  # no parameter of this bucket got a gradient in this backward
            staging = torch.zeros(
                self.dp,
                self._rs_width[b],
                dtype=self.precision.compute_dtype,
                device=self.comm.topo.device,
            )
        if self.prescale != 1.0:
            staging.mul_(self.prescale)
        if self.dp == 1:  # nothing to reduce: into the shard now, not held until the end
            self._accumulate(b, staging.view(-1))
            return None
        out = self._reduced[b] = staging.new_empty(self._rs_width[b])
        return self.comm.reduce_scatter(out, staging.view(-1), axis="dp", async_op=True)

    def _accumulate(self, b: int, out: torch.Tensor) -> None:
        """Add reduce bucket ``b``'s pieces into the fp32 gradient shard (or its files)."""
        if self.offload != "none":
            out = out.to(host_device())  # the reduced pieces go to the host shard
        for p in self._rs_params[b]:
            at = self._rs_at[p]
            if self.swapper is not None:
                self._save_grad(p, out[at : at + p._zs.piece.numel()])
            else:
                p._zs.grad.add_(out[at : at + p._zs.piece.numel()])

    def end_backward(self) -> None:
        """Reduce what is left, add this rank's pieces into the fp32 shard, free everything."""
        for b in self.reducer.flush():
            if b in self._reduced:
                self._accumulate(b, self._reduced[b])
        self.coord.end_backward()
        self._reset_backward()

    # ----------------------------------------------------------------------------- step
    def optimizer_groups(self) -> list[dict]:
        out: list[dict] = []
        for g in self.groups:
            if len(out) <= g.index:
                out.append({"params": [], **g.options})
            out[g.index]["params"].append(g.master)
        return out

    @property
    def grads_sharded(self) -> bool:
        return self.dp > 1

    def masters(self) -> list[nn.Parameter]:
        return [g.master for g in self.groups]

    def grad_norm_sq(self, skip: set[nn.Parameter]) -> torch.Tensor:
        """Sum of squares of this rank's gradient shards, leaving out the parameters in ``skip``
        (tp replicas counted on another rank)."""
        # Parameter by parameter, so the sum does not depend on how groups are cut into
        # sub-groups (NVMe offload): offloaded or not, the clipping factor is the same number.
        sq = torch.zeros((), dtype=torch.float32, device=host_device())
        for g in self.groups:
            for p in g.params:
                if p in skip:
                    continue
                if self.swapper is not None:  # kept as each gradient file was written
                    sq += self._sq.get(p, 0.0)
                else:
                    sq += torch.linalg.vector_norm(p._zs.grad, dtype=torch.float32).square()
        return sq

    def _prepare_step(self, loss_scale: float) -> float:
        """Hand each master its fp32 gradient shard (summed, scaled); return the factor that
        averages and unscales it (see ShardedDataParallel._prepare_step)."""
        for g in self.groups:
            if self.swapper is not None:  # in files: a stand-in marks "has a gradient"
                g.master.grad = torch.zeros((), dtype=torch.float32).expand(g.master.shape)
            else:
                g.master.grad = g.grad_shard
        return 1.0 / (loss_scale * self.prescale * self.dp)

    def scale_grads(self, factor: float) -> None:
        """Multiply the masters' gradients (on NVMe: as each sub-group is read for the step)."""
        if self.swapper is not None:
            self._grad_scale = factor
            return
        for g in self.groups:
            g.master.grad.mul_(factor)

    def step_optimizer(self, optimizer) -> None:
        """``optimizer.step()`` on the masters (sub-group by sub-group when they are on NVMe,
        each written into the compute-dtype pieces while it is in memory)."""
        if self.swapper is None:
            optimizer.step()
            return
        self.swapper.step(optimizer, lambda m, value: self._write_pieces(self._group_of[m], value))

    def after_step(self) -> None:
        for g in self.groups:
            if self.swapper is not None:
                continue  # written while each sub-group was in memory
            if g.pieces is None or g.pieces.data_ptr() != g.master.data_ptr():
                self._write_pieces(g, g.master.detach())
        self._refresh_persistent([p for p in self._persistent if p in self._trainable])

    def zero_grad(self) -> None:
        for g in self.groups:
            if g.grad_shard is not None:
                g.grad_shard.zero_()
            g.master.grad = None
        self._grad_written.clear()
        self._sq.clear()
        self._grad_scale = 1.0

    # ----------------------------------------------------------------------------- state
    def full_master(self) -> dict[nn.Parameter, torch.Tensor]:
        """Every parameter's full value, fp32 for trained ones (a collective over dp)."""
        out = {}
        params = list(self._owner)
        states = [p._zs for p in params]
        from_files: dict[nn.Parameter, torch.Tensor] = {}
        if self.swapper is not None:
            for g in self.groups:
                value, off = self.swapper.read(g.master), 0
                for p in g.params:
                    from_files[p] = value[off : off + p._zs.piece.numel()]
                    off += p._zs.piece.numel()
        device = self.comm.topo.device
        if self.param_swapper is not None:
            self.param_swapper.fetch([p for p in params if p not in self._trainable])
        masters = []
        for p, st in zip(params, states, strict=True):
            m = from_files.get(p, st.master)
            m = (m if m is not None else st.piece.float()).to(device)
            masters.append(type(st)(st.shape, st.numel, m))
        for p, full in zip(params, gather_full(masters, self.comm), strict=True):
            out[p] = full
        if self.param_swapper is not None:
            self.param_swapper.drop([p for p in params if p not in self._trainable])
        return out

    @property
    def owns_replica(self) -> bool:
        """Every rank writes its own shard."""
        return True

    def read_master(self, master: nn.Parameter, optimizer, kinds=()) -> dict[str, torch.Tensor]:
        """As :meth:`ShardedDataParallel.read_master`."""
        if self.swapper is not None:
            return self.swapper.read_state(master, kinds)
        return live_state(master, optimizer, kinds)

    def write_master(self, master: nn.Parameter, optimizer, values: dict) -> None:
        """Store what :meth:`read_master` gave, filled by a load: on NVMe into the files and the
        compute-dtype pieces (or their files) at once; in memory ``after_load`` writes pieces."""
        if self.swapper is None:
            return
        self.swapper.write_state(master, values, optimizer)
        self._write_pieces(self._group_of[master], values["master"])

    def owned_slices(self):
        """``(param, lo, hi, master, a, b)``: this rank's master holds elements ``[lo, hi)`` of
        the flattened parameter at ``master[a:b]`` (padding excluded)."""
        for g in self.groups:
            off = 0
            for p in g.params:
                pn, n = p._zs.piece.numel(), p._zs.numel
                lo = min(self.rank * pn, n)
                hi = min(lo + pn, n)
                yield p, lo, hi, g.master, off, off + (hi - lo)
                off += pn

    def frozen_slices(self):
        """``(param, lo, hi, held)`` for each parameter the optimizer does not train (frozen):
        this rank's piece ``held`` (compute dtype) holds elements ``[lo, hi)`` of the flattened
        parameter (padding excluded); a checkpoint reads it and loads into it."""
        for p in self._owner:
            if p not in self._trainable:
                if self.param_swapper is not None and self.param_swapper.holds(p):
                    raise RuntimeError(
                        "checkpoints of frozen parameters with offload_param are not supported yet"
                    )
                pn, n = p._zs.piece.numel(), p._zs.numel
                lo = min(self.rank * pn, n)
                hi = min(lo + pn, n)
                yield p, lo, hi, p._zs.piece[: hi - lo]

    def after_load(self) -> None:
        """Loaded masters into the pieces, and loaded frozen pieces into the gathered copies of
        persistent parameters (a collective over dp)."""
        self.after_step()
        self._refresh_persistent([p for p in self._persistent if p not in self._trainable])

    def close(self) -> None:
        """Remove the NVMe files (also done at process exit)."""
        for swapper in (self.swapper, self.param_swapper):
            if swapper is not None:
                swapper.close()

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds in parameter shards (and gathered copies), gradient shards and
        separate fp32 masters."""
        if self.param_swapper is None:
            params = sum(g.pieces.nbytes for g in self.groups)
            params += sum(p._zs.piece.nbytes for p in self._owner if p not in self._trainable)
        else:  # pieces in memory now (a swapped-out one is a stride-0 placeholder)
            params = sum(p._zs.piece.nbytes for p in self._owner if p._zs.piece.stride() != (0,))
        params += sum(p._zs.held_bytes for p in self._owner)  # gathered copies held right now
        master = sum(
            g.master.nbytes
            for g in self.groups
            if g.pieces is None or g.pieces.data_ptr() != g.master.data_ptr()
        )  # on NVMe the masters hold no storage between steps
        grads = sum(g.grad_shard.nbytes for g in self.groups if g.grad_shard is not None)
        return {"params": params, "grads": grads, "master": master}
