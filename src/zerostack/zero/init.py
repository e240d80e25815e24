"""``zero.Init`` builds a model already sharded, ``GatheredParameters`` gathers some of it back
for a moment (the shard record and the gathers: :mod:`.stage3.params`)::

    with zerostack.zero.Init():
        model = GPT(cfg)               # each layer is sharded as soon as its constructor returns
    with zerostack.zero.GatheredParameters(model.wte.weight, modifier_rank=0):
        if rank == 0:
            model.wte.weight[0].zero_()  # written back to every rank's shard on exit
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..comm import Comm
from ..comm.grid import comm_for
from ..topology import Topology
from .hf_init import patch_init_weights
from .stage3.collectives import gather_full
from .stage3.params import (
    ShardState,
    StorageMeter,
    hold,
    is_sharded,
    release,
    shard_param,
)


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
        from .offload.host import HostMeter, HostStore, NVMeStore
        from .offload.param_swap import ParamSwapper

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
            hold(p, full.clone() if p._zs.world == 1 else full, p._zs.meter, True)
        p._zs.active += 1
    try:
        yield
    finally:
        for p in params:
            st = p._zs
            if modifier_rank is not None:
                data = p.data.contiguous()
                if st.world > 1:
                    comm.broadcast(data, src=modifier_rank, axis=st.axis)
                _write_back(st, data, comm)
            st.active -= 1
            if not st.gathered:
                release(p, p._zs.meter)


def _write_back(st: ShardState, full: torch.Tensor, comm: Comm) -> None:
    pn, rank = st.piece.numel(), st.rank
    flat = torch.zeros(pn * st.world, dtype=torch.float32, device=full.device)
    flat[: st.numel].copy_(full.reshape(-1))
    mine = flat[rank * pn : (rank + 1) * pn]
    st.write(mine)
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
