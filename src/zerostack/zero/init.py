"""Stage-3 parameter shards: ``zero.Init`` builds a model already sharded, ``GatheredParameters``
gathers some of it back for a moment.

A sharded parameter keeps its full shape in ``p._zs`` (a :class:`ShardState`) and holds in
``p.data`` an empty tensor until gathered. Every rank stores piece ``r`` of the parameter,
flattened and padded to a multiple of the dp size::

    with zerostack.zero.Init():
        model = GPT(cfg)               # each layer is sharded as soon as its constructor returns
    with zerostack.zero.GatheredParameters(model.wte.weight, modifier_rank=0):
        if rank == 0:
            model.wte.weight[0].zero_()  # written back to every rank's shard on exit
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..comm import Comm
from ..comm.grid import comm_for
from ..core import scratch
from ..topology import Topology
from . import partition, quantize
from .hf_init import patch_init_weights


class StorageMeter:
    """Bytes of parameter storage held (shards and gathered copies), and the peak.

    Counted where zerostack allocates and frees parameter storage, so the figure is what the
    program holds, not an estimate from the allocator and not the process RSS.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def sub(self, nbytes: int) -> None:
        self.live -= nbytes

    def track(self, t: torch.Tensor) -> torch.Tensor:
        """Count ``t`` until its Python object is freed (for shards, which nothing else holds)."""
        self.add(t.nbytes)
        weakref.finalize(t, self.sub, t.nbytes)
        return t


@dataclass
class ShardState:
    """What a stage-3 parameter is when it is not gathered."""

    shape: torch.Size
    numel: int
    piece: torch.Tensor  # this rank's piece of the flattened, padded parameter
    persistent: bool = False  # small parameters stay gathered (stage3_param_persistence_threshold)
    active: int = 0  # how many gathers hold it (a tied parameter can be held by two modules)
    kept: bool = False  # released by its unit but kept whole for a reuse soon (max_reuse_distance)
    held_bytes: int = 0  # bytes of the gathered copy, while there is one
    master: torch.Tensor | None = None  # fp32 view into the group's master shard (engine)
    grad: torch.Tensor | None = None  # fp32 view into the group's gradient shard (engine)
    comm: Comm | None = None  # whose dp group holds the other pieces
    meter: StorageMeter | None = None  # counts the piece and gathered copies
    swapper: object | None = None  # zero.Init(remote_device=...): the store holding the piece
    secondary: torch.Tensor | None = None  # hpZ: a forward's copy of this rank's subgroup piece

    @property
    def gathered(self) -> bool:
        return self.active > 0 or self.persistent or self.kept


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's ``ds_status`` of a stage-3 parameter (same names and values)."""

    AVAILABLE = 1  # gathered: ``p.data`` is the whole parameter
    NOT_AVAILABLE = 2  # released: ``p.data`` is empty, only this rank's piece is held
    INFLIGHT = 3  # DeepSpeed's state while a gather runs; zerostack's gathers complete in place


_ds_ids = itertools.count()


def _mark_ds(p: nn.Parameter, state: ShardState) -> None:
    """DeepSpeed's attributes on a stage-3 parameter, which Transformers and PEFT read
    (``ds_shape`` and ``ds_numel`` for the real size of a parameter whose ``shape`` is empty)."""
    p.ds_id = next(_ds_ids)
    p.ds_shape = state.shape
    p.ds_numel = state.numel
    p.ds_persist = False
    p.ds_status = ZeroParamStatus.NOT_AVAILABLE


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a stage-3 parameter (its value is this rank's piece, ``p._zs``)."""
    return hasattr(p, "_zs")


def full_shape(p: torch.Tensor) -> torch.Size:
    """``p``'s shape, the whole parameter's even when only a piece is held (stage 3)."""
    return p._zs.shape if is_sharded(p) else p.shape


def empty_like_released(p: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=p.dtype, device=p.device)


def hold(p: nn.Parameter, full: torch.Tensor, meter: StorageMeter | None, copied: bool) -> None:
    """Point ``p`` at its gathered value (counted in ``meter`` when it is a fresh copy)."""
    p.data = full
    p.ds_status = ZeroParamStatus.AVAILABLE
    if meter is not None and p._zs.held_bytes:
        meter.sub(p._zs.held_bytes)
        p._zs.held_bytes = 0
    if copied and meter is not None:
        p._zs.held_bytes = full.nbytes
        meter.add(full.nbytes)


def release(p: nn.Parameter, meter: StorageMeter | None) -> None:
    """Drop ``p``'s gathered value, keeping only the shard."""
    p.data = empty_like_released(p)
    p.ds_status = ZeroParamStatus.NOT_AVAILABLE
    if meter is not None:
        meter.sub(p._zs.held_bytes)
    p._zs.held_bytes = 0


def shard_param(p: nn.Parameter, comm: Comm, meter: StorageMeter | None = None) -> ShardState:
    """Replace ``p``'s data by this rank's piece (after broadcasting dp rank 0's values)."""
    n, world, rank = p.numel(), comm.topo.dp, comm.topo.dp_rank
    # on the device before anything else (a module builds its parameters in host memory, and
    # NCCL broadcasts device tensors only); frozen ones too, even with nothing to broadcast
    full = p.data.to(comm.topo.device).contiguous()
    if world > 1:
        comm.broadcast(full, src=0, axis="dp")
    piece_numel = partition.piece_numel(n, world)
    padded = torch.zeros(piece_numel * world, dtype=full.dtype, device=full.device)
    padded[:n].copy_(full.reshape(-1))
    piece = padded[rank * piece_numel : (rank + 1) * piece_numel].clone()
    if meter is not None:
        meter.track(piece)
    state = ShardState(p.shape, n, piece, comm=comm, meter=meter)
    p._zs = state
    p.data = empty_like_released(p)
    _mark_ds(p, state)
    return state


@dataclass
class Subgroup:
    """ZeRO++ hpZ: ``size`` consecutive dp ranks (``group``), this rank ``rank`` among them."""

    size: int
    rank: int
    group: object


def gather_full(
    states: list[ShardState],
    comm: Comm,
    dtype=None,
    async_op=False,
    quantized: bool = False,
    secondary: Subgroup | None = None,
    record: bool = False,
):
    """All-gather several parameters in one collective; returns their full tensors.

    With ``async_op`` returns a function that waits and returns them. ``quantized`` sends int8
    blocks (ZeRO++ qwZ, :mod:`.quantize`) and returns the dequantized values, in the pieces'
    dtype (or ``dtype``). ``secondary`` gathers the states' secondary pieces (ZeRO++ hpZ, see
    :func:`secondary_piece`) within that subgroup instead of the pieces over dp. ``record``:
    launched on a side stream, the receive buffer is marked used by the stream that waits
    (``Tensor.record_stream``), which reads it and may free it.
    """
    if secondary is not None:
        pieces = [s.secondary for s in states]
        return _gather_rows(states, pieces, comm, secondary.size, async_op, "hpz", secondary.group)
    world = comm.topo.dp
    pieces = [s.piece if dtype is None else s.piece.to(dtype) for s in states]
    if world == 1:
        fulls = [pc[: s.numel].view(s.shape) for pc, s in zip(pieces, states, strict=True)]
        return (lambda: fulls) if async_op else fulls
    if quantized:
        return _gather_quantized(states, pieces, comm, async_op, record)
    return _gather_rows(states, pieces, comm, world, async_op, "dp", None, record)


def _gather_rows(
    states, pieces, comm: Comm, world: int, async_op: bool, axis: str, group, record=False
):
    """One all-gather of the concatenated ``pieces`` (each rank's, equal widths) over ``axis``
    (or ``group``, of ``world`` ranks); rank ``r``'s row holds piece ``r`` of every state."""
    flat = pieces[0]  # one piece is sent as it is
    if len(pieces) > 1:
        flat = scratch.empty(sum(pc.numel() for pc in pieces), flat.dtype, flat.device)
        torch.cat(pieces, out=flat)
    width = flat.numel()
    out = scratch.empty(world * width, flat.dtype, flat.device)
    handle = comm.all_gather(out, flat, axis=axis, async_op=True, group=group)
    del flat  # the collective keeps what it sends alive until it completes

    def finish() -> list[torch.Tensor]:
        handle.wait()
        if record:
            out.record_stream(torch.cuda.current_stream())
        rows = out.view(world, width)
        fulls, off = [], 0
        for s, pc in zip(states, pieces, strict=True):
            pn = pc.numel()
            full = out  # a unit of one parameter: a view of the fresh ``out``
            if len(states) > 1:  # one copy of the strided column block
                full = scratch.empty(world * pn, out.dtype, out.device)
                full.view(world, pn).copy_(rows[:, off : off + pn])
            fulls.append(full[: s.numel].view(s.shape))
            off += pn
        return fulls

    return finish if async_op else finish()


def secondary_piece(full: torch.Tensor, sub: Subgroup) -> torch.Tensor:
    """This rank's piece of ``full`` cut ``sub.size`` ways (padded), a copy: ZeRO++ hpZ keeps it
    from a forward's gather so that the backward gathers within the subgroup."""
    flat = full.reshape(-1)
    width = partition.piece_numel(flat.numel(), sub.size)
    lo = min(sub.rank * width, flat.numel())
    hi = min(lo + width, flat.numel())
    piece = torch.zeros(width, dtype=flat.dtype, device=flat.device)
    piece[: hi - lo].copy_(flat[lo:hi])
    return piece


def _gather_quantized(states, pieces, comm: Comm, async_op: bool, record: bool = False):
    """:func:`gather_full` of int8 blocks: one uint8 payload per rank (:func:`.quantize.pack`)."""
    world = comm.topo.dp
    payload = quantize.pack(pieces)
    out = torch.empty(world * payload.numel(), dtype=torch.uint8, device=payload.device)
    handle = comm.all_gather(out, payload, axis="dp", async_op=True)
    del payload

    def finish() -> list[torch.Tensor]:
        handle.wait()
        if record:
            out.record_stream(torch.cuda.current_stream())
        rows = out.view(world, -1)
        numels = [pc.numel() for pc in pieces]
        values = quantize.unpack(rows, numels, pieces[0].dtype)
        return [v.reshape(-1)[: s.numel].view(s.shape) for v, s in zip(values, states, strict=True)]

    return finish if async_op else finish()


def _all_module_classes() -> list[type]:
    seen, stack = [], [nn.Module]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.append(sub)
                stack.append(sub)
    return seen


class Init:
    """Build a model with every parameter sharded across the dp ranks as soon as it exists.

    Inside the context, the constructor of every ``nn.Module`` class is wrapped: when the outermost
    constructor of a module returns, its own parameters (children are already done) are broadcast
    from dp rank 0 and cut to this rank's piece. So at most one module's parameters are ever whole.
    Initialise weights inside each layer's constructor: a pass over the finished model would see
    empty tensors. Everything is restored on exit.

    ``remote_device="nvme"`` (ZeRO-Infinity) writes each piece to a file under the config's
    ``zero_optimization.offload_param.nvme_path`` as soon as it is cut, so not even this rank's
    shard of the model is ever in memory; ``"cpu"`` keeps the pieces in (pinned) host memory. The
    engine's stage 3 takes the files over. DeepSpeed's other keyword arguments are accepted;
    ``enabled=False`` makes it a no-op.

    ``Init(module=model)`` shards an already built model's parameters at once, module by module
    (DeepSpeed's use; the context is then not needed). A Hugging Face model built inside the
    context (``AutoModelForCausalLM.from_config(cfg)``) gets its own weight initialisation, run on
    gathered parameters (:mod:`zerostack.zero.hf_init`).
    """

    def __init__(
        self,
        module=None,
        *,
        topology: Topology | None = None,
        enabled: bool = True,
        remote_device: str | None = None,
        config_dict_or_path=None,
        pin_memory: bool = False,
        config=None,
        **_deepspeed_kwargs,
    ) -> None:
        self.enabled = enabled
        self.topology = topology
        self.meter = StorageMeter()
        self._saved: dict[type, object] = {}
        self.remote_device = remote_device if remote_device not in (None, "none") else None
        if self.remote_device not in (None, "cpu", "nvme"):
            raise ValueError(f"zero.Init: remote_device {remote_device!r} is not 'cpu' or 'nvme'")
        self.comm: Comm | None = None
        self._config = config_dict_or_path if config_dict_or_path is not None else config
        self._pin = pin_memory
        self.swapper = None
        self._undo_hf = None
        if module is not None and enabled:
            if not isinstance(module, nn.Module):
                raise TypeError(f"zero.Init: module is a {type(module).__name__}, not an nn.Module")
            self._start()
            for m in module.modules():  # children before the parameters they share are seen
                self._shard_module(m)

    def _start(self) -> None:
        if self.comm is None:
            self.comm = comm_for(self.topology or Topology.build())
            if self.remote_device is not None:
                self.swapper = self._make_swapper()

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        self._start()
        self._undo_hf = patch_init_weights(_gathered_pieces)
        self._saved_init_subclass = nn.Module.__dict__.get("__init_subclass__")
        for cls in _all_module_classes():
            self._wrap(cls)
        init = self

        def init_subclass(cls, **kwargs):  # classes defined inside the context are wrapped too
            super(nn.Module, cls).__init_subclass__(**kwargs)
            init._wrap(cls)

        nn.Module.__init_subclass__ = classmethod(init_subclass)
        return self

    def _wrap(self, cls: type) -> None:
        if "__init__" not in cls.__dict__ or cls in self._saved:
            return
        original = cls.__dict__["__init__"]
        self._saved[cls] = original
        init = self

        def wrapped(module, *args, **kwargs):
            depth = module.__dict__.get("_zs_depth", 0)
            module.__dict__["_zs_depth"] = depth + 1
            try:
                original(module, *args, **kwargs)
            finally:
                module.__dict__["_zs_depth"] = depth
            if depth == 0:
                del module.__dict__["_zs_depth"]
                init._shard_module(module)

        wrapped.__wrapped__ = original
        cls.__init__ = wrapped

    def _shard_module(self, module: nn.Module) -> None:
        # Meta parameters hold no storage and are about to be replaced (e.g. a tied weight).
        todo = [p for p in module.parameters(recurse=False) if not is_sharded(p) and not p.is_meta]
        whole = sum(p.untyped_storage().nbytes() for p in todo)
        self.meter.add(whole)  # this module's parameters are whole right now
        for p in todo:
            shard_param(p, self.comm, self.meter)
            if self.swapper is not None:
                self.swapper.add(p)
                p._zs.swapper = self.swapper
        self.meter.live -= whole

    def _make_swapper(self):
        from ..config import ConfigError, load_config
        from .offload import HostMeter, HostStore, NVMeStore
        from .param_swap import ParamSwapper

        if self.remote_device == "cpu":
            store = HostStore(self._pin)
        else:
            cfg = load_config(self._config) if self._config is not None else None
            offload = cfg.zero_optimization.offload_param if cfg is not None else None
            if offload is None or not offload.nvme_path:
                raise ConfigError(
                    "zero_optimization.offload_param.nvme_path: zero.Init(remote_device='nvme') "
                    "needs it (pass config_dict_or_path=)"
                )
            what = "zero_optimization.offload_param"
            store = NVMeStore(offload.nvme_path, self.comm.topo.global_rank, 0, what)
        return ParamSwapper([], store, HostMeter(), self.comm.topo.device)

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        if self._undo_hf is not None:
            self._undo_hf()
            self._undo_hf = None
        for cls, original in self._saved.items():
            cls.__init__ = original
        self._saved.clear()
        if self._saved_init_subclass is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self._saved_init_subclass


@contextlib.contextmanager
def GatheredParameters(params, modifier_rank: int | None = None, fwd_module=None, enabled=True):
    """Gather sharded parameters for reading, or for changing on ``modifier_rank``.

    On exit the values of ``modifier_rank`` (a dp rank) are broadcast and written back into every
    rank's piece (and into the engine's fp32 master, if the parameter is being trained). Parameters
    that are not sharded pass through untouched.
    """
    if isinstance(params, torch.Tensor):
        params = [params]
    params = [p for p in params if is_sharded(p)] if enabled else []
    if not params:
        yield
        return
    comm = _comm_of(params[0])
    states = [p._zs for p in params]
    fulls = gather_full(states, comm)
    for p, full in zip(params, fulls, strict=True):
        if not p._zs.gathered:
            hold(p, full.clone() if comm.topo.dp == 1 else full, p._zs.meter, True)
        p._zs.active += 1
    try:
        yield
    finally:
        for p in params:
            st = p._zs
            if modifier_rank is not None:
                data = p.data.contiguous()
                if comm.topo.dp > 1:
                    comm.broadcast(data, src=modifier_rank, axis="dp")
                _write_back(st, data, comm)
            st.active -= 1
            if not st.gathered:
                release(p, p._zs.meter)


def _write_back(st: ShardState, full: torch.Tensor, comm: Comm) -> None:
    pn, rank = st.piece.numel(), comm.topo.dp_rank
    flat = torch.zeros(pn * comm.topo.dp, dtype=torch.float32, device=full.device)
    flat[: st.numel].copy_(full.reshape(-1))
    mine = flat[rank * pn : (rank + 1) * pn]
    st.piece.copy_(mine)
    if st.master is not None and st.master.data_ptr() != st.piece.data_ptr():
        st.master.copy_(mine)


def _comm_of(p: torch.Tensor) -> Comm:
    comm = p._zs.comm
    if comm is None:
        raise RuntimeError("a sharded parameter has lost its communicator")
    return comm


def _gathered_pieces(params: list[nn.Parameter]) -> GatheredParameters:
    """Those of ``params`` that are pieces, gathered; dp rank 0's values written back into every
    rank's pieces on exit (how a Hugging Face model initialises under :class:`Init`)."""
    return GatheredParameters([p for p in params if is_sharded(p)], modifier_rank=0)
