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
- ``comm.gloo`` takes its NCCL branch (torch's reduce-scatter and all-gather) at every world
  size, never its gloo fast paths.
- What NCCL refuses is refused: every tensor handed to a torch.distributed collective or
  point-to-point op must be a contiguous cuda tensor (the check wraps torch.distributed itself,
  so code that bypasses zerostack's Comm is checked too). One that starts off a 16-byte
  boundary is recorded in ``UNALIGNED`` (NCCL takes it, on slower paths), and so is an
  all-gather or reduce-scatter whose ranks' chunks are not whole 16-byte blocks.
- What makes the host wait for the GPU is recorded in ``HOST_WAITS``, in order: ``("stream",
  what)`` for a wait on all the work queued so far (``.item()``, ``float()``, ``bool()`` of a cuda
  tensor, a blocking copy either way, ``torch.cuda.synchronize``), ``("event", "")`` for
  ``Event.synchronize``, which waits only for the work queued before the event's ``record``.
- Streams are modelled with vector clocks (as torch's CUDA sanitizer does): each device op runs
  on the current stream (``torch.cuda.stream(s)``), ``wait_stream`` / events / host waits order
  streams, each collective runs on its process group's NCCL stream, which waits for the current
  stream at launch and is waited for by ``work.wait()``; an event's ``query()`` is True once a
  host wait covers it (as late as a GPU could answer), never merely because ``wait()`` returned.
  An op that
  touches a storage another stream wrote (or reads, for a write) without being ordered after it
  is refused, and so is a storage freed on its stream while another stream's use of it is
  unordered and not announced with ``record_stream`` (the caching allocator would hand its
  memory out again).
- Page-locked memory is modelled: ``zerostack.core.pinned.can_pin()`` is True, and
  ``pin_memory=True`` or ``.pin_memory()`` marks a host storage pinned (``is_pinned()``); a
  ``.to("cpu", non_blocking=True)`` from the device lands in pinned memory, as torch makes it.
- A ``non_blocking`` copy between the device and pinned host memory is in flight until such a
  wait covers it: a host op that writes the host buffer a copy to the device still reads, or
  touches the one a copy from the device still fills, is refused, as the race it would be on a
  GPU. From or into pageable memory CUDA waits for the stream first: a host wait, ``("stream",
  "pageable ...")``, whatever ``non_blocking`` says.
- ``UntypedStorage.resize_`` of a cuda storage gives its bytes back to the allocator's count (or
  takes them): FSDP2 and ``offload_states`` free device memory this way, their tensors kept.
- ``Topology.device`` is cuda:0; ``torch.cuda.is_available()`` stays False,
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
HOST_WAITS: list[tuple[str, str]] = []  # what the host waited for the device on, in order
# non-blocking copies in flight: host storage -> (READ by a copy to the device, or WRITTEN by
# one from it; the copy's serial number, which an event's record covers)
_IN_FLIGHT: dict[int, tuple[str, int]] = {}
READ, WRITTEN = "read", "written"
_PINNED: set[int] = set()  # host storages that are page-locked
_SERIAL = [0]
CPU, GPU, ANY = "cpu", "cuda", "any"


class DeviceError(RuntimeError):
    """What CUDA or NCCL would have refused."""


def _key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # no storage (sparse, ...)
        return None


def _pin(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t``'s host storage page-locked (until it is freed)."""
    key = _key(t)
    if key is not None and key not in _PINNED:
        _PINNED.add(key)
        weakref.finalize(t.untyped_storage(), _PINNED.discard, key)
    return t


def pinned(t: torch.Tensor) -> bool:
    return _key(t) in _PINNED


def _pin_memory(self, *args, **kwargs) -> torch.Tensor:
    if is_cuda(self):
        raise DeviceError("pin_memory(): only host tensors can be pinned, got a cuda tensor")
    return _pin(self.clone())


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
        weakref.finalize(storage, _forget, key)
        _SIZES[key] = nbytes
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


_SIZES: dict[int, int] = {}  # the device bytes each tagged storage counts in MEMORY


def _forget(key: int) -> None:
    _TAGS.pop(key, None)
    _freed(key)
    MEMORY.allocated -= _SIZES.pop(key, 0)


def _resize(self, nbytes: int):
    """``UntypedStorage.resize_``: a device storage's bytes go back to the allocator, or come
    from it (FSDP2 and ``offload_states`` free storage this way, their tensors kept)."""
    key = self._cdata
    out = _STORAGE_RESIZE(self, nbytes)
    if _TAGS.get(key) == GPU:
        MEMORY.allocate(nbytes - _SIZES.get(key, 0))
        _SIZES[key] = nbytes
    return out


_STORAGE_RESIZE = torch.UntypedStorage.resize_


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


# ---------------------------------------------------------------------- streams
_STREAMS: dict[int, _VStream] = {}
_HOST: dict[int, int] = {}  # what the host has waited for: every op launched later comes after
_ACCESS: dict[int, dict] = {}  # cuda storage -> its stream accesses (see _touch)
STREAM_ERRORS: list[str] = []  # races found when a storage is freed (raised at the next op)
UNALIGNED: list[str] = []  # collectives handed a tensor that starts off a 16-byte boundary


def _merge(into: dict[int, int], other: dict[int, int]) -> None:
    for sid, n in other.items():
        if into.get(sid, 0) < n:
            into[sid] = n


class _VStream:
    """A virtual CUDA stream: ``clock`` maps each stream id to how many of its ops this stream's
    next op comes after (its own entry: its own ops so far)."""

    def __init__(self, *args, **kwargs) -> None:
        self.id = len(_STREAMS) + 1
        self.clock = {self.id: 0}
        _STREAMS[self.id] = self

    def wait_stream(self, other: _VStream) -> None:
        _merge(self.clock, other.clock)

    def wait_event(self, event) -> None:
        _merge(self.clock, event.clock)

    def record_event(self, event=None):
        event = event if event is not None else _FakeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        _stream_wait("stream.synchronize", self)

    def query(self) -> bool:
        return True

    def tick(self) -> tuple[int, int]:
        """One op launched on this stream: its (stream, count) stamp."""
        _merge(self.clock, _HOST)
        self.clock[self.id] += 1
        return self.id, self.clock[self.id]

    def knows(self, stamp: tuple[int, int]) -> bool:
        sid, n = stamp
        return sid == self.id or self.clock.get(sid, 0) >= n or _HOST.get(sid, 0) >= n


_DEFAULT = _VStream()
_CURRENT = threading.local()
_NCCL: dict[int, _VStream] = {}  # process group -> its NCCL stream


def _current() -> _VStream:
    return getattr(_CURRENT, "stream", None) or _DEFAULT


@contextlib.contextmanager
def _stream_context(stream):
    was = getattr(_CURRENT, "stream", None)
    _CURRENT.stream = stream if stream is not None else was
    try:
        yield
    finally:
        _CURRENT.stream = was


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor can touch: ``[lo, hi)`` (a strided view: its extent)."""
    size = t.element_size()
    lo = t.storage_offset() * size
    if t.numel() == 0:
        return lo, lo
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return lo, lo + (last + 1) * size


def _touch(t: torch.Tensor, stream: _VStream, stamp, write: bool, op) -> None:
    """Record ``stream``'s access to ``t``'s bytes of its storage; refuse it when unordered with
    another stream's earlier write (or, for a write, read) of bytes it overlaps. Views of
    disjoint parts of one buffer (the buckets of a flat gradient buffer) do not race."""
    key = _key(t)
    if key is None or _state(t) != GPU:
        return
    info = _ACCESS.setdefault(key, {"alloc": stream.id, "spans": {}, "reads": {}, "rec": set()})
    lo, hi = _span(t)
    if lo == hi:
        return  # no bytes
    for (a, b), seen in info["spans"].items():
        if b <= lo or hi <= a:
            continue  # disjoint bytes
        w = seen["write"]
        if w is not None and not stream.knows(w):
            raise DeviceError(
                f"{op}: stream {stream.id} uses {_where(t)}, written on stream {w[0]} (by "
                f"{seen['by']}) without a wait between them (wait_stream / an event)"
            )
        if write:
            for sid, n in seen["reads"].items():
                if not stream.knows((sid, n)):
                    raise DeviceError(
                        f"{op}: stream {stream.id} writes {_where(t)}, which stream {sid} may "
                        "still be reading (wait_stream / an event)"
                    )
    mine = info["spans"].setdefault((lo, hi), {"write": None, "by": None, "reads": {}})
    if write:
        mine["write"], mine["by"] = stamp, op
    for reads in (mine["reads"], info["reads"]):  # the storage's, for the check at its free
        reads[stream.id] = max(reads.get(stream.id, 0), stamp[1])


def _on_stream(func, args, kwargs, out, stream: _VStream | None = None) -> None:
    """A device op: it runs on the current stream, reading its cuda operands and writing its
    outputs and the operands it mutates."""
    returns = func._schema.returns
    if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
        return  # a view (slice, view, expand...): metadata only, no kernel reads its bytes
    stream = stream or _current()
    stamp = stream.tick()
    mutated = {
        id(a)
        for a, arg in zip(args, func._schema.arguments, strict=False)
        if arg.alias_info is not None and arg.alias_info.is_write and isinstance(a, torch.Tensor)
    }
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor):
            _touch(t, stream, stamp, id(t) in mutated, func)
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and _key(t) not in _ACCESS:  # a new storage
            _touch(t, stream, stamp, True, func)


def _made(t: torch.Tensor, op) -> None:
    """A cuda storage made outside an op's dispatch (a factory, a copy to the device): written
    on the current stream, its home."""
    if is_cuda(t):
        stream = _current()
        _touch(t, stream, stream.tick(), True, op)


def _freed(key: int) -> None:
    """A cuda storage goes back to the allocator's pool of the stream it was made on: every
    other stream's use of it must be ordered before that stream's next op, or recorded."""
    info = _ACCESS.pop(key, None)
    if info is None:
        return
    home = _STREAMS[info["alloc"]]
    for sid, n in info["reads"].items():
        if sid != home.id and sid not in info["rec"] and not home.knows((sid, n)):
            STREAM_ERRORS.append(
                f"a cuda storage made on stream {home.id} was freed while stream {sid} may "
                "still use it (Tensor.record_stream, or a wait, first)"
            )


def _record_stream(self, stream) -> None:
    key = _key(self)
    if key in _ACCESS:
        _ACCESS[key]["rec"].add(stream.id)


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
        if not getattr(_REAL, "on", False):  # torch.distributed's own ops: the transport's
            if _IN_FLIGHT:
                _check_host_op(func, args, kwargs)
            _note_wait(func, args, kwargs)
        if target == GPU and torch.Tag.nondeterministic_seeded in func.tags:
            out = _on_device_generator(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if STREAM_ERRORS:
            raise DeviceError(STREAM_ERRORS.pop(0))
        if func not in _COPIES:  # a copy's destination keeps its device
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    _tag(t, target, func)
        if not getattr(_REAL, "on", False) and any(
            is_cuda(t) for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)
        ):
            _on_stream(func, args, kwargs, out)
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


# ops whose host result is read from the device's memory: the host waits for the stream
_READS = {_aten._local_scalar_dense.default, _aten.is_nonzero.default, _aten.equal.default}
_READS |= {_aten.nonzero.default}  # its output's size


def _in_flight(host: torch.Tensor, how: str) -> None:
    """A non-blocking copy reads (READ) or fills (WRITTEN) the host tensor ``host``."""
    key = _key(host)
    if key is None:
        return
    if key not in _IN_FLIGHT:  # forgotten with its storage: the address will be reused
        weakref.finalize(host.untyped_storage(), _IN_FLIGHT.pop, key, None)
    _SERIAL[0] += 1
    was = _IN_FLIGHT.get(key, (READ, 0))[0]
    _IN_FLIGHT[key] = (WRITTEN if WRITTEN in (how, was) else READ, _SERIAL[0])


def _landed(upto: int | None = None) -> None:
    """The copies up to serial ``upto`` (every one: None) are done."""
    for key in [k for k, (_, n) in _IN_FLIGHT.items() if upto is None or n <= upto]:
        del _IN_FLIGHT[key]


def _stream_wait(what: str, stream=None) -> None:
    """The host waits for ``stream`` (the current one; every stream for "synchronize")."""
    HOST_WAITS.append(("stream", what))
    _landed()
    streams = _STREAMS.values() if what == "synchronize" else [stream or _current()]
    for s in streams:
        _merge(_HOST, s.clock)


def _check_host_op(func, args, kwargs) -> None:
    """Refuse a host op (no cuda tensor among its operands) on a host buffer a non-blocking
    copy still uses."""
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if any(is_cuda(t) for t in tensors):
        return  # the device's op: in stream order with the copies
    mutated_ids = {
        id(a)
        for a, s in zip(args, func._schema.arguments, strict=False)
        if s.alias_info is not None and s.alias_info.is_write and isinstance(a, torch.Tensor)
    }
    mutated_ids |= {id(v) for v in kwargs.values() if isinstance(v, torch.Tensor)}  # out=
    for t in tensors:
        key = _key(t)
        if key not in _IN_FLIGHT:
            continue
        how = _IN_FLIGHT[key][0]
        if how == WRITTEN:
            raise DeviceError(
                f"{func}: uses the host tensor {_where(t)} while a non-blocking copy from the "
                "device may still be filling it (wait for an event recorded after the copy)"
            )
        if id(t) in mutated_ids:
            raise DeviceError(
                f"{func}: writes the host tensor {_where(t)} while a non-blocking copy to the "
                "device may still be reading it (wait for an event recorded after the copy)"
            )


def _note_wait(func, args, kwargs) -> None:
    """Record the op in HOST_WAITS when it makes the host wait for every queued kernel; note a
    non-blocking copy's host buffer as in flight."""
    if func in _READS and any(is_cuda(t) for t in args if isinstance(t, torch.Tensor)):
        _stream_wait(str(func))
    elif func is _aten.copy_.default and is_cuda(args[0]) != is_cuda(args[1]):
        host = args[1] if is_cuda(args[0]) else args[0]
        way = "to" if is_cuda(args[0]) else "from"
        if not ((len(args) > 2 and args[2]) or kwargs.get("non_blocking", False)):
            _stream_wait(f"{func} {way} the device")
        elif not pinned(host):
            _stream_wait(f"pageable non_blocking {func} {way} the device")
        else:
            _in_flight(host, READ if is_cuda(args[0]) else WRITTEN)


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
    if _key(self) in _IN_FLIGHT:
        raise DeviceError(f".numpy() of {_where(self)} while a non-blocking copy uses it")
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
    if is_cuda(t) != cuda and not non_blocking:
        _stream_wait("to(cuda)" if cuda else "to(cpu)")
    elif cuda and not is_cuda(t) and not pinned(t):  # CUDA waits for the stream first
        _stream_wait("pageable non_blocking to(cuda)")
        non_blocking = False
    out = _ORIG["to"](t, dtype=dtype or t.dtype, copy=True)
    _tag(out, cuda)
    if non_blocking and is_cuda(t) and not cuda:  # torch lands it in pinned host memory
        _pin(out)
    if is_cuda(t) or cuda:  # the copy runs on the current stream
        stream = _current()
        stamp = stream.tick()
        _touch(t, stream, stamp, False, "to")
        _touch(out, stream, stamp, True, "to")
    if is_cuda(t) != cuda and non_blocking:
        _in_flight(out if not cuda else t, READ if cuda else WRITTEN)
    return out


def _factory(fn):
    """A factory given a device: made in host memory (the CPU build has no CUDA to initialise),
    tagged with the device asked for."""

    @functools.wraps(fn)
    def make(*args, **kwargs):
        pin = kwargs.pop("pin_memory", False)  # this build cannot pin: modelled by a mark
        device = kwargs.get("device")
        was, _IN_FACTORY.on = getattr(_IN_FACTORY, "on", False), True
        try:  # no device: torch's default, the host
            out = fn(*args, **dict(kwargs, device="cpu") if device is not None else kwargs)
        finally:
            _IN_FACTORY.on = was
        if pin:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    _pin(t)
        if device is None:
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                _tag(t, torch.device(device).type == "cuda")
                _made(t, fn.__name__)
        return out

    return make


_FACTORIES = (
    "zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "randn", "rand",
    "randint", "randperm", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
    "randn_like", "empty_strided", "linspace", "eye", "scalar_tensor",
)  # fmt: skip
_NEW = ("new_zeros", "new_ones", "new_empty", "new_full", "new_tensor")


# ---------------------------------------------------------------------- torch.distributed
_CHUNKED = ("all_gather_into_tensor", "reduce_scatter_tensor")
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


def _outputs(name: str, args, kwargs):
    """The tensors a torch.distributed call writes: a receive's, else its first argument's."""
    if name == "batch_isend_irecv":
        ops = args[0] if args else kwargs["p2p_op_list"]
        return [op.tensor for op in ops if getattr(op.op, "__name__", "") == "irecv"]
    if name == "send":
        return []
    first = args[0] if args else next(iter(kwargs.values()))
    return list(_handed([first]))


def _nccl(name: str, fn):
    @functools.wraps(fn)
    def checked(*args, **kwargs):
        for t in _handed((list(args), kwargs)):
            if not is_cuda(t):
                raise DeviceError(f"dist.{name}: NCCL got a cpu tensor ({_where(t)})")
            if not t.is_contiguous():
                raise DeviceError(f"dist.{name}: NCCL got a non-contiguous tensor {_where(t)}")
            if t.data_ptr() % 16:
                UNALIGNED.append(f"dist.{name}: {_where(t)} starts {t.data_ptr() % 16} bytes in")
        if name in _CHUNKED:  # rank r's chunk of the big tensor starts r chunks in
            out = args[0] if args else kwargs["output_tensor"]
            inp = args[1] if len(args) > 1 else kwargs["input_tensor"]
            chunk = (inp if name == "all_gather_into_tensor" else out).nbytes
            if chunk % 16:
                UNALIGNED.append(f"dist.{name}: rank chunks of {chunk} bytes")
        # the group's NCCL stream waits for the current one, then runs the collective
        nccl = _NCCL.setdefault(id(kwargs.get("group")), _VStream())
        nccl.wait_stream(_current())
        stamp = nccl.tick()
        written = {id(t) for t in _outputs(name, args, kwargs)}
        for t in _handed((list(args), kwargs)):
            _touch(t, nccl, stamp, id(t) in written, f"dist.{name}")
            _ACCESS[_key(t)]["rec"].add(nccl.id)  # ProcessGroupNCCL keeps them alive
        out = _really(fn, *args, **kwargs)
        done = dict(nccl.clock)
        if isinstance(out, list):
            return [_Work(w, done) if isinstance(w, _Work) else w for w in out]
        if isinstance(out, _Work):
            return _Work(out, done)
        _merge(_current().clock, done)  # a blocking call: the current stream waits for it
        return out

    return checked


def _really(fn, *args, **kwargs):
    was, _REAL.on = getattr(_REAL, "on", False), True
    try:
        out = fn(*args, **kwargs)
    finally:
        _REAL.on = was
    if isinstance(out, list):
        return [_Work(w) if isinstance(w, dist.Work) else w for w in out]
    return _Work(out) if isinstance(out, dist.Work) else out


class _Work:
    """An async collective's handle: its ``wait`` runs the transport's own ops (gloo copying a
    result into place), which on a GPU are NCCL's kernels on its stream, not host work; with
    the NCCL stream's clock at the collective (``done``), the wait orders the current stream
    after it."""

    def __init__(self, work, done: dict | None = None) -> None:
        self._work = work._work if isinstance(work, _Work) else work
        self._done = done or {}

    def wait(self, *args, **kwargs):
        _merge(_current().clock, self._done)
        return _really(self._work.wait, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _plain(fn):
    @functools.wraps(fn)
    def unchecked(*args, **kwargs):
        return _really(fn, *args, **kwargs)

    return unchecked


_GROUP = torch.optim.Optimizer._group_tensors_by_device_and_dtype


def _grouped(tensorlistlist, with_indices=False):
    """torch's optimizers group their tensors by device, as the host sees it: the groups of cuda
    tensors are keyed cuda:0, so what an optimizer moves "to the group's device" (fused Adam's
    ``found_inf``) goes where a GPU would put it."""
    out = {}
    for (device, dtype), value in _GROUP(tensorlistlist, with_indices).items():
        first = value[0][0][0] if value[0] and value[0][0] else None
        out[CUDA if first is not None and is_cuda(first) else device, dtype] = value
    return out


class _FakeEvent:
    def __init__(self, *args, **kwargs) -> None:
        pass

    serial = 0
    clock: dict = {}

    def record(self, stream=None) -> None:
        self.serial = _SERIAL[0]  # the copies queued so far
        self.clock = dict((stream or _current()).clock)

    def synchronize(self) -> None:
        HOST_WAITS.append(("event", ""))
        _landed(self.serial)
        _merge(_HOST, self.clock)

    def query(self) -> bool:
        if not all(_HOST.get(sid, 0) >= n for sid, n in self.clock.items()):
            return False
        _landed(self.serial)
        return True

    def elapsed_time(self, other) -> float:
        return 0.0

    def wait(self, stream=None) -> None:
        _merge((stream or _current()).clock, self.clock)


@contextlib.contextmanager
def virtual_cuda():
    """The tagged-device run described in the module docstring (for one process)."""
    from zerostack import topology
    from zerostack.comm import gloo
    from zerostack.core import pinned as zerostack_pinned

    patches = [(dist, name, _nccl(name, getattr(dist, name))) for name in _COLLECTIVES]
    patches += [(dist, name, _plain(getattr(dist, name))) for name in _OBJECTS]
    patches += [
        (gloo, "_all_gather", _nccl("all_gather_into_tensor", gloo._all_gather)),
        (gloo, "_reduce_scatter", _nccl("reduce_scatter_tensor", gloo._reduce_scatter)),
        # NCCL's branch at every size: torch's reduce-scatter and all-gather, whose outputs
        # NCCL writes on its stream (gloo's fast paths run in the plain CPU tests)
        (gloo, "_gloo", lambda group: False),
        (zerostack_pinned, "can_pin", lambda: True),
        (torch.UntypedStorage, "resize_", _resize),
        (torch.Tensor, "pin_memory", _pin_memory),
        (torch.Tensor, "is_pinned", lambda self, *a, **k: pinned(self)),
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
        (torch.optim.Optimizer, "_group_tensors_by_device_and_dtype", staticmethod(_grouped)),
        (torch.cuda, "synchronize", lambda *a, **k: _stream_wait("synchronize")),
        (torch.cuda, "Stream", _VStream),
        (torch.cuda, "stream", _stream_context),
        (torch.cuda, "current_stream", lambda device=None: _current()),
        (torch.cuda, "default_stream", lambda device=None: _DEFAULT),
        (torch.Tensor, "record_stream", _record_stream),
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
        HOST_WAITS.clear()
        _IN_FLIGHT.clear()
        _PINNED.clear()
        _ACCESS.clear()
        _HOST.clear()
        STREAM_ERRORS.clear()
        UNALIGNED.clear()
        _NCCL.clear()
        _CURRENT.stream = None
        MEMORY.allocated = MEMORY.peak = 0
        _SIZES.clear()
