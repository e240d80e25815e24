"""Optimizer state and parameter shards off the device: host memory (CPU offload) or files (NVMe).

ZeRO-Offload keeps the fp32 master slices and the optimizer state in host memory and steps the
optimizer on the CPU; ZeRO-Infinity moves them, and the stage-3 parameter shards, to files on a
fast disk (the parameter shards' swapper is :mod:`.param_swap`). :class:`~.nvme.NVMeStore` is
one rank's folder of files under ``nvme_path`` (checked
before training starts, removed at ``close()`` or process exit).
:class:`OptimizerSwapper` steps a torch optimizer one sub-group at a time: while sub-group ``i``
steps, sub-group ``i + 1`` is read and ``i - 1`` written on background threads, and at most
``buffer_count`` sub-groups are in host memory at once (counted by :class:`HostMeter`, not RSS).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from ...core.pinned import host_empty
from .nvme import NVMeStore


class HostMeter:
    """Bytes of offloaded state held in host memory right now, and the peak (thread-safe: the
    swap threads count too)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.live += n
            self.peak = max(self.peak, self.live)

    def sub(self, n: int) -> None:
        with self._lock:
            self.live -= n


def host_device() -> torch.device:
    return torch.device("cpu")


@dataclass(frozen=True)
class HostOffload:
    """Where an offloaded optimizer's state lives and how it travels, made once
    (:func:`host_offload`) and given to every strategy: ``device`` ("none", "cpu" or "nvme"),
    ``pin`` (page-locked host buffers), ``uploads`` (offloaded masters up to the device),
    ``downloads`` (reduced gradients down into host memory), ``meter`` (host bytes held) and
    ``config`` (the ``offload_optimizer`` section, for the masters' store; None: not asked)."""

    device: str
    pin: bool
    uploads: Uploads
    downloads: Downloads
    meter: HostMeter
    config: object = None

    @property
    def offloads(self) -> bool:
        """Whether the optimizer's state is off the device (host memory or files)."""
        return self.device != "none"


def host_offload(offload, device: torch.device) -> HostOffload:
    """The offload set-up of ``offload`` (an ``offload_optimizer`` section, or None) for a
    model on ``device``."""
    kind = offload.device if offload is not None else "none"
    pin = bool(offload is not None and offload.pin_memory)
    return HostOffload(kind, pin, Uploads(device, pin), Downloads(device), HostMeter(), offload)


def to_host(t: torch.Tensor, pin: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host copy of ``t`` (page-locked when a GPU is present and ``pin``)."""
    return host_empty(t.shape, dtype or t.dtype, pin).copy_(t)


class Uploads:
    """Host values written into device tensors without stopping the host: the offloaded
    write-back of stepped fp32 masters into compute-dtype parameters on the GPU.

    Each value is cast on the host into its own page-locked staging buffer (in the compute dtype:
    half the bytes over the bus in bf16) and copied from there with ``non_blocking``, so the copy
    runs in stream order, before anything queued after it reads the destination, while the host
    goes on. An event recorded behind each copy guards its buffer: the next write into it (a step
    later, long after the copy) waits for that event first. A value already where its
    destination is (the CPU, masters not offloaded) is cast straight into it."""

    def __init__(self, device: torch.device, pin: bool) -> None:
        self.gpu = device.type == "cuda"
        self.pin = pin
        self.staging: dict[object, tuple[torch.Tensor, object]] = {}  # key -> (buffer, event)

    def copy(self, key: object, dst: torch.Tensor, value: torch.Tensor) -> None:
        """``dst.copy_(value)``; from host memory to the device through the staging buffer
        that ``key`` (a parameter: hashed by identity) names, one per destination."""
        if not self.gpu or value.device == dst.device:
            dst.copy_(value.view(dst.shape))
            return
        if key in self.staging:
            buf, event = self.staging[key]
            event.synchronize()  # its last copy may still be reading it
        else:
            buf = host_empty(dst.shape, dst.dtype, self.pin)
            event = torch.cuda.Event()
            self.staging[key] = buf, event
        buf.copy_(value.view(dst.shape))
        dst.copy_(buf, non_blocking=True)
        event.record()


class Downloads:
    """Device tensors brought into host memory without stopping the host: the reduced gradient
    pieces of an offloaded optimizer, added into its fp32 gradients in host memory.

    A blocking copy to the host inside backward waits for the whole stream (every backward kernel
    queued so far and the reduce-scatter), so the GPU would idle at every bucket while the host
    adds. :meth:`fetch` instead copies the tensor into a page-locked buffer with ``non_blocking``
    on a side stream (behind the collective that made it) and records an event; its ``then``
    (the add) runs when the copy is settled. :meth:`seal` ends a micro-step's copies;
    :meth:`settle_sealed` runs them early in the next micro-step's reduction, when the device has
    long done them, and :meth:`settle` runs every one before anything reads the gradients (the
    step, ``window_grad``, ``zero_grad``). The ``then`` calls run in fetch order, so the sums
    are the blocking copies' sums, bit for bit. On the CPU, or for a tensor already in host
    memory, ``then`` runs at once. The page-locked buffers are reused by size once settled: at
    most two micro-steps' pieces are held."""

    def __init__(self, device: torch.device) -> None:
        self.gpu = device.type == "cuda"
        self._open: list[tuple] = []  # (event, host buffer, then, shape) of this micro-step
        self._sealed: list[tuple] = []
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._stream = None

    def fetch(self, t: torch.Tensor, then: Callable[[torch.Tensor], object]) -> None:
        """``then(t on the host)``, now on the CPU, else once the copy is settled.

        The copy runs on a side stream of its own, behind what the current stream has queued
        (the collective that made ``t``), so the compute queued next does not wait for it;
        ``t`` is announced to that stream (``record_stream``), so its memory is not handed out
        again before the copy has read it."""
        if not self.gpu or t.device.type == "cpu":
            then(t)
            return
        free = self._free.get((t.numel(), t.dtype))
        host = free.pop() if free else host_empty(t.numel(), t.dtype)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=t.device)
        side = self._stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            host.copy_(t.reshape(-1), non_blocking=True)
            event = side.record_event()
        t.record_stream(side)
        self._open.append((event, host, then, t.shape))

    def seal(self) -> None:
        """The micro-step's copies are all queued."""
        self._sealed += self._open
        self._open = []

    def settle_sealed(self) -> None:
        """Run the earlier micro-steps' ``then`` calls."""
        sealed, self._sealed = self._sealed, []
        self._run(sealed)

    def settle(self) -> None:
        """Run every pending ``then``, waiting for each copy's event."""
        self.settle_sealed()
        pending, self._open = self._open, []
        self._run(pending)

    def _run(self, items: list[tuple]) -> None:
        for event, host, then, shape in items:
            event.synchronize()  # this copy and what came before it, nothing after
            then(host.view(shape))
            self._free.setdefault((host.numel(), host.dtype), []).append(host)


def _placeholder(p: torch.Tensor) -> torch.Tensor:
    """A tensor of p's shape backed by one element (stride 0): a swapped-out master keeps its
    shape, so its gradient can still be assigned, without holding its storage."""
    return torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)


class HostStore:
    """NVMeStore's interface over host memory: offload_param "cpu" keeps the shards here."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.tensors: dict[str, list[torch.Tensor]] = {}
        self.bytes_read = self.bytes_written = 0

    def write(self, key: str, tensors: list[torch.Tensor]) -> None:
        self.tensors[key] = [to_host(t.detach().reshape(-1), self.pin) for t in tensors]
        self.bytes_written += sum(t.nbytes for t in tensors)

    def read_into(self, key: str, tensors: list[torch.Tensor]) -> None:
        for dst, src in zip(tensors, self.tensors[key], strict=False):
            dst.view(-1).copy_(src)
            self.bytes_read += dst.nbytes

    def load(self, key: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The stored tensor (one) on ``device``: a private copy on the host; on a GPU, copied
        from its page-locked memory without blocking the host (it is never written in place:
        :meth:`write` stores new tensors, so the copy may read it as long as it takes)."""
        src = self.tensors[key][0]
        self.bytes_read += src.nbytes
        return src.clone() if device.type == "cpu" else src.to(device, non_blocking=True)

    def close(self) -> None:
        self.tensors.clear()


class OptimizerSwapper:
    """Master sub-groups (one parameter each) and their optimizer state kept in an NVMeStore.

    Between steps a master holds no storage (``p.data`` is a one-element placeholder of its
    shape); its gradient stays in host memory. :meth:`step` swaps each sub-group in, steps the
    optimizer on it alone (the others' gradients are hidden, so torch optimizers skip them), hands
    it to ``on_updated`` and swaps it out again.
    """

    def __init__(
        self, masters: list[nn.Parameter], store: NVMeStore, buffer_count: int, meter: HostMeter
    ) -> None:
        self.masters: list[nn.Parameter] = []
        self.store, self.meter = store, meter
        self.buffer_count = max(1, buffer_count)
        self.numel: dict[nn.Parameter, int] = {}
        self.shape: dict[nn.Parameter, torch.Size] = {}
        self.state_keys: dict[nn.Parameter, list[tuple[str, torch.dtype]]] = {}
        self.key: dict[nn.Parameter, str] = {}
        # grad_source(master) -> its fp32 gradient, when gradients are kept in files too
        self.grad_source: Callable[[nn.Parameter], torch.Tensor] | None = None
        for p in masters:
            self.add(p)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="zerostack-nvme")

    def add(self, p: nn.Parameter) -> None:
        """Write a new master to its file and drop its storage."""
        self.masters.append(p)
        self.numel[p], self.shape[p] = p.numel(), p.shape
        self.key[p] = f"sub{len(self.key)}"
        self.store.write(self.key[p], [p.data])
        p.data = _placeholder(p)

    # ------------------------------------------------------------------ swapping
    def _tensors(self, p: nn.Parameter) -> list[torch.Tensor]:
        n = self.numel[p]
        out = [torch.empty(n, dtype=torch.float32)]
        out += [torch.empty(n, dtype=dt) for _, dt in self.state_keys.get(p, [])]
        return out

    def _swap_in(self, p: nn.Parameter) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        tensors = self._tensors(p)
        self.meter.add(sum(t.nbytes for t in tensors))
        self.store.read_into(self.key[p], tensors)
        grad = self.grad_source(p) if self.grad_source is not None else None
        return tensors, grad

    def _swap_out(self, p: nn.Parameter, tensors: list[torch.Tensor]) -> None:
        self.store.write(self.key[p], tensors)
        self.meter.sub(sum(t.nbytes for t in tensors))

    def _install(self, p: nn.Parameter, tensors: list[torch.Tensor], optimizer) -> None:
        p.data = tensors[0].view(self.shape[p])
        state = optimizer.state.get(p)
        for (name, _), t in zip(self.state_keys.get(p, []), tensors[1:], strict=True):
            state[name] = t.view(self.shape[p])

    def _uninstall(self, p: nn.Parameter, optimizer) -> list[torch.Tensor]:
        """This sub-group's tensors (master, then state tensors), detached from p and state."""
        state = optimizer.state.get(p, {})
        keys = [
            (k, v.dtype)
            for k, v in state.items()
            if torch.is_tensor(v) and v.numel() == self.numel[p] and v.dim() > 0
        ]
        created = not self.state_keys.get(p)  # the optimizer made its state in this step
        self.state_keys[p] = keys
        tensors = [p.data.reshape(-1)] + [state[k].reshape(-1) for k, _ in keys]
        if created:
            self.meter.add(sum(t.nbytes for t in tensors[1:]))
        for k, _ in keys:
            state[k] = torch.empty(0, dtype=state[k].dtype)
        p.data = _placeholder(p)
        return tensors

    def step(self, optimizer, on_updated: Callable[[nn.Parameter, torch.Tensor], None]) -> None:
        """Step every master that has a gradient, sub-group by sub-group."""
        todo = [p for p in self.masters if p.grad is not None]
        grads = {p: p.grad for p in todo}
        for p in todo:
            p.grad = None
        reads: dict[nn.Parameter, Future] = {}
        writes: list[Future] = []

        def prefetch(i: int, holding: int) -> None:
            """Read sub-group i ahead if a buffer is free (waiting for old writes first)."""
            if i >= len(todo) or todo[i] in reads:
                return
            while writes and holding + len(reads) + len(writes) + 1 > self.buffer_count:
                writes.pop(0).result()
            if holding + len(reads) + len(writes) + 1 <= self.buffer_count:
                reads[todo[i]] = self._pool.submit(self._swap_in, todo[i])

        try:
            for i, p in enumerate(todo):
                prefetch(i, 0)
                tensors, grad = reads.pop(p).result()
                prefetch(i + 1, 1)  # overlaps this sub-group's step
                self._install(p, tensors, optimizer)
                p.grad = grads[p] if grad is None else grad
                optimizer.step()
                p.grad = None
                on_updated(p, p.data)
                writes.append(self._pool.submit(self._swap_out, p, self._uninstall(p, optimizer)))
            for w in writes:
                w.result()
        finally:
            for p in todo:
                p.grad = grads[p]

    def read(self, p: nn.Parameter) -> torch.Tensor:
        """The master's current value (the head of its file)."""
        t = torch.empty(self.numel[p], dtype=torch.float32)
        self.store.read_into(self.key[p], [t])
        return t.view(self.shape[p])

    def read_state(self, p: nn.Parameter, kinds=()) -> dict[str, torch.Tensor]:
        """The master's value (``"master"``) and its optimizer-state tensors, flat, read from its
        file (for a checkpoint); state ``kinds`` it has none of yet come as zeros."""
        tensors = self._tensors(p)
        self.store.read_into(self.key[p], tensors)
        out = {"master": tensors[0]}
        for (name, _), t in zip(self.state_keys.get(p, []), tensors[1:], strict=True):
            out[name] = t
        for k in kinds:
            out.setdefault(k, torch.zeros(self.numel[p], dtype=torch.float32))
        return out

    def write_state(self, p: nn.Parameter, values: dict[str, torch.Tensor], optimizer) -> None:
        """Make ``values`` (as :meth:`read_state` gives them) the master's file; its optimizer
        state gets the empty stand-ins a swapped-out sub-group has, read in at the next step."""
        names = [k for k in values if k != "master"]
        state = optimizer.state[p]
        for k in names:
            state[k] = torch.empty(0, dtype=values[k].dtype)
        self.state_keys[p] = [(k, values[k].dtype) for k in names]
        self.store.write(self.key[p], [values["master"], *(values[k] for k in names)])

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.store.close()
