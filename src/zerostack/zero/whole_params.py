"""Where the pieces of the masters meet as whole parameters: Muon's orthogonalisation
(:mod:`zerostack.optim.muon`) needs each weight matrix whole, LAMB's trust ratio
(:mod:`zerostack.optim.lamb`) each parameter's norms, and under ZeRO a rank's master holds
pieces of several parameters.

A stage describes each master it hands the optimizer as the parameters it holds part of, each
parameter as ``(rank, lo, hi)`` runs in the parameter's flat order (rank ``rank``'s master
holds that run at ``[lo, hi)``; every rank's master has the same length and layout).

- :meth:`WholeParams.apply`: the tensor the optimizer gives (master-shaped) is all-gathered over
  the master's axis, on the compute device (an offloaded master's too), each parameter this rank
  holds part of is put together and transformed whole, and this rank's runs of the results come
  back in the master's shape, where the master is. A parameter cut over two ranks is
  transformed on both, which gives both the same bits.
- :meth:`WholeParams.norms`: each parameter's norm, its squares summed over this rank's runs and
  all-reduced (one small vector per master), spread over the parameter's elements.

Under tensor parallelism a rank's parameter is its tp slice: the slices of a split parameter are
all-gathered over the tp axis and joined (``split``'s ``(dim, chunks)`` of the parameter, the
engine's ``join`` and ``cut`` functions: the tensor-parallel package's), the whole is
transformed, and this rank's slice of the result kept; a norm's squares are summed over tp too
(a replicated parameter's are not). Every tp rank gathers every split parameter of its masters,
in the masters' order, whether its own pieces touch it or not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..comm import Comm

Run = tuple[int, int, int]  # (rank, lo, hi): the rank's master holds the run at [lo, hi)


Spec = tuple[int, int] | None  # a tp-split parameter's (dim, chunks); None: whole on every rank


@dataclass(frozen=True)
class _Matrix:
    shape: torch.Size
    runs: tuple[Run, ...]  # every rank's, in the parameter's flat order
    mine: tuple[tuple[int, int, int], ...]  # this rank's: (lo, hi, where in the parameter)
    spec: Spec


@dataclass(frozen=True)
class _Master:
    axis: str
    world: int
    matrices: tuple[_Matrix, ...]


class WholeParams:
    """The masters of one model, as pieces of its parameters (see the module).
    ``split(p)``: parameter ``p``'s tp split (None for every parameter without tp), ``join``
    and ``cut``: whole from the tp slices and a tp slice from the whole."""

    def __init__(self, comm: Comm, *, split: Callable = lambda p: None, join=None, cut=None):
        self.comm, self._split, self._join, self._cut = comm, split, join, cut
        self._masters: dict[torch.Tensor, _Master] = {}

    def add(self, master, *, axis: str, world: int, rank: int, matrices) -> None:
        """``master`` (this rank's) holds parts of ``matrices``: ``(param, shape, runs)`` each,
        the runs in the parameter's flat order; its ``world`` ranks on ``axis``, this one
        ``rank``."""
        out = []
        for p, shape, runs in matrices:
            shape = torch.Size(shape)
            if sum(hi - lo for _, lo, hi in runs) != shape.numel():
                raise ValueError(f"the runs of a {tuple(shape)} matrix do not cover it")
            mine, at = [], 0  # this rank's runs, each with where it starts in the parameter
            for r, lo, hi in runs:
                if r == rank:
                    mine.append((lo, hi, at))
                at += hi - lo
            spec = self._split(p) if self.comm.topo.tp > 1 else None
            out.append(_Matrix(shape, tuple(runs), tuple(mine), spec))
        self._masters[master] = _Master(axis, world, tuple(out))

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
        for mat in m.matrices:
            spec = mat.spec
            if not mat.mine and spec is None:
                continue
            whole = torch.cat([rows[r, lo:hi] for r, lo, hi in mat.runs]).view(mat.shape)
            if spec is not None:  # this rank's tp slice: the others' joined to it
                whole = self._tp_whole(whole, spec)
            if not mat.mine:
                continue
            done = fn(whole)
            if spec is not None:
                done = self._cut(done, parts=self.comm.topo.tp, rank=self.comm.topo.rank("tp"),
                                 dim=spec[0], chunks=spec[1])  # fmt: skip
            done = done.reshape(-1)
            for lo, hi, at in mat.mine:
                out[lo:hi] = done[at : at + hi - lo]
        return out.view(value.shape).to(value.device)

    def norms(self, master, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """For each of ``values`` (shaped as ``master``): a tensor of its shape whose elements
        hold the norm of the whole parameter they belong to (padding 0). Collectives over the
        master's axis (when cut) and tp (when > 1)."""
        m = self._masters[master]
        device, home = self.comm.topo.device, values[0].device
        flats = [v.detach().reshape(-1) for v in values]  # summed where they are (the host's
        # when offloaded): only the small vector of sums goes to the compute device
        sums = torch.zeros(len(flats), len(m.matrices), dtype=torch.float32, device=home)
        for j, mat in enumerate(m.matrices):
            for lo, hi, _ in mat.mine:
                for i, f in enumerate(flats):
                    sums[i, j] += f[lo:hi].float().square().sum()
        sums = sums.to(device)
        if m.world > 1:
            self.comm.all_reduce(sums, axis=m.axis)
        if self.comm.topo.tp > 1:
            split = torch.tensor([mat.spec is not None for mat in m.matrices], device=device)
            cut = sums * split
            self.comm.all_reduce(cut, axis="tp")
            sums = torch.where(split, cut, sums)
        norms = sums.sqrt().to(home)
        out = [torch.zeros(f.numel(), dtype=torch.float32, device=home) for f in flats]
        for j, mat in enumerate(m.matrices):
            for lo, hi, _ in mat.mine:
                for i in range(len(flats)):
                    out[i][lo:hi] = norms[i, j]
        return [o.view(v.shape) for o, v in zip(out, values, strict=True)]

    def _tp_whole(self, local: torch.Tensor, spec: tuple[int, int]) -> torch.Tensor:
        """The whole matrix from every tp rank's slice (``local`` this rank's)."""
        tp = self.comm.topo.tp
        out = torch.empty(tp * local.numel(), dtype=local.dtype, device=local.device)
        self.comm.all_gather(out, local.reshape(-1), axis="tp")
        slices = list(out.view(tp, *local.shape).unbind(0))
        return self._join(slices, dim=spec[0], chunks=spec[1])
