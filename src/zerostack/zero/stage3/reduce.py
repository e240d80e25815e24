"""Stage 3's gradient reduction: full gradients staged into buckets, reduce-scattered to pieces.

At stage 3 every parameter already is ``dp`` equal pieces (:mod:`..init`), so a bucket (a few
modules' parameters, :class:`~..partition.PieceBuckets`) is staged as a ``(dp, width)`` matrix whose
row ``r`` holds every parameter's ``r``-th piece; one reduce-scatter hands each rank its row. A
parameter's full gradient is copied into the matrix and dropped as soon as backward produces it;
the :class:`~..reducer.GradReducer` launches each bucket, in order, once all its parameters
arrived, and ``deliver([(param, piece), ...], final)`` receives each bucket's reduced row as soon
as its collective is waited for: at most two buckets are in flight, so the reduced rows do not
pile up until the end of backward (at dp = 1 the row is delivered when the bucket is launched:
there is nothing to reduce). ``final`` says whether the row is the accumulation window's last
(:attr:`PieceReducer.final`, set for each backward). Rows bound for host memory (an offloaded
optimizer) come down without stopping the host (:class:`~..offload.host.Downloads`) and are
delivered once settled.

With ZeRO++'s quantized gradients (qgZ, ``zero_quantized_gradients``) the reduce-scatter is an
all-to-all of int8 (or, with ``zero_quantized_gradients_bits: 4``, int4) blocks
(:mod:`.quantize`, each parameter's piece quantized on its own): rank ``s`` sends row ``r`` of
its matrix, quantized, to rank ``r``, which dequantizes the ``dp`` rows it receives and sums
them in fp32, in rank order. Each rank's contribution is off by at most half
a step of its block's scale; nothing carries the error to the next step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ...comm import Comm, Handle
from ...core import scratch
from ..offload.host import Downloads
from ..partition import PieceBuckets
from ..reducer import GradReducer
from . import quantize

Deliver = Callable[[list[tuple[nn.Parameter, torch.Tensor]], bool], None]


class PieceReducer:
    """Buckets of stage-3 gradients, staged, reduce-scattered asynchronously, delivered."""

    def __init__(
        self,
        units: list[list[nn.Parameter]],
        *,
        comm: Comm,
        axis: str = "dp",
        dtype: torch.dtype,
        prescale: float,
        bucket_numel: int,
        deliver: Deliver,
        to: torch.device,
        quantized: bool = False,
        bits: int = 8,
        downloads: Downloads | None = None,
    ) -> None:
        """``units``: the parameters each bucket keeps together (a module's), in launch order;
        ``axis``: the grid axis whose ranks hold their pieces; ``dtype``: the one gradients are
        reduced in (``communication_data_type``); ``to``: where the reduced pieces are delivered
        (the host when the gradients are)."""
        self.comm, self.dtype, self.prescale, self.deliver = comm, dtype, prescale, deliver
        self.to, self.quantized, self.bits = to, quantized, bits
        self.downloads = downloads or Downloads(torch.device("cpu"))
        self.final = True  # this backward is its window's last
        self.axis, self.dp = axis, comm.topo.size(axis)  # dp: the ranks reduced over
        units = [unit for unit in units if unit]
        order = [p for unit in units for p in unit]
        index = {p: i for i, p in enumerate(order)}
        layout = PieceBuckets.build(
            [[index[p] for p in unit] for unit in units],
            piece=[p._zs.piece.numel() for p in order],
            world=self.dp,
            bucket_numel=bucket_numel,
        )
        self.params = [[order[i] for i in items] for items in layout.items]
        self.width = layout.width
        self.bucket = {order[i]: b for i, b in layout.bucket.items()}
        self.at = {order[i]: at for i, at in layout.at.items()}
        self.reducer = GradReducer([len(ps) for ps in self.params], self._launch, self._done)
        # A backward's staging matrices, received rows and reduced rows (on the CPU; a GPU's
        # caching allocator reuses blocks itself): the same few serve every bucket, so their
        # pages are faulted in once a backward, not once a bucket. Emptied as it ends.
        self.buffers = scratch.Pool()
        self._reset()

    def _reset(self) -> None:
        self._staging: dict[int, torch.Tensor] = {}
        self._filled: dict[int, set[nn.Parameter]] = {}  # bucket -> the parameters staged
        self._sent: dict[int, torch.Tensor] = {}  # bucket -> its staging, until reduced
        self._reduced: dict[int, torch.Tensor] = {}  # bucket -> this rank's pieces, in flight

    def stage(self, p: nn.Parameter) -> None:
        """Copy p's full gradient into its bucket, as pieces, and drop it."""
        b = self.bucket[p]
        if b not in self._staging:  # in the dtype it is reduced in; zeroed where not staged
            self._staging[b] = self._take_staging(b, p.device)
            self._filled[b] = set()
        self._filled[b].add(p)
        at, pn = self.at[p], p._zs.piece.numel()
        grad = p.grad.reshape(-1)
        if grad.numel() != pn * self.dp:  # pad to whole pieces first
            grad = torch.cat([grad, grad.new_zeros(pn * self.dp - grad.numel())])
        self._staging[b][:, at : at + pn].copy_(grad.view(self.dp, pn))
        p.grad = None  # the full gradient does not outlive this hook

    def arrived(self, p: nn.Parameter) -> None:
        """p is staged: launch the buckets that are complete, in order."""
        self.reducer.arrived(self.bucket[p])

    def _take_staging(self, b: int, device: torch.device) -> torch.Tensor:
        """Bucket ``b``'s ``(dp, width)`` matrix, its contents undefined: a parameter's columns
        are written when it is staged (its padding as zeros), or zeroed at the launch."""
        return self.buffers.take(self.dp * self.width[b], self.dtype, device).view(self.dp, -1)

    def _launch(self, b: int) -> Handle | None:
        staging = self._staging.pop(b, None)
        filled = self._filled.pop(b, set())
        if staging is None:  # no parameter of this bucket got a gradient in this backward
            staging = self._take_staging(b, self.comm.topo.device)
        for p in self.params[b]:
            if p not in filled:  # no gradient in this backward: zeros
                staging[:, self.at[p] : self.at[p] + p._zs.piece.numel()].zero_()
        if self.prescale != 1.0:
            staging.mul_(self.prescale)
        if self.dp == 1:  # nothing to reduce: delivered now
            self._deliver(b, staging.view(-1))
            return None
        if self.quantized:
            sent = torch.stack([quantize.pack(self._pieces(b, row), self.bits) for row in staging])
            received = self._reduced[b] = torch.empty_like(sent)
            return self.comm.all_to_all(received, sent, axis=self.axis, async_op=True)
        self._sent[b] = staging
        out = self._reduced[b] = self.buffers.take(self.width[b], staging.dtype, staging.device)
        return self.comm.reduce_scatter(
            out, staging.view(-1), axis=self.axis, async_op=True, pool=self.buffers
        )

    def _pieces(self, b: int, row: torch.Tensor) -> list[torch.Tensor]:
        """Bucket ``b``'s parameters' pieces in ``row``, in bucket order."""
        return [row[self.at[p] : self.at[p] + p._zs.piece.numel()] for p in self.params[b]]

    def _summed(self, b: int, received: torch.Tensor) -> torch.Tensor:
        """This rank's row of bucket ``b`` from the ``dp`` quantized rows it received: each
        dequantized, summed in fp32 in rank order."""
        numels = [p._zs.piece.numel() for p in self.params[b]]
        out = torch.zeros(self.width[b], dtype=self.dtype, device=received.device)
        for piece, rows in zip(
            self._pieces(b, out),
            quantize.unpack(received, numels, torch.float32, self.bits),
            strict=True,
        ):
            total = rows[0].clone()
            for r in range(1, self.dp):
                total += rows[r]
            piece.copy_(total)
        return out

    def _done(self, b: int) -> None:
        """Bucket ``b``'s collective is complete: deliver its row; its buffers go (back to the
        pool, but for a row still on its way to the host)."""
        self.buffers.give(self._sent.pop(b, None))
        out = self._reduced.pop(b, None)
        if out is not None:
            self._deliver(b, self._summed(b, out) if self.quantized and self.dp > 1 else out)
            if out.device == self.to:  # added into the gradients: read no more
                self.buffers.give(out)

    def _deliver(self, b: int, out: torch.Tensor) -> None:
        final = self.final
        if out.device == self.to:
            self._hand(b, out, final)
            return
        self.downloads.settle_sealed()  # the last micro-step's: done long ago
        self.downloads.fetch(out, lambda host: self._hand(b, host, final))

    def _hand(self, b: int, out: torch.Tensor, final: bool) -> None:
        pieces = [(p, out[self.at[p] : self.at[p] + p._zs.piece.numel()]) for p in self.params[b]]
        self.deliver(pieces, final)

    def finish(self) -> None:
        """Launch what is left, wait for every bucket, deliver, and start afresh."""
        self.reducer.flush()  # each bucket is delivered as it completes (``_done``)
        self.downloads.seal()
        self._reset()
        self.buffers.trim(0)  # nothing kept between backwards


def piece_reducers(
    units: list[list[nn.Parameter]], *, comm: Comm, prescale: float, **options
) -> dict[str, PieceReducer]:
    """One :class:`PieceReducer` per axis the ``units``' parameters are cut over (``p._zs.axis``:
    'dp', and with expert parallelism 'dp_ep' for what every ep rank holds), each prescaled so
    that its sum times the stage's one ``grad_post`` (``1 / (loss scale * prescale * dp)``) is
    the mean; in axis order, so every rank finishes them in one order."""
    axes = sorted({p._zs.axis for unit in units for p in unit} | {"dp"})
    return {
        axis: PieceReducer(
            [[p for p in unit if p._zs.axis == axis] for unit in units],
            comm=comm,
            axis=axis,
            prescale=prescale * comm.topo.dp / comm.topo.size(axis),
            **options,
        )
        for axis in axes
    }
