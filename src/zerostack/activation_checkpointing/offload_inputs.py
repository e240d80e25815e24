"""Checkpoint inputs in host memory for Hugging Face models checkpointed by torch's
non-reentrant checkpoint (DeepSpeed's
``get_checkpoint_hidden_states_offloading_ctx_manager``, from its ALST tutorial)::

    ctx = offload_checkpoint_inputs()            # one per run, reused every step
    with ctx:
        loss = model(**batch).loss
        engine.backward(loss)                    # inside the same context as the forward

With ``model.gradient_checkpointing_enable()`` a Transformers layer (``GradientCheckpointingLayer``)
keeps only its inputs for backward; torch's non-reentrant checkpoint saves them for backward
outside its own saved-tensor hooks, so a context's hooks see them. While a context is active,
each layer's first positional input (its hidden states, what the checkpoint keeps) is marked
when the layer runs in training with gradients, and the context's pack moves a marked tensor
of at least ``min_offload_bytes`` on a device into host memory (page-locked with
``use_pin_memory``), keeping the last ``keep_last_count`` on the device (the first layers
backward needs); unpack brings it back. Every other saved tensor passes through untouched, and
so do host tensors (a CPU run offloads nothing).

Copies are queued on the current stream (non-blocking into page-locked memory): there is no
side stream, so ``use_streams``, ``max_fwd_stash_count`` and ``max_cpu_buffer_pool_count`` are
accepted and change nothing. Layers routed through zerostack's own checkpoint (an
``activation_checkpointing`` block in the config) keep their inputs where the block says
(``cpu_checkpointing``), not through this context.
"""

from __future__ import annotations

import threading

import torch
from torch.autograd.graph import saved_tensors_hooks

from ..core.pinned import host_empty

_ACTIVE: list[CheckpointInputsOffload] = []  # the contexts entered, innermost last
_LOCK = threading.Lock()
_PATCHED: dict = {}  # "call": the layer class's own __call__ before the marker (or None)


class _Held:
    """A marked input packed for backward: on the device until it is moved to host memory."""

    __slots__ = ("device_tensor", "host", "device")

    def __init__(self, t: torch.Tensor) -> None:
        self.device_tensor, self.host, self.device = t, None, t.device

    def to_host(self, pin: bool) -> int:
        t = self.device_tensor
        self.host = host_empty(t.shape, t.dtype, pin=pin)
        self.host.copy_(t, non_blocking=pin)
        self.device_tensor = None
        return t.nbytes

    def get(self) -> torch.Tensor:
        if self.device_tensor is None:  # a copy in stream order after the one that filled host
            out = torch.empty(self.host.shape, dtype=self.host.dtype, device=self.device)
            self.device_tensor = out.copy_(self.host, non_blocking=self.host.is_pinned())
            self.host = None
        return self.device_tensor


class CheckpointInputsOffload(saved_tensors_hooks):
    """The context of :func:`offload_checkpoint_inputs` (see the module); ``offloaded``: the
    bytes moved to host memory since it was entered."""

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        min_offload_bytes: int = 1024,
        max_fwd_stash_count: int = 2,
        max_cpu_buffer_pool_count: int = 64,
        keep_last_count: int = 1,
    ) -> None:
        for name, value in (
            ("min_offload_bytes", min_offload_bytes),
            ("max_fwd_stash_count", max_fwd_stash_count),
            ("max_cpu_buffer_pool_count", max_cpu_buffer_pool_count),
            ("keep_last_count", keep_last_count),
        ):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        self.pin, self.min_bytes = use_pin_memory, min_offload_bytes
        self.keep_last = keep_last_count
        self.marked: dict[int, int] = {}  # id of a marked tensor: how many marks are pending
        self.recent: list[_Held] = []  # packed and still on the device, oldest first
        self.offloaded = 0
        super().__init__(self._pack, self._unpack)

    def mark(self, t: torch.Tensor) -> None:
        self.marked[id(t)] = self.marked.get(id(t), 0) + 1

    def unmark(self, t: torch.Tensor) -> bool:
        """Take one mark off ``t``; whether it had one."""
        n = self.marked.get(id(t), 0)
        if n == 0:
            return False
        if n == 1:
            del self.marked[id(t)]
        else:
            self.marked[id(t)] = n - 1
        return True

    def _pack(self, t: torch.Tensor):
        if not self.unmark(t) or t.device.type == "cpu" or t.nbytes < self.min_bytes:
            return t
        held = _Held(t)
        self.recent.append(held)
        while len(self.recent) > self.keep_last:
            self.offloaded += self.recent.pop(0).to_host(self.pin)
        return held

    @staticmethod
    def _unpack(x):
        return x.get() if isinstance(x, _Held) else x

    def __enter__(self):
        if self in _ACTIVE:
            raise RuntimeError("offload_checkpoint_inputs: this context is active already")
        with _LOCK:
            if not _ACTIVE:
                _install_marker()
            _ACTIVE.append(self)
        self.marked.clear()
        self.recent.clear()
        self.offloaded = 0
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            with _LOCK:
                _ACTIVE.remove(self)
                if not _ACTIVE:
                    _remove_marker()
            self.marked.clear()
            self.recent.clear()


def offload_checkpoint_inputs(**kwargs) -> CheckpointInputsOffload:
    """A context keeping checkpointed layers' inputs in host memory (see the module); its
    keywords are DeepSpeed's."""
    return CheckpointInputsOffload(**kwargs)


def _layer_class():
    try:
        from transformers import GradientCheckpointingLayer
    except ImportError:  # no Transformers: no layers to mark
        return None
    return GradientCheckpointingLayer


def _install_marker() -> None:
    cls = _layer_class()
    if cls is None:
        return
    _PATCHED["call"] = cls.__dict__.get("__call__")
    inner = cls.__call__

    def __call__(self, *args, **kwargs):
        ctx = _ACTIVE[-1] if _ACTIVE else None
        hidden = args[0] if args and torch.is_tensor(args[0]) else None
        wanted = getattr(self, "gradient_checkpointing", False) and self.training
        if ctx is None or hidden is None or not wanted or not torch.is_grad_enabled():
            return inner(self, *args, **kwargs)
        ctx.mark(hidden)
        try:
            return inner(self, *args, **kwargs)
        finally:
            ctx.unmark(hidden)  # a mark the checkpoint did not take (ids are reused)

    cls.__call__ = __call__


def _remove_marker() -> None:
    cls = _layer_class()
    if cls is None or "call" not in _PATCHED:
        return
    own = _PATCHED.pop("call")
    if own is None:
        del cls.__call__
    else:
        cls.__call__ = own
