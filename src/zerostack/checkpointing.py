"""Activation checkpointing with the interface of ``deepspeed.checkpointing``.

A checkpointed function keeps only its inputs in forward; backward recomputes the rest when it
first needs it::

    from zerostack import checkpointing

    checkpointing.configure(mpu_=topology, deepspeed_config=config)  # optional
    y = checkpointing.checkpoint(block, x)

How the inputs are kept follows the config's ``activation_checkpointing`` block:

* ``partition_activations``: each tp rank keeps 1/tp of every floating-point input (flattened,
  zero-padded) and the recomputation all-gathers it over tp. Valid because the input of a
  Megatron layer is the same on every tp rank (not so under sequence parallelism).
* ``cpu_checkpointing``: the kept inputs live in host memory (:func:`host_empty`, pinned under
  CUDA) and go back to their device (:func:`to_device`) for the recomputation.
* ``contiguous_memory_optimization`` with ``number_checkpoints``: the kept inputs of one forward
  are slices of one buffer instead of many allocations (DeepSpeed's fragmentation guard).
* ``synchronize_checkpoint_boundary``: ``torch.cuda.synchronize()`` around each checkpoint.
* ``profile``: forward and recomputation seconds in :func:`timers`.

The checkpoint is non-reentrant. The forward builds the ordinary autograd graph, but every tensor
autograd would save is replaced by a handle (a ``saved_tensors_hooks`` pack); the first unpack
recomputes the function and hands out the recomputed tensors. Gradients flow through the one
graph, so each parameter's gradient is accumulated once per backward and ZeRO's
post-accumulate-grad hooks fire once, as without checkpointing (DeepSpeed's reentrant checkpoint
runs a nested backward per segment instead). The recomputation replays torch's CPU and CUDA
generators, zerostack's tp RNG tracker and the autocast state of the forward, so dropout draws
the same masks.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .config import ActivationCheckpointingConfig, ConfigError, load_config
from .tensor_parallel import get_rng_tracker, model_parallel_seed
from .tensor_parallel.random import RNGStatesTracker
from .topology import Topology

__all__ = [
    "CheckpointingError",
    "Settings",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "host_empty",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "partition_size",
    "reset",
    "settings",
    "timers",
    "to_device",
    "unconfigure",
]


HOST = "host"  # where cpu_checkpointing keeps inputs: memory from host_empty
Where = torch.device | str  # a device, or HOST


class CheckpointingError(RuntimeError):
    """The recomputation did not redo the forward (a different number of saved tensors)."""


@dataclass(frozen=True)
class Settings:
    """What :func:`configure` set; the defaults are plain checkpointing."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    mpu: Topology | None = None

    @property
    def partitions(self) -> bool:
        """Whether inputs are really split: partitioning on and a tp size above 1."""
        return self.partition_activations and self.mpu is not None and self.mpu.tp > 1


class _Contiguous:
    """The kept inputs of ``checkpoints`` consecutive checkpoints as slices of one allocation per
    (dtype, device). A slice is never handed out twice, so results cannot change; a checkpoint
    that does not fit (other shapes) gets a fresh buffer."""

    def __init__(self, checkpoints: int) -> None:
        self.checkpoints = checkpoints
        self.reset()

    def reset(self) -> None:
        self.buffers: dict[tuple[torch.dtype, Where], tuple[torch.Tensor, int]] = {}
        self.calls = 0

    def take(self, sizes: list[tuple[int, torch.dtype, Where]]) -> list[torch.Tensor]:
        """One flat slice per ``(numel, dtype, device)`` of one checkpoint."""
        if self.calls == self.checkpoints:  # a forward's worth handed out: start the next one
            self.reset()
        self.calls += 1
        need: dict[tuple[torch.dtype, Where], int] = defaultdict(int)
        for n, dtype, device in sizes:
            need[dtype, device] += n
        for key, n in need.items():
            buf, used = self.buffers.get(key, (None, 0))
            if buf is None or used + n > buf.numel():
                total = n * (self.checkpoints - self.calls + 1)
                self.buffers[key] = (_empty(total, *key), 0)
        out = []
        for n, dtype, device in sizes:
            buf, used = self.buffers[dtype, device]
            out.append(buf[used : used + n])
            self.buffers[dtype, device] = (buf, used + n)
        return out


@dataclass
class _State:
    settings: Settings = field(default_factory=Settings)
    configured: bool = False
    contiguous: _Contiguous | None = None
    seconds: dict[str, float] = field(default_factory=lambda: {"forward": 0.0, "recompute": 0.0})
    calls: dict[str, int] = field(default_factory=lambda: {"forward": 0, "recompute": 0})


_STATE = _State()  # module-level because DeepSpeed's API is; everything lives in this one object


# ------------------------------------------------------------------------------ configuration
def configure(
    mpu_: Topology | None = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Set how :func:`checkpoint` keeps its inputs (DeepSpeed's signature).

    ``deepspeed_config`` (a ZeroStackConfig, a dict, a JSON path or text) supplies the defaults
    from its ``activation_checkpointing`` block; arguments that are not None win. ``mpu_`` is the
    job's :class:`~zerostack.topology.Topology` (its tp axis is the partitioning group)::

        checkpointing.configure(mpu_=engine.topology, deepspeed_config=cfg, checkpoint_in_cpu=True)
    """
    block = (
        load_config(deepspeed_config).activation_checkpointing
        if deepspeed_config is not None
        else ActivationCheckpointingConfig()
    )
    if mpu_ is not None and not isinstance(mpu_, Topology):
        raise TypeError(
            f"checkpointing.configure: mpu_ must be a zerostack Topology (engine.topology), "
            f"got {type(mpu_).__name__}"
        )

    def pick(arg, default):
        return default if arg is None else arg

    new = Settings(
        partition_activations=bool(pick(partition_activations, block.partition_activations)),
        cpu_checkpointing=bool(pick(checkpoint_in_cpu, block.cpu_checkpointing)),
        contiguous_memory_optimization=bool(
            pick(contiguous_checkpointing, block.contiguous_memory_optimization)
        ),
        number_checkpoints=pick(num_checkpoints, block.number_checkpoints),
        synchronize_checkpoint_boundary=bool(
            pick(synchronize, block.synchronize_checkpoint_boundary)
        ),
        profile=bool(pick(profile, block.profile)),
        mpu=mpu_,
    )
    n = new.number_checkpoints
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ConfigError(f"activation_checkpointing.number_checkpoints: must be >= 1, got {n!r}")
    if new.partition_activations and mpu_ is None:
        raise ConfigError(
            "activation_checkpointing.partition_activations: needs the tensor-parallel group; "
            "call checkpointing.configure(mpu_=topology, ...)"
        )
    if new.contiguous_memory_optimization and n is None:
        raise ConfigError(
            "activation_checkpointing.number_checkpoints: must be set when "
            "contiguous_memory_optimization is on (it sizes the buffer)"
        )
    _STATE.settings, _STATE.configured = new, True
    _STATE.contiguous = _Contiguous(n) if new.contiguous_memory_optimization else None


def is_configured() -> bool:
    """Whether :func:`configure` was called (DeepSpeed's name)."""
    return _STATE.configured


def settings() -> Settings:
    return _STATE.settings


def reset() -> None:
    """Drop the contiguous buffers and start counting checkpoints afresh (DeepSpeed's meaning:
    call it between forwards that have no backward, as in evaluation). Settings stay."""
    if _STATE.contiguous is not None:
        _STATE.contiguous.reset()


def unconfigure() -> None:
    """Forget :func:`configure` and the timers: back to plain checkpointing."""
    global _STATE
    _STATE = _State()


def timers(reset: bool = False) -> dict[str, float]:
    """Seconds and calls of checkpointed forwards and recomputations (counted with ``profile``)."""
    out = {f"{k}_seconds": v for k, v in _STATE.seconds.items()}
    out.update({f"{k}_calls": v for k, v in _STATE.calls.items()})
    if reset:
        _STATE.seconds = dict.fromkeys(_STATE.seconds, 0.0)
        _STATE.calls = dict.fromkeys(_STATE.calls, 0)
    return out


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """zerostack's tp RNG tracker (DeepSpeed's name)."""
    return get_rng_tracker()


def model_parallel_cuda_manual_seed(seed: int, topology: Topology | None = None) -> None:
    """:func:`zerostack.tensor_parallel.model_parallel_seed` on ``topology`` or the configured
    mpu (DeepSpeed's name and one-argument call)."""
    topology = topology or _STATE.settings.mpu
    if topology is None:
        raise ValueError(
            "model_parallel_cuda_manual_seed: no topology; pass one or call "
            "checkpointing.configure(mpu_=topology) first"
        )
    model_parallel_seed(seed, topology)


# ------------------------------------------------------------------------------ placement
def host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Host memory for kept inputs under ``cpu_checkpointing`` (pinned when CUDA is there, so the
    copies back can overlap). Every host tensor a checkpoint keeps comes from here."""
    return torch.empty(numel, dtype=dtype, pin_memory=torch.cuda.is_available())


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-kept input back on its compute device, for the recomputation."""
    return t.to(device, non_blocking=True)


def _empty(numel: int, dtype: torch.dtype, where: Where) -> torch.Tensor:
    if where == HOST:
        return host_empty(numel, dtype)
    return torch.empty(numel, dtype=dtype, device=where)


def partition_size(numel: int, tp: int) -> int:
    """Elements each tp rank keeps of a ``numel``-element input (the last part zero-padded)."""
    return -(-numel // tp)


# ------------------------------------------------------------------------------ the checkpoint
class _SaveInputs(torch.autograd.Function):
    """Holds the kept inputs as saved tensors, so saved-tensor hooks (memory accounting, nested
    checkpoints) see exactly what a checkpoint keeps. Its output is unused; backward never runs."""

    @staticmethod
    def forward(ctx, anchor, *kept):
        ctx.save_for_backward(*kept)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - not part of any graph that is differentiated
        return (None,) * (1 + len(ctx.saved_tensors))


@dataclass
class _Spec:
    index: int
    shape: torch.Size
    device: torch.device
    requires_grad: bool
    partitioned: bool
    on_host: bool


class _Inputs:
    """A checkpoint's arguments as kept until the recomputation."""

    def __init__(self, args: tuple, s: Settings) -> None:
        self.args = list(args)
        self.specs: list[_Spec] = []
        kept: list[torch.Tensor] = []
        copies: list[tuple[int, int, Where]] = []  # (index in kept, numel, where)
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                continue
            self.args[i] = None
            data = a.detach()
            plain = isinstance(a, nn.Parameter)  # already in memory, maybe tp-split: keep as is
            split = s.partitions and a.is_floating_point() and not plain
            numel = a.numel()
            if split:
                tp, rank = s.mpu.tp, s.mpu.rank("tp")
                numel = partition_size(a.numel(), tp)
                data = data.reshape(-1)[rank * numel : (rank + 1) * numel]  # short on the last
            host = s.cpu_checkpointing and not plain
            self.specs.append(_Spec(i, a.shape, a.device, a.requires_grad, split, host))
            if split or host or (s.contiguous_memory_optimization and not plain):
                copies.append((len(kept), numel, HOST if host else a.device))
            kept.append(data)
        if copies:
            for (j, numel, _), dst in zip(copies, self._destinations(kept, copies), strict=True):
                src = kept[j].reshape(-1)
                dst[: src.numel()].copy_(src, non_blocking=True)
                dst[src.numel() :].zero_()
                kept[j] = dst if numel != kept[j].numel() else dst.view(kept[j].shape)
        self.saver = _SaveInputs.apply(torch.empty(0, requires_grad=True), *kept)

    @staticmethod
    def _destinations(kept: list[torch.Tensor], copies: list) -> list[torch.Tensor]:
        sizes = [(numel, kept[j].dtype, where) for j, numel, where in copies]
        if _STATE.contiguous is not None:
            return _STATE.contiguous.take(sizes)
        return [_empty(*size) for size in sizes]

    def restore(self, s: Settings) -> list:
        """The arguments again: on their device, gathered over tp, detached, requires_grad as
        in forward (autograd saves different tensors otherwise)."""
        args = list(self.args)
        for spec, t in zip(self.specs, self.saver.grad_fn.saved_tensors, strict=True):
            if spec.on_host:
                t = to_device(t, spec.device)
            if spec.partitioned:
                full = t.new_empty(t.numel() * s.mpu.tp)
                s.mpu.comm.all_gather(full, t.reshape(-1), axis="tp")
                t = full[: spec.shape.numel()]
            if t.shape != spec.shape:
                t = t.view(spec.shape)
            args[spec.index] = t.detach().requires_grad_(spec.requires_grad)
        return args


class _RNG:
    """torch's CPU and CUDA generator states and the tp tracker's streams, at one moment."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.cuda = torch.cuda.get_rng_state() if cuda else None
        self.tracker = get_rng_tracker().get_states()

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        get_rng_tracker().set_states(self.tracker)

    @contextlib.contextmanager
    def replayed(self):
        now = _RNG()
        self.restore()
        try:
            yield
        finally:
            now.restore()


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices]


def _boundary(s: Settings) -> None:
    if (s.synchronize_checkpoint_boundary or s.profile) and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _Frame:
    """One checkpointed call: its kept inputs, the states to replay, and (after the first unpack)
    the recomputed tensors, handed out once each."""

    def __init__(self, function, args: tuple, s: Settings) -> None:
        self.function, self.settings = function, s
        self.rng = _RNG()
        self.autocast = _autocast_state()
        self.inputs = _Inputs(args, s)
        self.saved = 0
        self.recomputed: dict[int, torch.Tensor] = {}

    def pack(self, x: torch.Tensor) -> tuple[_Frame, int]:
        self.saved += 1
        return self, self.saved - 1

    def recompute(self) -> None:
        s = self.settings
        _boundary(s)
        t0 = time.perf_counter()
        args = self.inputs.restore(s)
        out: dict[int, torch.Tensor] = {}

        def record(x: torch.Tensor) -> torch.Tensor:
            out[len(out)] = x.detach()
            return x

        with contextlib.ExitStack() as stack:
            stack.enter_context(self.rng.replayed())
            for device, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(record, _unused))
            self.function(*args)
        if len(out) != self.saved:
            raise CheckpointingError(
                f"checkpoint of {getattr(self.function, '__name__', self.function)!r}: the forward "
                f"saved {self.saved} tensors for backward, the recomputation {len(out)}; the "
                "function must run the same operations on the same arguments every time"
            )
        self.recomputed = out
        _boundary(s)
        _count("recompute", t0, s)


def _unpack(handle: tuple[_Frame, int]) -> torch.Tensor:
    frame, i = handle
    if i not in frame.recomputed:  # the first unpack (or a second backward with retain_graph)
        frame.recompute()
    return frame.recomputed.pop(i)


def _unused(x):  # pragma: no cover - the recomputed graph is dropped, never differentiated
    return x


def _count(what: str, t0: float, s: Settings) -> None:
    if s.profile:
        _STATE.seconds[what] += time.perf_counter() - t0
        _STATE.calls[what] += 1


def checkpoint(function, *args):
    """``function(*args)``, keeping only ``args`` for backward and recomputing the rest.

    Gradients (inputs and parameters) are those of ``function(*args)`` itself, dropout included.
    Non-tensor arguments pass through; the outputs are whatever ``function`` returns. Without
    grad mode it is a plain call::

        x = checkpointing.checkpoint(block, x)
    """
    if not torch.is_grad_enabled():
        return function(*args)
    s = _STATE.settings
    _boundary(s)
    t0 = time.perf_counter()
    frame = _Frame(function, args, s)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, _unpack):
        out = function(*args)
    _boundary(s)
    _count("forward", t0, s)
    return out
