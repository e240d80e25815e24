"""One coalesced gather of some stage-3 parameters, in flight until :meth:`UnitGather.resolve`.

The pieces are read from NVMe first when the parameters are offloaded (``offload_param``): on a
GPU they go up on the swapper's side stream and are gathered from there, so the copies overlap
the compute queued next. ZeRO++'s hpZ gathers from the secondary pieces within a subgroup, and
a gather of primary pieces leaves each parameter its secondary piece. The coordinator
(:mod:`.coordinator`) decides which parameters are gathered when; this is how.
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm import Comm
from ..offload.param_swap import ParamSwapper, ResidentPieces
from .collectives import Subgroup, gather_full, secondary_piece
from .params import StorageMeter, hold


class UnitGather:
    """An in-flight coalesced all-gather of some parameters (their pieces read from NVMe first
    when the parameters are offloaded). ZeRO++ hpZ: ``from_secondary`` gathers the parameters'
    secondary pieces within the subgroup ``hpz`` instead; otherwise, with ``hpz``, each
    parameter keeps its secondary piece of what was gathered."""

    def __init__(
        self,
        params: list[nn.Parameter],
        comm: Comm,
        meter: StorageMeter,
        swapper: ParamSwapper | ResidentPieces,
        quantized: bool = False,
        hpz: Subgroup | None = None,
        from_secondary: bool = False,
    ) -> None:
        self.params = params
        self.meter = meter
        self.keep = hpz if not from_secondary else None
        states = [p._zs for p in params]
        self._ready = None  # the side stream's event behind the gather (offloaded, on a GPU)
        side = swapper.stream if swapper.offloads and not from_secondary else None
        if from_secondary:  # the pieces are not needed (nor read from NVMe)
            self._finish = gather_full(states, comm, async_op=True, secondary=hpz)
        elif side is None:
            swapper.fetch(params)
            self._finish = gather_full(states, comm, async_op=True, quantized=quantized)
            swapper.drop(params)  # the collective has its own copy (or, at dp = 1, the views)
        else:
            # Offloaded pieces go up on a side stream, after what is queued so far (the pieces'
            # last writes, the memory freed before), and are gathered from there: the copies
            # overlap the compute queued next; resolve() waits for them where it runs.
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                swapper.fetch(params)
                self._finish = gather_full(
                    states, comm, async_op=True, quantized=quantized, record=True
                )
                swapper.drop(params)
            self._ready = side.record_event()
        self.done = False

    def resolve(self) -> None:
        if self.done:
            return
        if self._ready is not None:
            torch.cuda.current_stream().wait_event(self._ready)
        for p, full in zip(self.params, self._finish(), strict=True):
            if self._ready is not None:  # made on the side stream, used (and freed) on this one
                full.record_stream(torch.cuda.current_stream())
            # a piece held by one rank alone: the "gathered" tensor is a view of it
            hold(p, full, self.meter, p._zs.world > 1)
            if self.keep is not None and p._zs.secondary is None:
                p._zs.secondary = secondary_piece(full, self.keep)
                self.meter.add(p._zs.secondary.nbytes)
        self.done = True
        self._finish = None  # the receive buffer: the parameters hold their own copies


def gather_now(params: list[nn.Parameter], comm: Comm, meter: StorageMeter) -> None:
    """Gather ``params`` and hold them (persistent ones, after their pieces changed)."""
    if params:
        UnitGather(params, comm, meter, ResidentPieces()).resolve()


class Gatherer:
    """How the coordinator's gathers are made: ZeRO++ qwZ's int8 gathers (``quantized``), and
    hpZ (``hpz``): a training pass's gathers over dp leave each parameter its secondary piece of
    the subgroup's partition, and a gather of parameters that all have one stays within the
    subgroup. The secondary pieces last one forward and backward (the weights change next)."""

    def __init__(
        self,
        comm: Comm,
        meter: StorageMeter,
        swapper: ParamSwapper | ResidentPieces,
        quantized: bool = False,
        hpz: Subgroup | None = None,
    ) -> None:
        self.comm, self.meter, self.param_swapper = comm, meter, swapper
        self.quantized, self.hpz = quantized, hpz
        self._secondaries: set[nn.Parameter] = set()

    def launch(self, params: list[nn.Parameter], training: bool) -> UnitGather:
        """The gather of ``params``: within the hpZ subgroup when every one has its secondary
        piece; over dp otherwise, leaving them their secondary pieces in a training pass."""
        hpz = self.hpz if training else None
        if hpz is None:
            return UnitGather(params, self.comm, self.meter, self.param_swapper, self.quantized)
        from_secondary = all(p._zs.secondary is not None for p in params)
        self._secondaries.update(params)
        return UnitGather(
            params,
            self.comm,
            self.meter,
            self.param_swapper,
            self.quantized,
            hpz=hpz,
            from_secondary=from_secondary,
        )

    def drop_secondaries(self) -> None:
        for p in self._secondaries:
            if p._zs.secondary is not None:
                self.meter.sub(p._zs.secondary.nbytes)
                p._zs.secondary = None
        self._secondaries.clear()
