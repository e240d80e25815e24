"""``deepspeed.runtime.zero.parameter_offload``: ``engine.optimizer.parameter_offload`` at ZeRO
stage 3, the object RL libraries take stage 3's hooks off and put back with.

TRL's ``unwrap_model_for_generation`` (trl/models/utils.py ``remove_hooks`` / ``add_hooks``)
gathers the whole model with ``GatheredParameters``, clears each parameter's
``ds_active_sub_modules``, removes every handle in ``forward_hooks`` and ``backward_hooks``,
generates with the plain module, then invalidates the coordinator's trace and calls
``_register_deepspeed_module(module)``. Here those are zerostack's own: the handles are stage
3's (:class:`~zerostack.zero.stage3.module_hooks.ModuleHooks`), so removing them really leaves a
plain module, and registering puts every hook back; training then continues exactly as if the hooks
had never come off (tests/test_trl.py).
"""

from __future__ import annotations

import weakref

from torch import nn

from zerostack.zero.stage3.coordinator import ParamCoordinator


class PartitionedParameterCoordinator:
    """``parameter_offload.param_coordinator``: the recorded gather order, as DeepSpeed's
    trace."""

    def __init__(self, coordinator: ParamCoordinator) -> None:
        self._coordinator = weakref.ref(coordinator)

    def is_invalid_trace(self) -> bool:
        """Whether no order is recorded (the next training pass records one)."""
        order = _alive(self._coordinator).order
        return order.trace is None and not order.recording

    def _invalidate_trace(self) -> None:
        """Forget the recorded order; as DeepSpeed's, refused when there is none."""
        if self.is_invalid_trace():
            raise RuntimeError("attempted to invalidate already invalid trace")
        _alive(self._coordinator).forget_order()


def _alive(ref: weakref.ref):
    obj = ref()
    if obj is None:
        raise RuntimeError("parameter_offload: its engine is gone")
    return obj


class DeepSpeedZeRoOffload:
    """Stage 3's parameter hooks under DeepSpeed's names: ``module``, ``forward_hooks``,
    ``backward_hooks``, ``param_coordinator`` and ``_register_deepspeed_module``. It hangs on
    the engine's optimizer and holds the model and the hooks weakly: the optimizer keeps
    neither alive."""

    def __init__(self, module: nn.Module, coordinator: ParamCoordinator) -> None:
        self._module, self._coordinator = weakref.ref(module), weakref.ref(coordinator)
        self.param_coordinator = PartitionedParameterCoordinator(coordinator)
        self.backward_hooks: list = []  # gathers for backward hang on each forward's outputs

    @property
    def module(self) -> nn.Module:
        return _alive(self._module)

    @property
    def forward_hooks(self) -> list:
        """The hooks' handles; ``handle.remove()`` takes one off."""
        return _alive(self._coordinator).hooks.handles

    @forward_hooks.setter
    def forward_hooks(self, handles: list) -> None:
        """``[]`` once the handles are removed (TRL's ``remove_hooks``): the rest of stage 3's
        hold on the model goes too (the reads of released parameters, stage 3's linear), so the
        model is a plain module until :meth:`_register_deepspeed_module`."""
        if list(handles):
            raise ValueError("parameter_offload.forward_hooks: only [] can be set (hooks off)")
        _alive(self._coordinator).hooks.detach()

    def _register_deepspeed_module(self, module: nn.Module) -> None:
        """Put every hook back on the engine's model (after they were taken off)."""
        if module is not self.module:
            raise ValueError(
                "_register_deepspeed_module: zerostack hooks the engine's own model only "
                f"(got a {type(module).__name__}, the engine has a {type(self.module).__name__})"
            )
        _alive(self._coordinator).hooks.attach()


__all__ = ["DeepSpeedZeRoOffload", "PartitionedParameterCoordinator"]
