"""Virtual CUDA: run zerostack's CUDA + NCCL path on a machine without a GPU, and fail where a
real GPU would.

    with virtual_cuda():                 # in each rank, before initialize
        engine, *_ = zerostack.initialize(...)
        ...                              # engine.device is cuda:0

Tensors stay in host memory and gloo moves them, but each one carries a device tag, "cuda" or
"cpu", that follows it the way a device does:

- a factory or ``.to`` / ``.cuda()`` / ``.cpu()`` with a device makes a tensor of that device;
  every other op's outputs take its inputs' device. ``.device``, ``.is_cuda`` and
  ``.get_device()`` report the tag, so code that reads devices sees cuda:0.
- What CUDA refuses is refused: an op mixing cuda tensors with cpu tensors that are not 0-dim
  (CUDA takes those as scalars), an in-place op whose cpu destination gets a cuda operand,
  ``.numpy()`` of a cuda tensor, a gradient on another device than its parameter.
- What NCCL refuses is refused: every tensor handed to a torch.distributed collective or
  point-to-point op must be a contiguous cuda tensor (the check wraps torch.distributed itself,
  so code that bypasses zerostack's Comm is checked too).
- ``Topology.device`` is cuda:0; ``torch.cuda.is_available()`` stays False (nothing is pinned),
  and the few ``torch.cuda`` calls that only wait (``synchronize``, ``current_device``) answer as
  a device with nothing in flight. The allocator's figures (``memory_allocated``,
  ``max_memory_allocated``) count the bytes of the storages tagged cuda, alive and at their
  peak: the CUDA allocator's own count, less its cache and rounding.

Tags live per storage (views share them) and go with it; a storage made outside the context,
or by torch's C++ code without an op (``torch.tensor``'s constant), is cpu. The rules
are CUDA's common ones, not every op's special case: indexing with cpu indices is allowed, as
CUDA allows it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import traceback
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CUDA = torch.device("cuda", 0)
_MISSING = object()
# storage (its StorageImpl address) -> "cuda", or "any": made by torch's C++ code inside an op
# (SDPA's causal mask) from the host tensors' options, where a GPU would have used the device's;
# it goes with either device. Absent: cpu.
_TAGS: dict[int, str] = {}
CPU, GPU, ANY = "cpu", "cuda", "any"


class DeviceError(RuntimeError):
    """What CUDA or NCCL would have refused."""


def _key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # no storage (sparse, ...)
        return None


def _state(t: torch.Tensor) -> str:
    key = _key(t)
    return _TAGS.get(key, CPU) if key is not None else CPU


def is_cuda(t: torch.Tensor) -> bool:
    return _state(t) == GPU


_TRACE: dict[int, str] | None = {} if os.environ.get("VCUDA_TRACE") else None


def _tag(t: torch.Tensor, state: str | bool, op=None) -> None:
    if isinstance(state, bool):
        state = GPU if state else CPU
    key = _key(t)
    if key is None:
        return
    if _TRACE is not None and state == CPU and _TAGS.get(key) == GPU:
        _TRACE[key] = f"{op}\n" + "".join(traceback.format_stack(limit=12))
    if state == CPU:
        _TAGS.pop(key, None)
        return
    if key not in _TAGS:  # untagged when the storage goes: its address will be reused
        storage = t.untyped_storage()
        nbytes = storage.nbytes() if state == GPU else 0
        weakref.finalize(storage, _forget, key, nbytes)
        MEMORY.allocate(nbytes)
    _TAGS[key] = state


class _Memory:
    """The device bytes alive, as the CUDA allocator counts them (without its cache): every
    storage tagged cuda from its making to its end; ``peak`` is ``max_memory_allocated``."""

    def __init__(self) -> None:
        self.allocated = self.peak = 0

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def reset_peak(self) -> None:
        self.peak = self.allocated


MEMORY = _Memory()


def _forget(key: int, nbytes: int) -> None:
    _TAGS.pop(key, None)
    MEMORY.allocated -= nbytes


def _where(t: torch.Tensor) -> str:
    where = f"{'cuda:0' if is_cuda(t) else 'cpu'} {tuple(t.shape)} {t.dtype}"
    if _TRACE is not None and _key(t) in _TRACE:  # VCUDA_TRACE=1: where a cuda tag was lost
        where += "\n(tagged cpu at)\n" + _TRACE[_key(t)]
    return where


_aten = torch.ops.aten
_CPU_INDICES_OK = {
    _aten.index.Tensor,
    _aten.index_put.default,
    _aten.index_put_.default,
    _aten._index_put_impl_.default,
}
_COPIES = {_aten.copy_.default, _aten._copy_from.default, _aten._copy_from_and_resize.default}
_IN_FACTORY = threading.local()  # inside a Python factory call (its device is the caller's)
_CUDA_RNG = torch.Generator()  # the device's generator


def _on_device_generator(func, args, kwargs):
    """A random op on cuda tensors draws from the device's generator (the host's is swapped
    for it around the op), as on a GPU."""
    host = torch.random.get_rng_state()
    torch.random.set_rng_state(_CUDA_RNG.get_state())
    try:
        return func(*args, **kwargs)
    finally:
        _CUDA_RNG.set_state(torch.random.get_rng_state())
        torch.random.set_rng_state(host)


class _Dispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        target = None
        if kwargs.get("device") is not None:
            if torch.device(kwargs["device"]).type == "cuda":
                target, kwargs["device"] = GPU, torch.device("cpu")
            elif not getattr(_IN_FACTORY, "on", False):
                # torch's C++ code names the host, the real device, where the GPU would name
                # its own: autograd's formulas (a cuda input: cuda), an op's scratch (any)
                ins = [_state(t) for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
                target = GPU if GPU in ins else (CPU if ins else ANY)
        if target is None:
            target = self._check(func, args, kwargs)
        if target == GPU and torch.Tag.nondeterministic_seeded in func.tags:
            out = _on_device_generator(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if func in _COPIES:  # the destination keeps its device
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                _tag(t, target, func)
        return out

    @staticmethod
    def _check(func, args, kwargs) -> str:
        """The device of the op's outputs; raise what CUDA would."""
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        states = [_state(t) for t in tensors]
        if func in _COPIES or not tensors:
            return states[0] if tensors else CPU
        if GPU not in states:
            return ANY if states and all(s == ANY for s in states) else CPU
        cuda = tensors[states.index(GPU)]
        schema = func._schema
        mutated = [
            a for a, s in zip(args, schema.arguments, strict=False)
            if s.alias_info is not None and s.alias_info.is_write and isinstance(a, torch.Tensor)
        ]  # fmt: skip
        for t in mutated:
            if _state(t) == CPU:
                raise DeviceError(
                    f"{func}: writes into a cpu tensor ({_where(t)}) from a cuda:0 one "
                    f"({_where(cuda)}): expected all tensors on the same device"
                )
        if func in _CPU_INDICES_OK:
            return GPU
        # a host 0-dim tensor passes as a scalar, except in a tensor list (foreach and fused
        # kernels: the optimizer's ``step`` tensors must be on the device with the params)
        listed = {
            id(t)
            for a in (*args, *kwargs.values())
            if isinstance(a, list | tuple)
            for t in a
            if isinstance(t, torch.Tensor)
        }
        for t, state in zip(tensors, states, strict=True):
            if state == CPU and (t.dim() > 0 or id(t) in listed):
                raise DeviceError(
                    f"{func}: expected all tensors on the same device, got cuda:0 "
                    f"({_where(cuda)}) and cpu ({_where(t)})"
                )
        return GPU


_BASE = torch._C.TensorBase
_ORIG = {name: getattr(torch.Tensor, name) for name in ("to", "cuda", "cpu", "numpy")}


_REAL = threading.local()  # inside torch.distributed: the real devices, for its own dispatch


def _seen_cuda(t) -> bool:
    """What ``t.device`` says: its tag, except inside torch.distributed."""
    return is_cuda(t) and not getattr(_REAL, "on", False)


def _device(self):
    return CUDA if _seen_cuda(self) else _BASE.device.__get__(self)


def _get_device(self):
    return 0 if _seen_cuda(self) else -1


def _numpy(self, *args, **kwargs):
    if is_cuda(self):
        raise DeviceError(
            f"can't convert cuda:0 device type tensor to numpy ({_where(self)}); "
            "use Tensor.cpu() to copy the tensor to host memory first"
        )
    return _ORIG["numpy"](self, *args, **kwargs)


def _set_grad(self, g):
    if g is not None and is_cuda(self) != is_cuda(g):
        raise DeviceError(f"assigned grad has data on {_where(g)}, the parameter on {_where(self)}")
    _BASE.grad.__set__(self, g)


def _to(self, *args, **kwargs):
    rest = {k: v for k, v in kwargs.items() if k != "copy"}
    copy = kwargs.get("copy", False)
    if args and isinstance(args[0], torch.Tensor):  # .to(other): its device and dtype
        return _move(self, is_cuda(args[0]), args[0].dtype, copy=copy)
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **rest)
    if device is None:
        return _ORIG["to"](self, *args, **kwargs)
    return _move(self, device.type == "cuda", dtype, non_blocking, copy)


def _cuda(self, device=None, non_blocking=False, **kwargs):
    return _move(self, True, non_blocking=non_blocking)


def _cpu(self, *args, **kwargs):
    return _move(self, False)


def _move(t, cuda: bool, dtype=None, non_blocking=False, copy=False):
    """``t`` on the (tagged) device: itself when it is already there in that dtype."""
    if is_cuda(t) == cuda and (dtype is None or dtype == t.dtype) and not copy:
        return t
    out = _ORIG["to"](t, dtype=dtype or t.dtype, copy=True)
    _tag(out, cuda)
    return out


def _factory(fn):
    """A factory given a device: made in host memory (the CPU build has no CUDA to initialise),
    tagged with the device asked for."""

    @functools.wraps(fn)
    def make(*args, **kwargs):
        device = kwargs.get("device")
        was, _IN_FACTORY.on = getattr(_IN_FACTORY, "on", False), True
        try:  # no device: torch's default, the host
            out = fn(*args, **dict(kwargs, device="cpu") if device is not None else kwargs)
        finally:
            _IN_FACTORY.on = was
        if device is None:
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                _tag(t, torch.device(device).type == "cuda")
        return out

    return make


_FACTORIES = (
    "zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "randn", "rand",
    "randint", "randperm", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
    "randn_like", "empty_strided", "linspace", "eye", "scalar_tensor",
)  # fmt: skip
_NEW = ("new_zeros", "new_ones", "new_empty", "new_full", "new_tensor")


# ---------------------------------------------------------------------- torch.distributed
_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "send",
    "recv",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "batch_isend_irecv",
)
# isend / irecv stay torch's own (P2POp accepts nothing else); batch_isend_irecv checks them
_OBJECTS = ("all_gather_object", "broadcast_object_list", "gather_object", "barrier")


def _handed(obj):
    """The tensors in a collective's arguments (P2POps' included)."""
    for leaf in tree_leaves(obj):
        if isinstance(leaf, torch.Tensor):
            yield leaf
        elif isinstance(leaf, dist.P2POp):
            yield leaf.tensor
        elif isinstance(leaf, list | tuple):
            yield from _handed(list(leaf))


def _nccl(name: str, fn):
    @functools.wraps(fn)
    def checked(*args, **kwargs):
        for t in _handed((list(args), kwargs)):
            if not is_cuda(t):
                raise DeviceError(f"dist.{name}: NCCL got a cpu tensor ({_where(t)})")
            if not t.is_contiguous():
                raise DeviceError(f"dist.{name}: NCCL got a non-contiguous tensor {_where(t)}")
        return _really(fn, *args, **kwargs)

    return checked


def _really(fn, *args, **kwargs):
    was, _REAL.on = getattr(_REAL, "on", False), True
    try:
        return fn(*args, **kwargs)
    finally:
        _REAL.on = was


def _plain(fn):
    @functools.wraps(fn)
    def unchecked(*args, **kwargs):
        return _really(fn, *args, **kwargs)

    return unchecked


class _FakeEvent:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, *args) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0

    def wait(self, *args) -> None:
        pass


@contextlib.contextmanager
def virtual_cuda():
    """The tagged-device run described in the module docstring (for one process)."""
    from zerostack import topology
    from zerostack.comm import grid

    patches = [(dist, name, _nccl(name, getattr(dist, name))) for name in _COLLECTIVES]
    patches += [(dist, name, _plain(getattr(dist, name))) for name in _OBJECTS]
    patches += [
        (grid, "_all_gather", _nccl("all_gather_into_tensor", grid._all_gather)),
        (grid, "_reduce_scatter", _nccl("reduce_scatter_tensor", grid._reduce_scatter)),
        (topology.Topology, "device", property(lambda self: CUDA)),
        (torch.Tensor, "device", property(_device)),
        (torch.Tensor, "is_cuda", property(_seen_cuda)),
        (torch.Tensor, "is_cpu", property(lambda self: not _seen_cuda(self))),
        (torch.Tensor, "get_device", _get_device),
        (torch.Tensor, "numpy", _numpy),
        (torch.Tensor, "grad", property(_BASE.grad.__get__, _set_grad)),
        (torch.Tensor, "to", _to),
        (torch.Tensor, "cuda", _cuda),
        (torch.Tensor, "cpu", _cpu),
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "Event", _FakeEvent),
        (torch.cuda, "memory_allocated", lambda *a, **k: MEMORY.allocated),
        (torch.cuda, "max_memory_allocated", lambda *a, **k: MEMORY.peak),
        (torch.cuda, "memory_reserved", lambda *a, **k: MEMORY.peak),
        (torch.cuda, "reset_peak_memory_stats", lambda *a, **k: MEMORY.reset_peak()),
        # the device's generator: random ops on cuda tensors draw from it
        (torch.cuda, "device_count", lambda: 1),
        (torch.cuda, "get_rng_state", lambda device="cuda": _CUDA_RNG.get_state()),
        (torch.cuda, "set_rng_state", lambda state, device="cuda": _CUDA_RNG.set_state(state)),
        (torch.cuda, "get_rng_state_all", lambda: [_CUDA_RNG.get_state()]),
        (torch.cuda, "set_rng_state_all", lambda states: _CUDA_RNG.set_state(states[0])),
        (torch.cuda, "manual_seed", lambda seed: _CUDA_RNG.manual_seed(seed)),
        (torch.cuda, "manual_seed_all", lambda seed: _CUDA_RNG.manual_seed(seed)),
    ]
    patches += [(torch, name, _factory(getattr(torch, name))) for name in _FACTORIES]
    patches += [(torch.Tensor, name, _factory(getattr(torch.Tensor, name))) for name in _NEW]
    saved = [(obj, name, obj.__dict__.get(name, _MISSING)) for obj, name, _ in patches]
    for obj, name, new in patches:
        setattr(obj, name, new)
    try:
        with _Dispatch():
            yield
    finally:
        for obj, name, old in saved:
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        _TAGS.clear()
        MEMORY.allocated = MEMORY.peak = 0
