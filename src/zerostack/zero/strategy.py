"""The ZeRO strategy interface: what the engine (and the checkpointer) may ask of a stage.

A strategy owns a model's parameters, gradients and fp32 master weights for one ZeRO stage. The
engine drives one optimizer step through four calls::

    strategy.begin_backward(boundary)      # before each micro-step's backward
    strategy.end_backward()                # after it: finish this micro-step's reductions
    stats = strategy.reduce_grads(scale)   # on the boundary: gradients summed, into the masters
    strategy.step(optimizer, coef)         # masters' gradients times coef, step, write back
    strategy.zero_grad()

``coef`` is where averaging over dp, unscaling (fp16) and clipping meet: the engine's update
computes it from ``stats`` once (:meth:`zerostack.engine.update.BoundaryUpdate.apply`).
Stages 0-2 are :class:`~.flat.strategy.ShardedDataParallel`, stage 3 is
:class:`~.stage3.strategy.Stage3`; :func:`build_strategy` maps the config to one of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from ..comm import Comm
    from .stage3.coordinator import ParamCoordinator
    from .whole_params import WholeParams


def tally(held, by_device: bool = False) -> dict:
    """Sum ``(kind, device type, bytes)`` items per kind (params, grads, master, scratch: each
    present, zero or not), or per device type and then kind (only the places something is
    held). ``scratch``: buffers kept between steps for reuse (stages 1-2 on the CPU)."""
    kinds = {"params": 0, "grads": 0, "master": 0, "scratch": 0}
    if not by_device:
        for kind, _, nbytes in held:
            kinds[kind] += nbytes
        return kinds
    out: dict[str, dict[str, int]] = {}
    for kind, device, nbytes in held:
        out.setdefault(device, dict.fromkeys(kinds, 0))[kind] += nbytes
    return out


def sync_from_rank0(tensors: list[torch.Tensor], comm: Comm, dtype: torch.dtype) -> None:
    """Broadcast tensors the optimizer does not own (frozen parameters, buffers) from dp rank 0,
    so every rank starts alike, and cast the floating-point ones to the compute dtype."""
    for t in tensors:
        if comm.topo.dp > 1:
            comm.broadcast(t.data, src=0, axis="dp")
        if t.is_floating_point() and t.dtype != dtype:
            t.data = t.data.to(dtype)


@dataclass(frozen=True)
class GradStats:
    """What :meth:`ZeroStrategy.reduce_grads` reports about this rank's master gradients.

    ``sq``: the sum of squares of the gradient elements this rank counts (summed over dp and still
    loss-scaled); ``sharded``: whether other dp ranks count other elements (then ``sq`` must be
    summed over dp); ``post``: the factor that turns those gradients into the mean over the
    global batch, unscaled (1 / (loss scale * dp), the prescale undone)."""

    sq: torch.Tensor
    sharded: bool
    post: float


# The interface is split by client; :class:`ZeroStrategy` is every part all stages offer. Every
# member code outside ``zero/`` uses is declared on one of these (tests/test_architecture.py).


@runtime_checkable
class TrainStep(Protocol):
    """What the engine drives each step."""

    stage: int  # a label, for messages and reports: the behaviour is in the strategy's parts
    # MoE at ep > 1: the parameters every ep rank holds whose state is cut over dp x ep
    cut_over_ep: set[nn.Parameter] | frozenset
    # whether each backward reduces its gradients over dp as it ends (stages 2-3), so that a
    # pipeline brackets each of its backwards with begin_backward / end_backward
    reduces_each_backward: bool

    def optimizer_groups(self) -> list[dict]:
        """The groups the optimizer steps: fp32 master tensors, with the user's options."""

    def begin_backward(self, boundary: bool) -> None:
        """A micro-step's backward starts; ``boundary``: it closes an accumulation window."""

    def end_backward(self) -> None:
        """This micro-step's backward is done: finish what it reduces."""

    def reduce_grads(self, loss_scale: float, skip: set[nn.Parameter]) -> GradStats:
        """On the boundary: wait for every reduction and give each master its fp32 gradient;
        ``skip``: parameters another rank counts in the norm (tp replicas, tied copies)."""

    def step(self, optimizer, coef: float | torch.Tensor) -> None:
        """Multiply the masters' gradients by ``coef`` (a float, or a 0-dim tensor on the
        masters' device), step, and write the masters back into the compute-dtype parameters
        (all-gathered where sharded)."""

    def zero_grad(self) -> None:
        """Forget the gradients of this window."""


@runtime_checkable
class CheckpointView(Protocol):
    """What a checkpoint reads and writes (``zerostack.checkpoint``)."""

    owns_replica: bool  # whether this rank writes the state it holds in a checkpoint

    def full_master(self) -> dict[nn.Parameter, torch.Tensor]:
        """Every parameter's full fp32 value (a collective over dp)."""

    def masters(self) -> list[nn.Parameter]:
        """The optimizer's master tensors."""

    def group_params(self) -> list[list[nn.Parameter]]:
        """Each optimizer group's trained parameters, in the group's order."""

    def owned_slices(self) -> Iterator[tuple]:
        """``(param, lo, hi, master, a, b)``: elements ``[lo, hi)`` of the flattened parameter
        are ``master[a:b]`` on this rank."""

    def frozen_extents(self) -> Iterator[tuple]:
        """``(param, lo, hi)`` of :meth:`frozen_slices`, without touching the values."""

    def frozen_slices(self) -> Iterator[tuple]:
        """``(param, lo, hi, held)`` for the parameters no optimizer steps."""

    def master_kinds(self, master: nn.Parameter, optimizer) -> list[tuple[str, torch.dtype]]:
        """``(kind, dtype)`` of what :meth:`read_master` gives, nothing read."""

    def read_master(self, master: nn.Parameter, optimizer, kinds=()) -> dict[str, torch.Tensor]:
        """A master's value and optimizer state (from its file when on NVMe)."""

    def write_master(self, master: nn.Parameter, optimizer, values: dict) -> None:
        """Store what :meth:`read_master` gave, after a checkpoint filled it."""

    def after_load(self) -> None:
        """Loaded masters into the compute-dtype parameters (a collective)."""


@runtime_checkable
class ParamAccess(Protocol):
    """One parameter's value and gradient (``zerostack.utils``' safe_get_full_* /
    safe_set_full_*, through :mod:`zerostack.engine.full_params`)."""

    grads_sharded: bool  # whether each dp rank holds a different part of masters and gradients

    def is_trained(self, p: nn.Parameter) -> bool:
        """Whether the optimizer steps ``p``."""

    def state_axis(self, p: nn.Parameter) -> str | None:
        """The grid axis over which ``p``'s master is cut (None: every rank holds it whole)."""

    def grad_post(self, loss_scale: float) -> float:
        """The factor from the summed, scaled gradients to the mean over the global batch."""

    def window_grad(self, p: nn.Parameter) -> torch.Tensor:
        """``p``'s whole gradient so far in the window, fp32, flat, summed over dp and scaled
        (a collective over dp)."""

    def hold_grad(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Make ``value`` (as :meth:`window_grad` gives it) ``p``'s gradient in this window."""

    def write_param(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Set ``p``'s compute-dtype value (its master is written through ``write_master``)."""


@runtime_checkable
class ZeroStrategy(TrainStep, CheckpointView, ParamAccess, Protocol):
    """A ZeRO stage: every part above, and what it holds."""

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held: params, grads, master."""

    def describe_pieces(self, pieces: WholeParams) -> None:
        """Tell ``pieces`` which parts of which parameters each master holds (Muon)."""

    def held(self) -> Iterator[tuple[str, str, int]]:
        """``(kind, device type, bytes)`` of each buffer :meth:`memory_breakdown` counts."""

    def state_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(kind, tensor)`` of each buffer kept between steps (params, grads, master,
        scratch): what ``engine.offload_states()`` moves off the device."""

    def close(self) -> None:
        """Release what lives outside the process (NVMe files)."""


@runtime_checkable
class WholeGrads(Protocol):
    """What stages 0-2 offer besides: whole accumulated gradients (a pipeline's tied weights
    are summed between its stages on them)."""

    def accumulated_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """The tensor ``p``'s gradient is summed in over the window, if it is a full one."""


@runtime_checkable
class Pieces(Protocol):
    """What stage 3 offers besides: each parameter is cut into pieces, one per rank of its
    axis (``p._zs``: dp, or dp x ep for what every ep rank holds)."""

    def coordinator(self) -> ParamCoordinator:
        """The gathers around each module: their hooks (which RL code takes off and puts back)
        and the recorded order."""

    def local_grad(self, p: nn.Parameter) -> torch.Tensor:
        """This rank's piece of ``p``'s gradient (padding included), summed and scaled."""

    def hold_local_grad(self, p: nn.Parameter, piece: torch.Tensor) -> None:
        """Make ``piece`` (as :meth:`local_grad` gives it) this rank's gradient piece."""

    def release_gathered(self) -> None:
        """Release the parameters gathered ahead of use or kept for a reuse."""


class StepSequence:
    """The step calls of :class:`ZeroStrategy` in terms of a stage's own parts, shared by the
    stages: ``_prepare_step`` (masters get their gradients; returns ``post``), ``grad_norm_sq``,
    ``grads_sharded``, ``scale_grads``, ``step_optimizer``, ``write_back``."""

    boundary: bool = True

    def begin_backward(self, boundary: bool) -> None:
        self.boundary = boundary

    def reduce_grads(self, loss_scale: float, skip: set[nn.Parameter]) -> GradStats:
        post = self._prepare_step(loss_scale)
        return GradStats(self.grad_norm_sq(skip), self.grads_sharded, post)

    def step(self, optimizer, coef: float | torch.Tensor) -> None:
        if isinstance(coef, torch.Tensor) or coef != 1.0:  # a tensor is not read on the host
            self.scale_grads(coef)
        self.step_optimizer(optimizer)
        self.write_back()


class ForwardsCheckpointView:
    """:class:`CheckpointView`, ``close``, ``memory_breakdown``, ``held`` and ``state_tensors``
    answered by the strategy's ``checkpoint`` part, one call each: stages 0-2's
    :class:`~.flat.checkpoint.FlatCheckpoint`, stage 3's
    :class:`~.stage3.checkpoint.Stage3Checkpoint`."""

    checkpoint: Any

    @property
    def owns_replica(self) -> bool:
        return self.checkpoint.owns_replica

    def group_params(self) -> list[list[nn.Parameter]]:
        return self.checkpoint.group_params()

    def full_master(self) -> dict[nn.Parameter, torch.Tensor]:
        return self.checkpoint.full_master()

    def owned_slices(self):
        return self.checkpoint.owned_slices()

    def frozen_extents(self):
        return self.checkpoint.frozen_extents()

    def frozen_slices(self, writes: bool = True):
        return self.checkpoint.frozen_slices(writes)

    def read_master(self, master: nn.Parameter, optimizer, kinds=()) -> dict[str, torch.Tensor]:
        return self.checkpoint.read_master(master, optimizer, kinds)

    def master_kinds(self, master: nn.Parameter, optimizer) -> list[tuple[str, torch.dtype]]:
        return self.checkpoint.master_kinds(master, optimizer)

    def write_master(self, master: nn.Parameter, optimizer, values: dict) -> None:
        self.checkpoint.write_master(master, optimizer, values)

    def after_load(self) -> None:
        self.checkpoint.after_load()

    def close(self) -> None:
        self.checkpoint.close()

    def memory_breakdown(self) -> dict[str, int]:
        return self.checkpoint.memory_breakdown()

    def held(self):
        return self.checkpoint.held()

    def state_tensors(self):
        return self.checkpoint.state_tensors()
