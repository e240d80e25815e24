"""Stage 3's hold on a model's modules, put on and taken off as one: each module's forward
hooks (:class:`~.coordinator.ParamCoordinator` gathers and releases there), its ``_parameters``
read through :class:`_GatherOnRead` (a released parameter read during a forward is gathered for
the running unit), and stage 3's linear in place of ``nn.Linear.forward``.

RL libraries take it off around generation and put it back (TRL's ``remove_hooks`` /
``add_hooks``, through ``engine.optimizer.parameter_offload``): taken off, the model is a plain
module; put back, training continues as if it had never come off.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .linear import linear_saving_weight
from .params import is_sharded

if TYPE_CHECKING:
    from .coordinator import ParamCoordinator


def eager(fn):
    """A hook run eagerly under torch.compile: the graph breaks around it (it posts collectives
    and changes what the module's parameters hold), as DeepSpeed marks its ZeRO-3 hooks."""
    return torch.compiler.disable(fn, recursive=True)


@eager  # its backward reads the weight parameter as it is then: traced, a graph would not
def _linear_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear_saving_weight(x, module.weight, module.bias)


class _GatherOnRead(dict):
    """A module's ``_parameters``: reading a released parameter during a forward pass gathers it
    for the unit running (see ``ParamCoordinator._borrow``)."""

    def __init__(self, params: dict, coordinator: ParamCoordinator) -> None:
        super().__init__(params)
        self.coordinator = coordinator

    def __getitem__(self, name: str):
        p = super().__getitem__(name)
        if self.coordinator._running and is_sharded(p) and not p._zs.gathered:
            self.coordinator._borrow(p)
        return p

    def __reduce__(self):  # a copy of the module holds a plain dict, not the engine
        return dict, (dict(self),)


def external_parameters(coordinator: ParamCoordinator, u: int) -> list[tuple[str, nn.Parameter]]:
    """The parameters unit ``u`` holds without owning them (read in its forward, see
    ``ParamCoordinator._borrow``), as ``(name, parameter)``: ``module.ds_external_parameters()``."""
    own = set(coordinator.modules[u].parameters(recurse=False))
    return [(str(p.ds_id), p) for p in coordinator.units[u] if p not in own]


class _Borrowed:
    """``module.ds_external_parameters()`` (DeepSpeed's name). It holds the coordinator weakly:
    the model does not keep the engine alive."""

    def __init__(self, coordinator: ParamCoordinator, u: int) -> None:
        self.coordinator, self.u = weakref.ref(coordinator), u

    def __call__(self) -> list[tuple[str, nn.Parameter]]:
        coordinator = self.coordinator()
        return [] if coordinator is None else external_parameters(coordinator, self.u)

    def __reduce__(self):  # a copy of the module borrows nothing and holds no engine
        return _NoneBorrowed, ()


class _NoneBorrowed:
    def __call__(self) -> list:
        return []


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's: ``module``'s forward uses ``parameter``, which another module owns, so stage
    3 gathers it with ``module``, forward and backward. A parameter read as ``other.weight``
    during a forward is gathered there without this; it is for one reached another way (kept in
    a list, handed in). Before ``initialize`` it is recorded; after, it joins the unit at once."""
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError("Parameter is not a torch.nn.Parameter")
    module.__dict__.setdefault("_zs_external", {})[id(parameter)] = parameter
    borrowed = module.__dict__.get("ds_external_parameters")
    coordinator = borrowed.coordinator() if isinstance(borrowed, _Borrowed) else None
    if coordinator is not None:
        units = [u for u, m in enumerate(coordinator.modules) if m is module]
        if not units:
            raise ValueError(
                f"register_external_parameter: the {type(module).__name__} is inside a leaf "
                "module, whose unit gathers only what lies under it"
            )
        coordinator.adopt(units[0], parameter)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's: undo :func:`register_external_parameter` before ``initialize`` (after it,
    the unit keeps gathering the parameter, as it does one its forward read)."""
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError("Parameter is not a torch.nn.Parameter")
    externals = module.__dict__.get("_zs_external", {})
    if id(parameter) not in externals:
        raise RuntimeError("Parameter is not a registered external parameter of module.")
    del externals[id(parameter)]


class ModuleHooks:
    """The coordinator's hold on its modules (unit ``u`` is ``coordinator.modules[u]``)."""

    def __init__(self, coordinator: ParamCoordinator) -> None:
        self.coordinator = coordinator
        self.handles: list[RemovableHandle] = []
        for u, m in enumerate(coordinator.modules):
            m.ds_external_parameters = _Borrowed(coordinator, u)

    def attach(self) -> None:
        """Put it on (again after :meth:`detach`, or after the handles were removed one by
        one, as TRL's ``remove_hooks`` does)."""
        self.detach()
        c = self.coordinator
        self.handles.append(c.module.register_forward_pre_hook(c._begin_pass, prepend=True))
        for u, m in enumerate(c.modules):
            m._parameters = _GatherOnRead(m._parameters, c)
            self.handles.append(m.register_forward_pre_hook(partial(c._pre_forward, u)))
            self.handles.append(m.register_forward_hook(partial(c._post_forward, u)))
            if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward:
                m.forward = partial(_linear_forward, m)  # see linear_saving_weight

    def detach(self) -> None:
        """Take it off: the model is then a plain module, whose parameters hold what they hold
        (their pieces; the whole values inside ``GatheredParameters``). Call it outside forward
        and backward, when no module holds a gathered parameter."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for m in self.coordinator.modules:
            if isinstance(m._parameters, _GatherOnRead):
                m._parameters = dict(m._parameters)
            if isinstance(m.__dict__.get("forward"), partial):
                if m.__dict__["forward"].func is _linear_forward:
                    del m.forward

    @property
    def attached(self) -> bool:
        """Whether every hook is in place."""
        return len(self.handles) == 1 + 2 * len(self.coordinator.modules) and all(
            h.id in (h.hooks_dict_ref() or {}) for h in self.handles
        )
