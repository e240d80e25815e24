"""DeepSpeed's ``deepspeed.utils`` tensor helpers: a parameter's full fp32 value, gradient and
optimizer state, at any ZeRO stage, with tensor parallelism and offloaded optimizers::

    import zerostack as deepspeed
    from zerostack.utils import safe_get_full_fp32_param, safe_get_full_grad

    loss = engine(x, y)
    engine.backward(loss)
    for name, p in engine.module.named_parameters():   # every rank, every parameter
        w = safe_get_full_fp32_param(p)                  # the whole fp32 master
        g = safe_get_full_grad(p)                        # the whole gradient, dp-averaged
    engine.step()

As in DeepSpeed: the getters are collectives (every rank holding the parameter calls them, in the
same order) and return None for a parameter no engine trains or the optimizer does not step
(a frozen one); setters take the whole value, the same on every rank. "Full" means the parameter
as the model defines it: the ZeRO pieces put together and the tensor-parallel slices joined.

Two differences, both on the side of saying what the model trains on:

* ``safe_get_full_grad`` is the mean gradient over the global batch so far in the accumulation
  window, unscaled, at every stage (DeepSpeed returns ``param.grad`` where one exists, which at
  stages 0-1 is this rank's unreduced gradient, and in fp16 a loss-scaled one).
* ``safe_set_full_fp32_param`` sets the compute-dtype parameter too, so the next forward uses
  the new value (DeepSpeed writes only the fp32 master, which reaches the model at the next step).

``safe_set_full_grad`` takes a gradient in the same terms as ``safe_get_full_grad`` gives it
(the mean, unscaled): set between ``engine.backward`` and ``engine.step`` on the boundary, the
step applies it as if backward had produced it (clipping included); set earlier in the window,
later micro-batches add to it. At stages 0-1 DeepSpeed writes ``param.grad`` (this rank's
unreduced gradient); here the value is the gradient the step sees, at every stage.

The ``safe_*_local_*`` getters and setters take this rank's ZeRO-3 piece (padding included) and,
as in DeepSpeed, refuse other stages. ``safe_set_local_fp32_param`` is a collective over dp
(every rank sets its own piece), so that the next forward uses the value, as
``safe_set_full_fp32_param``; the other local setters need no communication.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from .engine.full_params import engine_of

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]


def _access(param: torch.Tensor):
    engine = engine_of(param)
    return None if engine is None else engine.full_params


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 master value of ``param`` (a collective), on the engine's device."""
    access = _access(param)
    return None if access is None else access.value(param, what="safe_get_full_fp32_param")


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set ``param``'s fp32 master and its compute-dtype value to the whole ``value``."""
    access = _access(param)
    if access is not None:
        access.set_value(param, value, what="safe_set_full_fp32_param")


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str):
    """The whole fp32 optimizer state ``optim_state_key`` of ``param`` (e.g. Adam's
    ``"exp_avg"``), a collective; KeyError if the optimizer keeps no such state."""
    access = _access(param)
    if access is None:
        return None
    return access.value(param, optim_state_key, what="safe_get_full_optimizer_state")


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str):
    """Set ``param``'s optimizer state ``optim_state_key`` to the whole ``value``."""
    access = _access(param)
    if access is not None:
        access.set_value(param, value, optim_state_key, what="safe_set_full_optimizer_state")


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole gradient of ``param`` so far in this accumulation window, averaged over the
    global batch and unscaled, in fp32 (a collective). Call it between ``engine.backward`` and
    ``engine.step``: at stage 3 ``param.grad`` is None there, the gradient lives in pieces."""
    access = _access(param)
    return None if access is None else access.grad(param)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set ``param``'s gradient so far in this accumulation window to the whole ``value`` (the
    mean over the global batch, unscaled, the same on every rank), as :func:`safe_get_full_grad`
    reads it. Between ``engine.backward`` and ``engine.step`` on the boundary it is the gradient
    the step applies; earlier, later micro-batches add to it. A collective at stages 0-1."""
    access = _access(param)
    if access is not None:
        access.set_grad(param, value, what="safe_set_full_grad")


def safe_update_full_grad_vectorized(
    param_list: Iterable[torch.Tensor],
    update_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> None:
    """For each parameter, set its full gradient to ``update_func(full_grad, param)`` (a
    collective; parameters no engine trains are skipped)."""
    for p in param_list:
        grad = safe_get_full_grad(p)
        if grad is not None:
            safe_set_full_grad(p, update_func(grad, p))


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's piece of ``param``'s fp32 master (ZeRO stage 3 only)."""
    access = _access(param)
    return None if access is None else access.local_value(param, what="safe_get_local_fp32_param")


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str):
    """This rank's piece of ``param``'s optimizer state ``optim_state_key`` (stage 3 only)."""
    access = _access(param)
    if access is None:
        return None
    return access.local_value(param, optim_state_key, what="safe_get_local_optimizer_state")


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's piece of :func:`safe_get_full_grad` (stage 3 only)."""
    access = _access(param)
    return None if access is None else access.local_grad(param, what="safe_get_local_grad")


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's piece of ``param``'s fp32 master, and the model's weights, to ``value``
    (stage 3; as :func:`safe_get_local_fp32_param` gives it). A collective over dp."""
    access = _access(param)
    if access is not None:
        access.set_local_value(param, value, "master", what="safe_set_local_fp32_param")


def safe_set_local_optimizer_state(
    param: torch.Tensor, value: torch.Tensor, optim_state_key: str
) -> None:
    """Set this rank's piece of ``param``'s optimizer state ``optim_state_key`` (stage 3)."""
    access = _access(param)
    if access is not None:
        what = "safe_set_local_optimizer_state"
        access.set_local_value(param, value, optim_state_key, what=what)


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's piece of ``param``'s gradient (stage 3; mean and unscaled, as
    :func:`safe_get_local_grad` gives it)."""
    access = _access(param)
    if access is not None:
        access.set_local_grad(param, value, what="safe_set_local_grad")
