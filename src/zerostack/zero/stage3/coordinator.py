"""ZeRO stage 3's parameter coordinator: which parameters are gathered when, and for how long.

A *unit* (the vocabulary note in :mod:`zerostack.zero`) is a module that owns parameters
directly (and the root, always): a forward pre-hook
all-gathers its parameters (one coalesced collective) and a forward hook frees them again, after
attaching a hook to the module's outputs that gathers them once more when backward reaches the
module. In backward a unit stays gathered until each of its trainable parameters has its gradient
(:meth:`ParamCoordinator.grad_arrived`).

A parameter read (as ``module.weight``) during the forward of a unit that does not own it, say
``F.linear(x, other.weight)``, is gathered there and from then on belongs to that unit as well
(DeepSpeed's "external parameters"); the root is a unit even without parameters of its own, so
such a read always has a unit to hold it. A parameter reached some other way (kept in a list)
is not seen.

Prefetch: the first training forward + backward records the order in which units are gathered
(a no_grad pass, which has no backward, is neither recorded nor followed); later passes launch the
next units' gathers (up to ``prefetch_numel`` elements ahead, by default :data:`PREFETCH_UNITS`
times the largest unit's, and never past ``max_live_numel`` elements gathered at once: DeepSpeed's
``stage3_prefetch_bucket_size`` and ``stage3_max_live_parameters``) while the current module
computes. A unit done with its parameters keeps those that the recorded order uses again within
``max_reuse_numel`` elements of gathers (DeepSpeed's ``stage3_max_reuse_distance``; 0, the
default here, releases at once). Every rank runs the same graph, so every rank issues the same
collectives in the same order.

With the pieces offloaded to NVMe (``offload_param``), the files of the units after the prefetched
ones (up to ``prefetch_numel`` elements more) are read ahead on the swapper's thread, so that the
disk works while the current unit computes and a gather only queues its copy; reads a pass did not
use are dropped as it ends (:meth:`..offload.param_swap.ParamSwapper.forget_reads`).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ...comm import Comm
from ..offload.param_swap import ParamSwapper, ResidentPieces
from .collectives import Subgroup
from .gather import Gatherer, UnitGather
from .leaves import z3_leaf_module
from .module_hooks import ModuleHooks, eager
from .params import ShardState, StorageMeter, release

PREFETCH_UNITS = 2
"""The default prefetch, in units of the largest one: what is gathered ahead of the running
module when ``stage3_prefetch_bucket_size`` is not given. Two keep the gathers ahead on a
GPT block's unequal modules (a 0.26M projection before a 1M MLP): at 25M parameters, dp 2 on
the CPU, 1.07 s a step against 1.12 s with one (``benchmarks/floor.py``)."""


def _hold(st: ShardState) -> None:
    """A running module holds the parameter gathered."""
    st.active += 1
    st.by_modules += 1


def _unhold(st: ShardState) -> None:
    """A module is done with the parameter (unless its holds were cleared meanwhile:
    ``param.ds_active_sub_modules.clear()``)."""
    if st.by_modules > 0:
        st.by_modules -= 1
        st.active -= 1


def hooked_modules(root: nn.Module) -> list[nn.Module]:
    """The modules stage 3 hooks, each a unit: every module but those under a leaf
    (:mod:`.leaves`), in ``root.modules()``'s order."""
    out: list[nn.Module] = []
    seen: set[int] = set()

    def walk(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        out.append(m)
        if not z3_leaf_module(m):
            for child in m.children():
                walk(child)

    walk(root)
    return out


def make_units(c: ParamCoordinator) -> None:
    """Each of ``c.modules``' unit: its own parameters (a leaf's: all under it), each
    parameter's owner (the first unit holding it: a tied parameter is reduced once) and units.
    Every module is a unit, one without parameters of its own too (as DeepSpeed hooks every
    module): a forward reading a child's parameter directly (an MLP handing its linears'
    weights to a tiled compute) then borrows it in any module called alone."""
    for m in c.modules:
        ps = list(dict.fromkeys(m.parameters(recurse=False)))
        if z3_leaf_module(m):  # one unit for the leaf and everything under it
            ps = list(dict.fromkeys(m.parameters()))
            for p in ps:
                p.ds_z3_leaf_module = m
        u = len(c.units)
        c.units.append(ps)
        for p in ps:
            c.owner.setdefault(p, u)
            c._units_of.setdefault(p, []).append(u)


def _numel(params: list[nn.Parameter]) -> int:
    return sum(p._zs.numel for p in params if not p._zs.persistent)


class RecordedOrder:
    """The order in which the first training pass gathered the units, and how far the pass now
    running has followed it (a no_grad pass, which has no backward, neither records nor
    follows): prefetch, reads ahead and reuse look ahead in it."""

    def __init__(self) -> None:
        self.trace: list[int] | None = None  # the recorded order, once a training pass ended
        self.recording: list[int] = []
        self.ptr = 0  # where this pass is in the trace
        self.read_from = 0  # the first unit not yet prefetched
        self.following = False  # whether this pass runs as recorded, so far

    def begin_pass(self, training: bool) -> None:
        if self.trace is None and self.recording:
            self.trace = self.recording
        self.ptr = 0
        self.following = self.trace is not None and training

    def arrive(self, u: int, training: bool) -> bool:
        """Unit ``u`` is gathered: recorded in the first training pass; whether this pass still
        runs as recorded (then the trace moves past ``u``)."""
        if self.trace is None:
            if training:
                self.recording.append(u)
            return False
        if not self.following:
            return False
        if self.ptr >= len(self.trace) or self.trace[self.ptr] != u:
            self.following = False  # this pass differs from the recorded one
            return False
        self.ptr += 1
        return True


class ParamCoordinator:
    """Gathers and releases a stage-3 model's parameters around each module's forward and
    backward, prefetching in the recorded order."""

    def __init__(
        self,
        module: nn.Module,
        *,
        comm: Comm,
        meter: StorageMeter,
        prefetch_numel: int | None,
        trainable: set[nn.Parameter],
        swapper: ParamSwapper | ResidentPieces,
        max_live_numel: int = 1_000_000_000,
        max_reuse_numel: int = 0,
        quantized_weights: bool = False,
        hpz: Subgroup | None = None,
    ) -> None:
        self.meter = meter
        # the collectives: qwZ's int8 gathers, hpZ's secondary pieces (see .gather)
        self.gathers = Gatherer(comm, meter, swapper, quantized_weights, hpz)
        self.max_live_numel, self.max_reuse_numel = max_live_numel, max_reuse_numel
        self._trainable, self.param_swapper = trainable, swapper
        # Units, their owners (a tied parameter is reduced once, by the first module holding it).
        self.units: list[list[nn.Parameter]] = []
        self._units_of: dict[nn.Parameter, list[int]] = {}
        self.owner: dict[nn.Parameter, int] = {}
        self.module, self.modules = module, hooked_modules(module)  # unit u is modules[u]
        make_units(self)
        # the hooks that gather and release around each module (taken off and put back by RL
        # code: compat's parameter_offload)
        self.hooks = ModuleHooks(self)
        self.hooks.attach()
        if prefetch_numel is None:  # the next units' gathers overlap this one's compute
            prefetch_numel = PREFETCH_UNITS * max((_numel(ps) for ps in self.units), default=0)
        self.prefetch_numel = prefetch_numel
        self._bwd_need = [sum(p in trainable for p in ps) for ps in self.units]
        for u, m in enumerate(self.modules):  # registered before initialize (module_hooks)
            for p in getattr(m, "_zs_external", {}).values():
                self.adopt(u, p)
        self._bwd_held: dict[int, int] = {}  # unit -> gradients it still waits for
        self._running: list[int] = []  # units whose forward is in progress, innermost last
        self.order = RecordedOrder()  # the first training pass's, followed by later ones
        self._training_pass = False
        self._inflight: dict[nn.Parameter, UnitGather] = {}
        self._kept: set[nn.Parameter] = set()  # released by their units, kept for a reuse
        self.prefetched = 0  # units whose gather was launched ahead of need (for tests, reports)
        self.live_numel = self.peak_live_numel = 0  # elements gathered (not persistent) now, peak

    def forget_order(self) -> None:
        """Drop the recorded order: the next training pass records it anew (DeepSpeed's
        ``_invalidate_trace``; prefetch resumes from the pass after it)."""
        self.order = RecordedOrder()

    def grad_arrived(self, p: nn.Parameter) -> None:
        """``p`` has its gradient: release each unit holding it that waits for nothing else."""
        for held in self._units_of[p]:
            if held in self._bwd_held:
                self._bwd_held[held] -= 1
                if self._bwd_held[held] == 0:
                    del self._bwd_held[held]
                    self._release(held)

    def end_backward(self) -> None:
        """Release whatever backward still holds (units whose parameters got no gradient) and
        the prefetched gathers nobody used."""
        for u in list(self._bwd_held):
            self._release(u)
        self._bwd_held = {}
        self._drop_inflight()
        self._drop_kept()
        self.gathers.drop_secondaries()

    def release_gathered(self) -> None:
        """Release what is gathered without a module running: prefetched, or kept for reuse."""
        self._drop_inflight()
        self._drop_kept()
        self.gathers.drop_secondaries()

    @eager
    def _begin_pass(self, module, args) -> None:
        self._drop_inflight()
        self._drop_kept()
        self.gathers.drop_secondaries()
        self._running.clear()
        self._training_pass = torch.is_grad_enabled()
        self.order.begin_pass(self._training_pass)

    def _gather(self, u: int) -> None:
        """Hold unit ``u`` gathered; launch its gather and the prefetch as one collective."""
        ps = self.units[u]
        need = [p for p in ps if not p._zs.gathered and p not in self._inflight]
        self._count(need, +1)
        ahead = self._plan_prefetch(u, exclude=set(need))
        self._count(ahead, +1)
        if need or ahead:
            g = self.gathers.launch(need + ahead, self._training_pass)
            for p in need + ahead:
                self._inflight[p] = g
        self._read_ahead()
        for p in ps:
            pending = self._inflight.pop(p, None)
            if pending is not None:
                pending.resolve()
            if p._zs.kept:  # its unit holds it again; the next release decides anew
                p._zs.kept = False
                self._kept.discard(p)
            _hold(p._zs)

    def _plan_prefetch(self, u: int, exclude: set) -> list[nn.Parameter]:
        """Parameters of the units that come next in the recorded order, within the budget."""
        if not self.order.arrive(u, self._training_pass):
            return []
        inflight = sum(p._zs.numel for p in self._inflight)
        room = min(self.prefetch_numel - inflight, self.max_live_numel - self.live_numel)
        ahead: list[nn.Parameter] = []
        order = self.order
        order.read_from = order.ptr
        for nxt in order.trace[order.ptr :]:
            if room <= 0:
                break
            order.read_from += 1
            new = [
                p
                for p in self.units[nxt]
                if not p._zs.gathered and p not in self._inflight and p not in exclude
            ]
            if new:
                ahead += new
                exclude.update(new)
                room -= sum(p._zs.numel for p in new)
                self.prefetched += 1
        return ahead

    def _read_ahead(self) -> None:
        """Offloaded to NVMe: submit the file reads of the units after the prefetched ones (up to
        ``prefetch_numel`` elements) to the swapper's thread, so that the disk works while this
        unit computes and their gather later finds the pieces in memory."""
        if not self.param_swapper.reads_ahead or not self.order.following:
            return
        room, params = self.prefetch_numel, []
        for nxt in self.order.trace[self.order.read_from :]:
            if room <= 0:
                break
            new = [p for p in self.units[nxt] if not p._zs.gathered and p not in self._inflight]
            params += new
            room -= _numel(new)
        self.param_swapper.read_ahead(params)

    def _release(self, u: int) -> None:
        reused = self._reused_soon()
        for p in self.units[u]:
            st = p._zs
            _unhold(st)
            if st.gathered:
                continue
            if p in reused:
                st.kept = True
                self._kept.add(p)
            else:
                self._free(p)

    def _reused_soon(self) -> set[nn.Parameter]:
        """Parameters of the units the recorded order gathers next, within ``max_reuse_numel``
        elements (DeepSpeed's reuse distance: the units' sizes summed from here on)."""
        if not self.max_reuse_numel or not self.order.following:
            return set()
        seen: set[nn.Parameter] = set()
        travelled = 0
        for nxt in self.order.trace[self.order.ptr :]:
            if travelled >= self.max_reuse_numel:
                break
            seen.update(self.units[nxt])
            travelled += _numel(self.units[nxt])
        return seen

    def _free(self, p: nn.Parameter) -> None:
        release(p, self.meter)
        self._count([p], -1)

    def _count(self, params: list[nn.Parameter], sign: int) -> None:
        self.live_numel += sign * sum(p._zs.numel for p in params if not p._zs.persistent)
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def _drop_inflight(self) -> None:
        for p, g in list(self._inflight.items()):
            g.resolve()
            if not p._zs.gathered:
                self._free(p)
        self._inflight.clear()
        self.param_swapper.forget_reads()

    def _drop_kept(self) -> None:
        for p in self._kept:
            p._zs.kept = False
            if not p._zs.gathered:
                self._free(p)
        self._kept.clear()

    def adopt(self, u: int, p: nn.Parameter) -> None:
        """Make ``p`` unit ``u``'s too (gathered with it, forward and backward): read in its
        forward, or registered (DeepSpeed's ``register_external_parameter``)."""
        if u not in self._units_of[p]:
            self.units[u].append(p)
            self._units_of[p].append(u)
            self._bwd_need[u] += p in self._trainable

    @eager
    def _borrow(self, p: nn.Parameter) -> None:
        """``p`` is read in the forward of the innermost running unit, which does not hold it:
        gather it for the rest of that forward, and make it that unit's for every later gather
        (forward and backward) too."""
        self.adopt(self._running[-1], p)
        pending = self._inflight.pop(p, None)
        if pending is None:
            pending = self.gathers.launch([p], training=False)
            self._count([p], +1)
        pending.resolve()
        _hold(p._zs)

    @eager
    def _pre_forward(self, u: int, module, args) -> None:
        self._gather(u)
        self._running.append(u)

    @eager
    def _post_forward(self, u: int, module, args, output) -> None:
        self._running.pop()
        self._release(u)
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(partial(self._pre_backward, u))

    def _pre_backward(self, u: int, grad: torch.Tensor) -> None:
        if u not in self._bwd_held:
            self._bwd_held[u] = self._bwd_need[u]
            self._gather(u)
