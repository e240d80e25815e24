"""A census of the tensor storage a rank holds, found by walking what is reachable, not by asking
the engine what it thinks it holds (that is ``engine.memory_breakdown()``, which sums the engine's
own buffers and so cannot see a buffer it forgot about).

    before = census.baseline()              # storage alive before the model exists
    ... build the engine, train ...
    c = census.take(engine, exclude=before)
    c.bytes    # {'params': ..., 'grads': ..., 'master': ..., 'optimizer': ..., 'other': ...}
    c.total    # every live byte the engine brought into being

Where tensors are found:

- every tensor the garbage collector tracks (``gc.get_objects()``, after a collection) that
  was made after the baseline: every such tensor with a Python object, wherever it is held;
- a walk from the engine, its module and its optimizer through ``vars()`` of objects, slots,
  dict keys and values, lists, tuples, sets, closures, bound methods and partials, and from each
  tensor its ``.grad``, ``._base`` and its own attributes (a stage-3 shard record hangs on its
  parameter). The walk is what labels storage (below); gc finds what the walk cannot reach.

Tensors held only by C++ (the autograd graph's saved tensors, a collective in flight) are not
seen; at the points the tests measure, no graph is alive and no collective is pending unless
said. Storage is counted once, by ``untyped_storage().data_ptr()``, at its full ``nbytes()``: a
view of a flat buffer brings in the whole buffer. Storage alive at ``baseline()`` is left out
(the baseline keeps it alive, so its address cannot be reused meanwhile).

Labels: each tensor met on the walk gets a role:

- ``param``: a parameter of the module, and whatever is reached through a parameter's own
  attributes (its shard record, e.g. stage 3's piece);
- ``opt_param``: a tensor in ``optimizer.param_groups`` (what the optimizer steps on);
- ``optimizer``: a tensor in ``optimizer.state``;
- ``grad``: a tensor's ``.grad``, or any tensor reached through an attribute or dict key whose
  name contains "grad" (gradient buffers kept between backward and step: ``grad_shard``,
  ``grads_flat``); a parameter or an optimizer tensor keeps its own role wherever it is met;
- ``other``: anything else (found from the engine or by gc).

Roles pass down only through plain data (containers and dataclass records): a parameter's
shard record is part of it; the communicator or the hook hung on it (bound to the engine) is not.

A storage with several roles takes the first of ``optimizer > grad > opt_param > param > other``.
``opt_param`` counts as ``master`` when its dtype differs from the module parameters' (mixed
precision: the fp32 master beside 16-bit parameters) and as ``params`` when it is the same (fp32
training: the optimizer steps on the parameters themselves, there is no separate master).
Precedence matters only where one storage is met along several roles: an fp32 optimizer tensor
that is a view of the parameter buffer, and buffers reachable both from the engine and from a
parameter or optimizer.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import time
import types
from collections import deque

import torch
from torch import nn

CATEGORIES = ("params", "grads", "master", "optimizer", "other")
_PRECEDENCE = ("optimizer", "grad", "opt_param", "param", "other")
_ATOMS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, range)
_MAX_OBJECTS = 500_000


@dataclasses.dataclass
class Storage:
    nbytes: int
    dtype: torch.dtype  # of the first tensor met on it (of an optimizer tensor, if one is)
    roles: set[str]
    path: str  # how the walk first reached it ("gc..." when only gc found it)
    category: str = "other"
    device: str = "cpu"  # the device type of the first tensor met on it (cuda under vcuda)


@dataclasses.dataclass
class Census:
    storages: dict[int, Storage]

    @property
    def bytes(self) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for s in self.storages.values():
            out[s.category] += s.nbytes
        return out

    def on(self, device: str) -> dict[str, int]:
        """:attr:`bytes` of the storages on ``device`` ("cuda", "cpu") alone."""
        out = dict.fromkeys(CATEGORIES, 0)
        for s in self.storages.values():
            if s.device == device:
                out[s.category] += s.nbytes
        return out

    @property
    def total(self) -> int:
        return sum(s.nbytes for s in self.storages.values())

    def describe(self, limit: int = 12) -> str:
        """The largest storages, for a failing assertion's message."""
        rows = sorted(self.storages.values(), key=lambda s: -s.nbytes)[:limit]
        return "\n".join(
            f"  {s.nbytes:>9} B {s.category:<9} {str(s.dtype):<15} {sorted(s.roles)} {s.path}"
            for s in rows
        )


class Baseline:
    """Storage alive before the model exists (kept alive so its addresses are not reused).

    It also freezes every object alive now (``gc.freeze()``), so that the collections and the
    scans of ``gc.get_objects()`` a census makes skip the few hundred thousand objects of an
    imported torch: seconds per census. ``release()`` (or the next baseline) unfreezes them.
    """

    def __init__(self) -> None:
        gc.unfreeze()
        gc.collect()
        self._tensors = _gc_tensors()
        self.ptrs = {k for t in self._tensors if (k := _storage(t)[0])}
        gc.freeze()

    def release(self) -> None:
        gc.unfreeze()
        self._tensors.clear()


def baseline() -> Baseline:
    return Baseline()


def _is_record(obj) -> bool:
    return isinstance(obj, (dict, list, tuple, set, frozenset, deque)) or (
        dataclasses.is_dataclass(obj) and not isinstance(obj, type)
    )


def _gc_tensors() -> list[torch.Tensor]:
    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(data_ptr, nbytes) of the tensor's storage; (0, 0) for none (empty, meta, sparse)."""
    try:
        if t.is_meta or t.layout != torch.strided:
            return 0, 0
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return 0, 0


def _children(obj):
    """(edge name, child) pairs of a non-tensor object."""
    if isinstance(obj, dict):  # a subclass's own attributes are walked below
        for k, v in list(dict.items(obj)):
            yield "<key>", k
            yield str(k) if isinstance(k, str) else "[]", v
    elif isinstance(obj, (list, tuple, set, frozenset, deque)):
        for v in list(obj):
            yield "[]", v
    if isinstance(obj, types.MethodType):
        yield "__self__", obj.__self__
        yield "__func__", obj.__func__
        return
    if isinstance(obj, types.FunctionType):  # not __globals__: that is every module
        for cell in obj.__closure__ or ():
            try:
                yield obj.__name__, cell.cell_contents
            except ValueError:  # an empty cell
                pass
        yield "__defaults__", obj.__defaults__
        yield "__kwdefaults__", obj.__kwdefaults__
        return
    if isinstance(obj, functools.partial):
        yield "func", obj.func
        yield "args", obj.args
        yield "keywords", obj.keywords
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        yield from _children(d)
    for cls in type(obj).__mro__:
        for name in cls.__dict__.get("__slots__", ()):
            if name not in ("__dict__", "__weakref__"):
                try:
                    yield name, getattr(obj, name)
                except AttributeError:
                    pass


def take(
    engine,
    *,
    exclude: Baseline | None = None,
    module: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    settle: float = 2.0,
) -> Census:
    """Census of the storage alive now, labelled by what refers to it (see the module doc).

    A tensor a collective has finished with can outlive ``wait()`` by a moment: gloo's worker
    thread lets go of the finished work only after ``wait()`` has returned, and torch keeps a
    tensor's Python object alive while C++ holds the tensor. Such a tensor has no Python
    referrer, so only gc finds it; while gc finds storage the walk cannot reach, the census is
    taken again, for up to ``settle`` seconds. A real leak stays and is counted.

    Storage only gc finds is always ``other`` with a path starting "gc", so a caller that sums
    by another category or by a path the walk gives passes ``settle=0``: waiting cannot change
    its sum (nothing in Python moves while the census runs), and mid-forward or mid-backward,
    where activations are only found by gc, every census would wait the whole ``settle``.
    """
    module = module if module is not None else engine.module
    optimizer = optimizer if optimizer is not None else engine.optimizer
    skip = exclude.ptrs if exclude is not None else set()
    deadline = time.monotonic() + settle
    while True:
        c = _take_once(engine, module, optimizer, skip)
        if time.monotonic() > deadline or not any(
            s.path.startswith("gc") for s in c.storages.values()
        ):
            return c
        time.sleep(0.01)


def _take_once(engine, module, optimizer, skip: set[int]) -> Census:
    gc.collect()
    params = {id(p): p for p in module.parameters()}
    opt_params = {id(p): p for g in optimizer.param_groups for p in g["params"]}
    param_dtypes = {p.dtype for p in params.values()}

    found: dict[int, Storage] = {}
    alive: list = []  # every object walked stays alive, so no id() is reused meanwhile
    seen: set[tuple[int, str]] = set()
    # Last pushed is walked first: gc's tensors last, so the paths shown are the walk's.
    stack: list[tuple[object, str, str]] = [(t, "other", "gc") for t in _gc_tensors()]
    stack += [(optimizer.state, "optimizer", "optimizer.state")]
    stack += [(p, "opt_param", "optimizer.param") for p in opt_params.values()]
    stack += [(p, "param", f"module.param[{i}]") for i, p in enumerate(params.values())]
    stack.append((engine, "other", "engine"))

    while stack:
        obj, role, path = stack.pop()
        if isinstance(obj, _ATOMS) or isinstance(obj, (type, types.ModuleType)):
            continue
        if isinstance(obj, torch.Tensor):  # known tensors keep their own role wherever met
            if id(obj) in opt_params:
                role = "opt_param"
            elif id(obj) in params:
                role = "param"
        elif not _is_record(obj):  # e.g. a hook's bound object is not part of its tensor
            role = "other"
        if (id(obj), role) in seen:
            continue
        seen.add((id(obj), role))
        alive.append(obj)
        if len(alive) > _MAX_OBJECTS:
            raise RuntimeError(f"census: walked over {_MAX_OBJECTS} objects; is it looping?")
        if isinstance(obj, torch.Tensor):
            ptr, nbytes = _storage(obj)
            if ptr and ptr not in skip:
                s = found.setdefault(
                    ptr, Storage(nbytes, obj.dtype, set(), path, device=obj.device.type)
                )
                s.roles.add(role)
                if role == "opt_param":
                    s.dtype = obj.dtype
            grad = obj.grad if obj.is_leaf else None  # .grad of a non-leaf only warns
            if grad is not None:
                stack.append((grad, "grad", f"{path}.grad"))
            if obj._base is not None:
                stack.append((obj._base, role, f"{path}._base"))
            children = _children(vars(obj))
        else:
            children = _children(obj)
        for name, child in children:
            if child is None or isinstance(child, _ATOMS):
                continue
            sub = "grad" if "grad" in name.lower() and role != "optimizer" else role
            stack.append((child, sub, f"{path}.{name}" if name != "[]" else f"{path}[]"))

    for s in found.values():
        top = next(r for r in _PRECEDENCE if r in s.roles)
        if top == "opt_param":
            s.category = "params" if s.dtype in param_dtypes else "master"
        else:
            s.category = {"optimizer": "optimizer", "grad": "grads", "param": "params"}.get(
                top, "other"
            )
    return Census(found)


def held_at_grad_hooks(engine, before: Baseline, train, steps: int, path_has) -> list[int]:
    """Bytes of storage whose path holds ``path_has`` (a string, or a test of the path), by a
    census at every third gradient hook (a census is slow) of the last of ``steps`` calls of
    ``train(step)``; each hook runs after the engine's own (the parameter is staged, its bucket
    maybe launched)."""
    wanted = path_has if callable(path_has) else (lambda path: path_has in path)
    seen: list[int] = []
    probing, calls = [False], [0]

    def probe(p):
        calls[0] += 1
        if probing[0] and calls[0] % 3 == 0:
            c = take(engine, exclude=before, settle=0)
            seen.append(sum(s.nbytes for s in c.storages.values() if wanted(s.path)))

    for p in engine.module.parameters():
        p.register_post_accumulate_grad_hook(probe)
    for step in range(steps):
        probing[0] = step == steps - 1
        train(step)
    return seen
