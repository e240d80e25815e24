"""The stepped masters of ZeRO stage 3 back into this rank's compute-dtype pieces.

Each (sub-)group's fp32 values go into its pieces: one copy into the group's flat pieces (up
from host memory when offloaded, without blocking), or parameter by parameter where a piece
lives in a file or in host memory (offload_param). Persistent parameters, kept whole on every
rank, are gathered again from the new pieces (a collective over dp).
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm import Comm
from ..offload.host import Uploads
from ..offload.param_swap import ParamSwapper, ResidentPieces
from .gather import gather_now
from .groups import Group
from .params import StorageMeter


class Stage3WriteBack:
    """The write-back of ``groups`` (the strategy's list, filled as it is built): the masters'
    ``store`` says whether they live in memory, ``swapper`` where the pieces live, ``uploads``
    brings offloaded masters up; ``persistent`` are the parameters kept whole (of which
    ``trainable`` ones change at each step)."""

    def __init__(
        self,
        groups: list[Group],
        *,
        persistent: list[nn.Parameter],
        trainable: set[nn.Parameter],
        store,
        swapper: ParamSwapper | ResidentPieces,
        uploads: Uploads,
        comm: Comm,
        meter: StorageMeter,
    ) -> None:
        self.groups, self.store, self.swapper, self.uploads = groups, store, swapper, uploads
        self.comm, self.meter = comm, meter
        self.stepped = [p for p in persistent if p in trainable]  # refreshed after each step
        self.frozen = [p for p in persistent if p not in trainable]  # refreshed after a load

    def write(self, g: Group, value: torch.Tensor) -> None:
        """The stepped fp32 values of a (sub-)group into its compute-dtype pieces (or files)."""
        if g.pieces is not None:  # one flat buffer (no piece of the group is swapped out)
            self.uploads.copy(g.master, g.pieces, value)
            return
        off = 0
        for p in g.params:
            pn = p._zs.piece.numel()
            if self.swapper.holds(p):
                self.swapper.update(p, value[off : off + pn])
            else:
                self.uploads.copy(p, p._zs.piece, value[off : off + pn])
            off += pn

    def finish(self) -> None:
        """After the optimizer step: masters in memory into the pieces they do not share
        storage with (in files each sub-group was written while it was in memory), then the
        trained persistent parameters gathered again."""
        for g in self.groups:
            if self.store.in_memory and g.separate_master:
                self.write(g, g.master.detach())
        self.refresh(self.stepped)

    def refresh(self, params: list[nn.Parameter]) -> None:
        """Gather ``params`` (persistent ones) whole again from their pieces."""
        gather_now(params, self.comm, self.meter)
