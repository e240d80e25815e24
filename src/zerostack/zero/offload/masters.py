"""Where the fp32 master weights, their optimizer state and (stage 3) their gradients live.

Every stage asks the same of its masters: step them, read them for a checkpoint, store what a load
filled, close. :class:`MemoryMasters` keeps them as tensors (on the device, or in host memory with
``offload_optimizer: cpu``), so the optimizer steps them in place; :class:`FileMasters` keeps
them, with their optimizer state, in an NVMe store and swaps one sub-group in at a time
(``offload_optimizer: nvme``). A strategy builds one of them with :func:`master_store` and calls it
unconditionally.

Stage 3 also keeps each master's fp32 gradient apart from the master: :class:`GradShards` in
memory (views of one flat shard per group), :class:`GradFiles` in the NVMe store beside the
masters, so that neither the masters nor their gradients are in memory between steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from .host import HostMeter, NVMeStore, OptimizerSwapper, host_device

OnUpdated = Callable[[nn.Parameter, torch.Tensor], None]


def live_state(master: nn.Parameter, optimizer, kinds=()) -> dict[str, torch.Tensor]:
    """A master in memory and its optimizer-state tensors of its size, as flat views (what a
    checkpoint reads and a load fills in place); state ``kinds`` it lacks are added, zeros."""
    if kinds:
        state = optimizer.state[master]
        for k in kinds:
            if k not in state:
                state[k] = torch.zeros_like(master)
    out = {"master": master.detach().view(-1)}
    for k, v in optimizer.state.get(master, {}).items():
        if torch.is_tensor(v) and v.dim() > 0 and v.numel() == master.numel():
            out[k] = v.detach().view(-1)
    return out


class MemoryMasters:
    """Masters as tensors (device or host memory): the optimizer steps them in place."""

    in_memory = True

    def add(self, master: nn.Parameter) -> None:
        """A new master (nothing to do: it stays where it is)."""

    def step(self, optimizer, on_updated: OnUpdated) -> None:
        """``optimizer.step()``; the strategy writes the masters back afterwards."""
        optimizer.step()

    def read(self, master: nn.Parameter) -> torch.Tensor:
        """The master's current fp32 value."""
        return master.detach()

    def read_state(self, master: nn.Parameter, optimizer, kinds=()) -> dict[str, torch.Tensor]:
        """The master's value (``"master"``) and its optimizer state, flat: the live tensors,
        which a load fills in place."""
        return live_state(master, optimizer, kinds)

    def state_kinds(self, master: nn.Parameter, optimizer) -> list[tuple[str, torch.dtype]]:
        """What :meth:`read_state` gives, as ``(kind, dtype)``, without copying anything."""
        return [(k, v.dtype) for k, v in live_state(master, optimizer).items()]

    def write_state(self, master: nn.Parameter, optimizer, values: dict) -> None:
        """Nothing: :meth:`read_state` gave the live tensors."""

    def close(self) -> None:
        pass


class FileMasters:
    """Masters and their optimizer state in an NVMe store (:class:`~.host.OptimizerSwapper`):
    between steps a master holds no storage; :meth:`step` swaps each in, steps it, hands its new
    value to ``on_updated`` and writes it back."""

    in_memory = False

    def __init__(self, swapper: OptimizerSwapper) -> None:
        self.swapper = swapper

    def add(self, master: nn.Parameter) -> None:
        """Write a new master to its file and drop its storage."""
        self.swapper.add(master)

    def step(self, optimizer, on_updated: OnUpdated) -> None:
        self.swapper.step(optimizer, on_updated)

    def read(self, master: nn.Parameter) -> torch.Tensor:
        return self.swapper.read(master)

    def read_state(self, master: nn.Parameter, optimizer, kinds=()) -> dict[str, torch.Tensor]:
        """Copies read from the file; :meth:`write_state` stores them back once filled."""
        return self.swapper.read_state(master, kinds)

    def state_kinds(self, master: nn.Parameter, optimizer) -> list[tuple[str, torch.dtype]]:
        """What :meth:`read_state` gives, as ``(kind, dtype)``, without reading the file."""
        return [("master", torch.float32), *self.swapper.state_keys.get(master, [])]

    def write_state(self, master: nn.Parameter, optimizer, values: dict) -> None:
        self.swapper.write_state(master, values, optimizer)

    def close(self) -> None:
        """Remove the files (also done at process exit)."""
        self.swapper.close()


def master_store(
    offload, *, rank: int, need_bytes: int, meter: HostMeter
) -> tuple[MemoryMasters | FileMasters, NVMeStore | None]:
    """The store ``offload_optimizer`` asks for, and its NVMe store (None in memory)."""
    if offload is None or offload.device != "nvme":
        return MemoryMasters(), None
    what = "zero_optimization.offload_optimizer"
    files = NVMeStore(offload.nvme_path, rank, need_bytes, what)
    return FileMasters(OptimizerSwapper([], files, offload.buffer_count, meter)), files


class GradShards:
    """Stage 3's gradients in memory: one flat shard per (sub-)group, in ``dtype`` (fp32, or
    ``data_types.grad_accum_dtype``), each parameter's gradient a view of it (``st.grad``); the
    master takes the shard (a copy of it in the master's dtype where that differs) as its
    ``.grad``."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.device = device  # where reduced pieces are added (host memory when offloaded)
        self.dtype = dtype

    def shard_for(self, master: torch.Tensor) -> torch.Tensor | None:
        return torch.zeros_like(master, dtype=self.dtype)

    def add(self, p: nn.Parameter, reduced: torch.Tensor, final: bool) -> None:
        """Add a micro-step's reduced piece of ``p`` (``final``: the window's last)."""
        p._zs.grad.add_(reduced)

    def replace(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Make ``value`` (fp32, reduced terms) ``p``'s piece so far in the window."""
        p._zs.grad.copy_(value)

    def norms_sq(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The squared norms of ``params``' gradient pieces, an fp32 vector: one multi-tensor
        kernel (``_foreach_norm``) where a GPU took three tiny ones per parameter."""
        grads = [p._zs.grad for p in params]
        return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square()

    def piece(self, p: nn.Parameter) -> torch.Tensor:
        """This rank's piece of ``p``'s gradient so far in the window (summed over dp)."""
        return p._zs.grad

    def hand_to(self, groups: Iterable) -> None:
        """Each master gets its gradient shard as ``.grad``, in the master's dtype."""
        for g in groups:
            g.master.grad = g.grad_shard.to(g.master.dtype)

    def scale(self, groups: Iterable, factor: float) -> None:
        for g in groups:
            g.master.grad.mul_(factor)

    def clear(self, groups: Iterable) -> None:
        for g in groups:
            g.grad_shard.zero_()
            g.master.grad = None


class GradFiles:
    """Stage 3's fp32 gradients in the NVMe store beside the masters (``offload_optimizer:
    nvme``): each micro-step's reduced piece is added into its parameter's file; the window's
    last records its share of the norm; the optimizer reads a sub-group's gradient, scaled, as it
    swaps the sub-group in."""

    def __init__(self, files: NVMeStore, params: list[nn.Parameter], groups_of) -> None:
        self.device = host_device()
        self.files = files
        self.key = {p: f"grad{i}" for i, p in enumerate(params)}
        self.group_of = groups_of  # master -> its (sub-)group
        self.written: set[nn.Parameter] = set()
        self.sq: dict[nn.Parameter, torch.Tensor] = {}
        self.factor = 1.0

    def shard_for(self, master: torch.Tensor) -> torch.Tensor | None:
        return None  # no shard in memory

    def add(self, p: nn.Parameter, reduced: torch.Tensor, final: bool) -> None:
        if p in self.written:
            acc = torch.empty(reduced.numel(), dtype=torch.float32)
            self.files.read_into(self.key[p], [acc])
            acc += reduced
        else:
            acc = reduced.to(torch.float32, copy=True)
        self.files.write(self.key[p], [acc])
        self.written.add(p)
        if final:  # the window's value: its share of the global norm
            self.sq[p] = torch.linalg.vector_norm(acc, dtype=torch.float32).square()

    def replace(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Make ``value`` ``p``'s piece so far in the window: its file, and its share of the
        norm the step takes."""
        value = value.to("cpu", torch.float32)
        self.files.write(self.key[p], [value])
        self.written.add(p)
        self.sq[p] = torch.linalg.vector_norm(value, dtype=torch.float32).square()

    def norms_sq(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The squared norms the window's last adds recorded (0 for a parameter without a
        gradient), an fp32 vector."""
        zero = torch.zeros((), dtype=torch.float32)
        return torch.stack([self.sq.get(p, zero) for p in params])

    def piece(self, p: nn.Parameter) -> torch.Tensor:
        """This rank's piece of ``p``'s gradient so far in the window, read from its file."""
        out = torch.zeros(p._zs.piece.numel(), dtype=torch.float32)
        if p in self.written:
            self.files.read_into(self.key[p], [out])
        return out

    def hand_to(self, groups: Iterable) -> None:
        """A stand-in marks "has a gradient"; :meth:`load` is what the optimizer steps with."""
        for g in groups:
            g.master.grad = torch.zeros((), dtype=torch.float32).expand(g.master.shape)

    def scale(self, groups: Iterable, factor: float) -> None:
        self.factor = factor  # applied as each sub-group's gradient is read

    def load(self, master: nn.Parameter) -> torch.Tensor:
        """The sub-group's gradient, read from the files and scaled."""
        out = torch.zeros(master.numel(), dtype=torch.float32)
        off = 0
        for p in self.group_of[master].params:
            pn = p._zs.piece.numel()
            if p in self.written:
                self.files.read_into(self.key[p], [out[off : off + pn]])
            off += pn
        return out.mul_(self.factor)

    def clear(self, groups: Iterable) -> None:
        for g in groups:
            g.master.grad = None
        self.written.clear()
        self.sq.clear()
        self.factor = 1.0
