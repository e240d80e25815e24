"""``engine.offload_states()`` / ``engine.reload_states()``: the training states leave the device
and come back, for RL colocation (the trainer's GPU memory goes to an inference engine while it
generates, as OpenRLHF and verl-style trainers do with DeepSpeed's methods of the same names).

What moves is chosen by kind, with DeepSpeed's names (:class:`StateKind`): ``optim_states`` (the
optimizer's state tensors), ``hp_params`` (separate fp32 master weights), ``lp_params`` (the
compute-dtype parameters: flat buffers at stages 0-2, this rank's pieces and the gathered
persistent parameters at stage 3), ``lp_grads`` (gradient buffers and shards) and
``contiguous_grad_buffer`` (bucket buffers kept for the next backward, whose bytes are scratch).

How: each device storage that holds only included kinds is copied whole into a host buffer
(page-locked with ``pin_memory``) and then resized to zero bytes, which gives its memory back to
the allocator (FSDP2 frees its unsharded parameters the same way). Every tensor viewing it, a
parameter, a master, an optimizer moment, keeps its identity, shape and strides; ``reload``
resizes each storage back and copies the bytes in, so training continues bit for bit. A storage
shared by an included and an excluded kind stays (in an fp32 run the masters at stages 0-2 are
the parameters' own storage: they move with ``lp_params``). What already lives in host memory
(an offloaded optimizer, offloaded parameters) is left where it is.

Between the two, the model's forward is refused while ``lp_params`` are away (a plain module
call too: its first hook says so), and so are backward, step and checkpoints while anything is.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ...core.pinned import host_empty
from ..strategy import Pieces

log = logging.getLogger("zerostack")


class StateKind(enum.StrEnum):
    """The kinds of state ``offload_states`` moves (DeepSpeed's ``OffloadStateTypeEnum``)."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


_OF_HELD = {
    "params": StateKind.lp_params,
    "grads": StateKind.lp_grads,
    "master": StateKind.hp_params,
    "scratch": StateKind.contiguous_grad_buffer,
}
"""The strategy's kinds of buffer (``state_tensors()``) as offload kinds."""


def state_kinds(include: Iterable | None) -> set[StateKind]:
    """``include`` (kinds or their names; None: every kind) as a set of :class:`StateKind`."""
    if include is None:
        return set(StateKind)
    if isinstance(include, (str, StateKind)):
        include = [include]
    out = set()
    for k in include:
        try:
            out.add(StateKind(getattr(k, "value", k)))
        except ValueError:
            names = ", ".join(s.value for s in StateKind)
            raise ValueError(f"offload_states: unknown state {k!r} (known: {names})") from None
    return out


@dataclass
class _Parked:
    storage: torch.UntypedStorage
    nbytes: int
    device: torch.device
    host: torch.Tensor | None  # its bytes; None for scratch, whose bytes do not matter


def _whole(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over all of ``storage``, which lives on ``device``."""
    out = torch.empty(0, dtype=torch.uint8, device=device)
    return out.set_(storage, 0, (storage.nbytes(),), (1,))


class StateOffload:
    """One engine's states in host memory between ``offload`` and ``reload`` (see the module)."""

    def __init__(self, module: nn.Module, zero, optimizer) -> None:
        self.module, self.zero, self.optimizer = module, zero, optimizer
        self.parked: dict[int, _Parked] = {}  # by the storage's address before it was freed
        self.kinds: set[StateKind] = set()  # asked for since the last reload
        self.moved: dict[str, int] = {}  # bytes each kind moved off the device (the last call)
        self._guard = None

    def tensors(self):
        """``(kind, tensor)`` of every state tensor the engine keeps between steps."""
        for kind, t in self.zero.state_tensors():
            yield _OF_HELD[kind], t
        for state in self.optimizer.state.values() if self.optimizer is not None else ():
            for t in state.values():
                if torch.is_tensor(t):  # step counters too, where they live on the device
                    yield StateKind.optim_states, t

    def offload(self, include=None, pin_memory: bool = True, non_blocking: bool = False) -> None:
        """Move the included kinds' device storages to host memory (see the module)."""
        include = state_kinds(include)
        if isinstance(self.zero, Pieces):  # gathered copies are not state: drop them first
            self.zero.release_gathered()
        found: dict[int, tuple[torch.Tensor, set[StateKind]]] = {}
        for kind, t in self.tensors():
            storage = t.untyped_storage()
            if t.device.type == "cpu" or storage.nbytes() == 0:
                continue
            _, kinds = found.setdefault(storage.data_ptr(), (t, set()))
            kinds.add(kind)
        self.moved = {k.value: 0 for k in include}
        for key, (t, kinds) in found.items():
            if not kinds <= include:
                continue
            storage = t.untyped_storage()
            host = None
            if kinds != {StateKind.contiguous_grad_buffer}:
                host = host_empty(storage.nbytes(), torch.uint8, pin=pin_memory)
                host.copy_(_whole(storage, t.device), non_blocking=non_blocking)
            self.parked[key] = _Parked(storage, storage.nbytes(), t.device, host)
            for kind in kinds:
                self.moved[kind.value] += storage.nbytes()
            storage.resize_(0)
        self.kinds |= include
        if StateKind.lp_params in self.kinds and self._guard is None:
            self._guard = self.module.register_forward_pre_hook(self._refuse_forward, prepend=True)
        log.info("offload_states: %s bytes to host memory", self.moved)

    def reload(self, non_blocking: bool = False) -> None:
        """Put every parked storage back on the device, its bytes as they were."""
        for parked in self.parked.values():
            parked.storage.resize_(parked.nbytes)
            if parked.host is not None:
                whole = _whole(parked.storage, parked.device)
                whole.copy_(parked.host, non_blocking=non_blocking)
        self.parked.clear()
        self.kinds.clear()
        if self._guard is not None:
            self._guard.remove()
            self._guard = None

    def require_resident(self, what: str) -> None:
        """Refuse ``what`` while any state is in host memory."""
        if self.parked:
            kinds = ", ".join(sorted(k.value for k in self.kinds))
            raise RuntimeError(
                f"engine.{what}(): the engine's states ({kinds}) are in host memory after "
                f"engine.offload_states(); call engine.reload_states() first"
            )

    def _refuse_forward(self, module, args) -> None:
        raise RuntimeError(
            "forward: the model's parameters (lp_params) are in host memory after "
            "engine.offload_states(); call engine.reload_states() first"
        )
