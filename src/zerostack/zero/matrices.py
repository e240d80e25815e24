"""Where the pieces of the masters meet as whole matrices: Muon's orthogonalisation
(:mod:`zerostack.optim.muon`) needs each weight matrix whole, and under ZeRO a rank's master
holds pieces of several.

A stage describes each master it hands the optimizer as the parameters it holds part of, each
parameter as ``(rank, lo, hi)`` runs in the parameter's flat order (rank ``rank``'s master
holds that run at ``[lo, hi)``; every rank's master has the same length and layout). At the
step, the tensor the optimizer gives (a master-shaped look-ahead) is all-gathered over the
master's axis, on the compute device (an offloaded master's too), each matrix this rank holds
part of is put together and transformed whole, and this rank's runs of the results come back
in the master's shape, where the master is. Every rank of the axis transforms the matrices it
touches; a matrix cut over two ranks is transformed on both, which gives both the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..comm import Comm

Run = tuple[int, int, int]  # (rank, lo, hi): the rank's master holds the run at [lo, hi)


@dataclass(frozen=True)
class _Master:
    axis: str
    world: int
    rank: int
    matrices: tuple[tuple[torch.Size, tuple[Run, ...]], ...]


class MatrixPieces:
    """The masters of one model whose elements are pieces of matrices (see the module)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._masters: dict[torch.Tensor, _Master] = {}

    def add(self, master, *, axis: str, world: int, rank: int, matrices) -> None:
        """``master`` (this rank's) holds parts of ``matrices``: ``(shape, runs)`` each, the
        runs in the parameter's flat order; its ``world`` ranks on ``axis``, this one ``rank``."""
        matrices = tuple((torch.Size(s), tuple(runs)) for s, runs in matrices)
        for shape, runs in matrices:
            if sum(hi - lo for _, lo, hi in runs) != shape.numel():
                raise ValueError(f"the runs of a {tuple(shape)} matrix do not cover it")
        self._masters[master] = _Master(axis, world, rank, matrices)

    def holds(self, master) -> bool:
        return master in self._masters

    def apply(
        self, master, value: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``fn`` of each whole matrix ``value`` (shaped as ``master``) holds part of, this
        rank's parts of the results in ``value``'s shape and place (padding 0). A collective
        over the master's axis when it is cut."""
        m = self._masters[master]
        device = self.comm.topo.device
        flat = value.detach().reshape(-1).to(device)
        if m.world > 1:
            gathered = torch.empty(m.world * flat.numel(), dtype=flat.dtype, device=device)
            self.comm.all_gather(gathered, flat, axis=m.axis)
            rows = gathered.view(m.world, -1)
        else:
            rows = flat.view(1, -1)
        out = torch.zeros_like(flat)
        for shape, runs in m.matrices:
            if not any(r == m.rank for r, _, _ in runs):
                continue
            whole = torch.cat([rows[r, lo:hi] for r, lo, hi in runs]).view(shape)
            done = fn(whole).reshape(-1)
            at = 0
            for r, lo, hi in runs:
                if r == m.rank:
                    out[lo:hi] = done[at : at + hi - lo]
                at += hi - lo
        return out.view(value.shape).to(value.device)
