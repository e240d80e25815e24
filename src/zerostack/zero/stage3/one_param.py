"""One parameter of ZeRO stage 3, whole or as this rank's piece: what DeepSpeed's
``safe_get_full_*`` / ``safe_set_full_*`` and ``safe_get_local_*`` reach through
:mod:`zerostack.engine.full_params` (the strategy's ``window_grad``, ``write_param``, ...).

After backward ``p.grad`` is None: the gradient is in this rank's pieces (a shard in memory, or
files beside the masters on NVMe), summed over dp and scaled as the masters get it. The value is
the compute-dtype piece (in memory, or in its file with offload_param) and, for a persistent
parameter, the whole copy every rank keeps.
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm import Comm
from ..offload.host import Downloads
from ..offload.param_swap import ParamSwapper, ResidentPieces
from .collectives import gather_full


class OneParam:
    """One parameter's gradient and value at stage 3: ``grads`` holds the gradient pieces
    (``downloads`` brings reduced rows down to offloaded ones), ``swapper`` says where the
    value's piece lives."""

    def __init__(
        self, *, comm: Comm, grads, downloads: Downloads, swapper: ParamSwapper | ResidentPieces
    ) -> None:
        self.comm, self.grads, self.downloads, self.swapper = comm, grads, downloads, swapper

    def window_grad(self, p: nn.Parameter) -> torch.Tensor:
        """``p``'s gradient so far in this accumulation window, whole and flat in fp32, summed
        over dp and scaled as its master gets it (times the strategy's ``grad_post`` is the
        mean): every rank's piece, all-gathered (a collective over dp)."""
        st = p._zs
        self.downloads.settle()
        piece = self.grads.piece(p).to(device=self.comm.topo.device, dtype=torch.float32)
        return gather_full([st.like(piece)], self.comm)[0].reshape(-1)

    def local_grad(self, p: nn.Parameter) -> torch.Tensor:
        """This rank's piece of ``p``'s gradient (padding included), summed and scaled."""
        self.downloads.settle()
        return self.grads.piece(p).to(torch.float32, copy=True)

    def hold_grad(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Make ``value`` (flat fp32, summed over dp and scaled, as :meth:`window_grad` gives
        it) ``p``'s gradient in this window: this rank's piece of it."""
        self.hold_local_grad(p, self.own_piece(p, value))

    def hold_local_grad(self, p: nn.Parameter, piece: torch.Tensor) -> None:
        """Make ``piece`` (this rank's, padded, summed and scaled as :meth:`local_grad`
        gives it) ``p``'s gradient piece, in its shard or its file."""
        lo, hi = p._zs.extent()
        piece = piece.to(torch.float32, copy=True)
        piece[hi - lo :] = 0.0  # the padding is no part of the gradient
        self.grads.replace(p, piece)  # a shard in memory, or a file and its norm

    def own_piece(self, p: nn.Parameter, value: torch.Tensor) -> torch.Tensor:
        """This rank's piece (padded with zeros) of ``value``, ``p``'s whole flat value."""
        lo, hi = p._zs.extent()
        piece = torch.zeros(p._zs.piece.numel(), dtype=torch.float32, device=value.device)
        piece[: hi - lo] = value[lo:hi]
        return piece

    def write_param(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Set the compute-dtype parameter to ``value`` (flat, this rank's whole parameter):
        this rank's piece (in memory or its file), and the gathered copy a persistent one
        keeps."""
        st = p._zs
        piece = self.own_piece(p, value)
        if self.swapper.holds(p):  # its file (offload_param)
            self.swapper.update(p, piece)
        if st.piece.stride() != (0,):  # in memory (a swapped-out piece is a placeholder)
            st.write(piece)
        if st.gathered and p.numel() == st.numel:
            p.data.copy_(value.view_as(p))
