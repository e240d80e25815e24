"""The checkpoint: saved-tensor hooks that keep only the inputs and recompute the rest once.

The forward runs under a ``saved_tensors_hooks`` pack that hands autograd a handle instead of each
tensor; the first unpack in backward restores the kept inputs (:class:`_Inputs`), replays the
forward's RNG and autocast state and runs the function again, recording what it saves.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from torch import nn

from ..comm.grid import comm_for
from ..tensor_parallel import get_rng_tracker
from .configuration import _STATE, Settings
from .placement import HOST, Where, _empty, _public, partition_size


class CheckpointingError(RuntimeError):
    """The recomputation did not redo the forward (a different number of saved tensors)."""


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
                t = _public().to_device(t, spec.device)
            if spec.partitioned:
                full = t.new_empty(t.numel() * s.mpu.tp)
                comm_for(s.mpu).all_gather(full, t.reshape(-1), axis="tp")
                t = full[: spec.shape.numel()]
            if t.shape != spec.shape:
                t = t.view(spec.shape)
            args[spec.index] = t.detach().requires_grad_(spec.requires_grad)
        return args


class _RNG:
    """torch's CPU generator state, the CUDA one when ``cuda`` (the checkpointed call's inputs
    are on the device: its dropout draws there), and the tp tracker's streams, at one moment."""

    def __init__(self, cuda: bool) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if cuda else None
        self.tracker = get_rng_tracker().get_states()

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        get_rng_tracker().set_states(self.tracker)

    @contextlib.contextmanager
    def replayed(self):
        now = _RNG(self.cuda is not None)
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
        self.rng = _RNG(any(torch.is_tensor(a) and a.is_cuda for a in args))
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

        def record(x: torch.Tensor) -> int:
            # Keep a detached copy of what the forward saves; hand autograd a plain index, not
            # x: a saved output returned as itself holds its own grad_fn, a reference cycle
            # in C++ that Python's gc cannot see, and the recomputed graph would never be freed.
            out[len(out)] = x.detach()
            return len(out) - 1

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


def model_checkpointed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers a Hugging Face model checkpoints (``gradient_checkpointing_enable()`` marks
    them: ``gradient_checkpointing`` True and a ``_gradient_checkpointing_func``)."""
    return [
        m
        for m in model.modules()
        if getattr(m, "gradient_checkpointing", False) is True
        and hasattr(m, "_gradient_checkpointing_func")
    ]


def adopt_model_checkpointing(model: torch.nn.Module) -> int:
    """Route the layers a Hugging Face model checkpoints through :func:`checkpoint`, so the
    config's ``activation_checkpointing`` block (``cpu_checkpointing``, partitions, profile)
    applies to them as to zerostack's own models; returns how many layers. Which layers
    checkpoint stays the model's choice (``every_n_layers`` and the like)."""
    layers = model_checkpointed_layers(model)
    for m in layers:
        m._gradient_checkpointing_func = checkpoint
    return len(layers)
