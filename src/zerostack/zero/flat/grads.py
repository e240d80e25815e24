"""The gradient buffers of ZeRO stages 0-2: the one policy that tells the stages apart in backward.

Stages 0-2 are one strategy (:class:`~.strategy.ShardedDataParallel`: flat parameter
buffers and the fp32 masters of this rank's pieces, each flat group reduced and cut over the
ranks of its :class:`~.params.Cut`)
composed with one of two gradient buffers. Each is given the state it works on, the strategy's
:class:`~.buffers.FlatBuffers` (groups, buckets, the parameter index), and owns the
:class:`~..reducer.GradReducer` of those buckets. As backward accumulates each gradient, the
buffer takes it into its bucket, and the reducer starts the bucket's collective
(:meth:`GradBuffer.start_grad_sync`) once the bucket is complete, in bucket order on every
rank; :meth:`GradBuffer.finish_grad_sync` waits for what is left before the step (Megatron's
verbs).

============  ====================================  ==========================================
buffer        held over the accumulation window     reduced
============  ====================================  ==========================================
FullGrads     the full flat buffer                  on the boundary: all-reduced in place when
                                                    every rank holds the whole state (stage 0),
                                                    else reduce-scattered into this
                                                    rank's piece for the step (stage 1)
ShardedGrads  this rank's pieces (the shard)        every micro-step: the bucket's gradients
                                                    copied out (staging), the full-size ones
                                                    dropped, reduce-scattered, and the piece
                                                    added into the shard (stage 2)
============  ====================================  ==========================================

With :class:`ShardedGrads` the buffers a bucket needs for one micro-step (its staging, the
reduce-scatter's received rows, a piece) come from and go back to the buffers' ``pool``
(:class:`~...core.scratch.Pool`), so the same few bucket-sized buffers serve every bucket and
step. A bucket whose part of the shard is still zero since the last step (``st.shard_clean``;
the first micro-step of a window) is reduce-scattered straight into the shard when it is in the
reduce dtype: no piece, no add.

With ``reduce_scatter: false`` a bucket of a sharded state is all-reduced in place instead
(twice the bytes) and ``st.piece`` is this rank's slice of the sum (:class:`KeepPiece`).

Two dtypes (:mod:`zerostack.core.precision`): the buffer holds the window's sum in the buffers'
``accum_dtype`` (``data_types.grad_accum_dtype``); when that is not the parameters' dtype, each
micro-step's ``.grad`` is added into the buffer and dropped. A bucket is reduced in
``reduce_dtype`` (``communication_data_type``), cast when the gradients are held in another.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ...comm import Comm, Handle
from ..offload.host import Downloads
from ..reducer import CastBack, GradReducer, in_dtype
from .buffers import FlatBuffers


class KeepPiece:
    """A bucket all-reduced (``reduce_scatter: false``): :meth:`wait` waits, then sets the
    bucket's ``piece`` to this rank's slice of the sum; a copy when the bucket was sent as a
    cast copy (so the rest of it goes), else a view."""

    def __init__(self, handle: Handle, sent: torch.Tensor, st, rank: int, *, copy: bool) -> None:
        self._handle, self._sent, self._st, self._rank, self._copy = handle, sent, st, rank, copy

    def wait(self) -> None:
        self._handle.wait()
        if self._sent is not None:
            n = self._st.bucket.piece_numel
            piece = self._sent[self._rank * n : (self._rank + 1) * n]
            self._st.piece = piece.clone() if self._copy else piece
            self._sent = None


class GradBuffer:
    """What both buffers share: the hook's bookkeeping, the reduction of a bucket, the flush.
    ``flat``: the buckets it reduces; ``downloads`` brings reduced pieces into a shard in host
    memory; ``reduce_scatter``: a sharded state's buckets are reduce-scattered (else
    all-reduced, the piece kept)."""

    every_micro_step = False  # whether each micro-step reduces (only pieces are kept)
    shard_held = False  # whether the window's sum is held as this rank's shard

    def __init__(
        self, flat: FlatBuffers, *, comm: Comm, downloads: Downloads, reduce_scatter: bool = True
    ) -> None:
        self.flat, self.comm, self.downloads = flat, comm, downloads
        self.reduce_scatter = reduce_scatter
        self.pool = flat.pool
        self.boundary = True  # whether this micro-step closes the window
        self._ready: set[nn.Parameter] = set()
        sizes = [len(st.bucket.slots) for st in flat.buckets]
        self.reducer = GradReducer(sizes, self.start_grad_sync, self.done())

    def begin_backward(self, boundary: bool) -> None:
        self.boundary = boundary

    @property
    def communicates_now(self) -> bool:
        """Whether this micro-step's backward launches collectives (at dp 1 without ep, none;
        a bucket whose cut has one rank is then handled where it launches)."""
        return self.flat.reduces and (self.every_micro_step or self.boundary)

    def done(self) -> Callable[[int], None] | None:
        """What the reducer calls as each bucket completes; given one, it waits for buckets in
        backward (at most two in flight). None: waited for at the flush."""
        return None

    def _mark(self, p: nn.Parameter) -> None:
        if p in self._ready:
            raise RuntimeError(
                f"a parameter of shape {tuple(p.shape)} got its gradient twice in one backward "
                "(reentrant activation checkpointing?); use use_reentrant=False"
            )
        self._ready.add(p)

    def _reduce(self, st, chunk: torch.Tensor) -> Handle | KeepPiece:
        """Reduce bucket ``st``'s gradients ``chunk`` so that this rank gets its piece."""
        cut = self.flat.cut_of(st)
        sent = in_dtype(chunk, self.flat.reduce_dtype, cut.prescale)
        if not self.reduce_scatter:
            handle = self.comm.all_reduce(sent, axis=cut.axis, async_op=True)
            return KeepPiece(handle, sent, st, cut.rank, copy=sent is not chunk)
        out = self._piece_out(st, sent)
        return self.comm.reduce_scatter(out, sent, axis=cut.axis, async_op=True, pool=self.pool)

    def _piece_out(self, st, sent: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _whole_bucket(self, st, piece: torch.Tensor) -> torch.Tensor:
        """Bucket ``st``, fp32, from every rank's piece of it (all-gathered over its cut)."""
        cut = self.flat.cut_of(st)
        piece = piece.to(device=self.comm.topo.device, dtype=torch.float32)
        if cut.world == 1:
            return piece
        out = piece.new_empty(piece.numel() * cut.world)
        self.comm.all_gather(out, piece, axis=cut.axis)
        return out

    def _write_piece(self, st, rng: slice, value: torch.Tensor) -> None:
        """Write the elements of ``value`` (a parameter's whole flat gradient, at ``rng`` of
        the group's buffer) that fall in this rank's piece of bucket ``st``."""
        fg = self.flat.group_of(st)
        lo, hi = fg.layout.piece(st.bucket, fg.cut.piece_rank)
        a, b = max(rng.start, lo), min(rng.stop, hi)
        if a < b:
            self.grad_piece(st)[a - lo : b - lo].copy_(value[a - rng.start : b - rng.start])

    def accumulated_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """The tensor ``p``'s gradient is summed in over the window: its view of the full flat
        buffer (in the accumulation dtype), which a sum over another axis (a pipeline's tied
        copies) may reduce in place; ``p.grad`` for a parameter the optimizer does not train,
        None with a sharded buffer (only reduced pieces are kept)."""
        f = self.flat
        if p not in f:
            return p.grad
        b, rng = f.locate(p)
        grads_flat = f.group_of(f.buckets[b]).grads_flat
        return None if grads_flat is None else grads_flat[rng].view_as(p)

    def window_grad(self, p: nn.Parameter) -> torch.Tensor:
        """``p``'s gradient so far in this accumulation window, whole and flat in fp32, summed
        over its cut's ranks and scaled as its master gets it at the step (a collective)."""
        b, rng = self.flat.locate(p)
        return self._window_grad(self.flat.buckets[b], rng)

    def hold_grad(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Make ``value`` (flat fp32, as :meth:`window_grad` gives it) ``p``'s gradient in
        this window, where the step reads it."""
        b, rng = self.flat.locate(p)
        self._hold_grad(self.flat.buckets[b], rng, value)

    def flush(self) -> None:
        """Launch buckets whose parameters got no gradient, then wait for every collective
        (at dp = 1 without ep there is nothing to reduce)."""
        if self.flat.reduces:
            self.reducer.flush()
        else:
            self.reducer.reset()
        self._ready.clear()


class FullGrads(GradBuffer):
    """Stages 0-1: the full flat buffer, whose views are the parameters' ``.grad``; reduced on
    the boundary."""

    def done(self) -> Callable[[int], None] | None:
        # a sharded state (stage 1) waits in backward; nothing is left to do per bucket
        return (lambda b: None) if self.flat.grads_sharded else None

    def on_grad_ready(self, p: nn.Parameter) -> None:
        f = self.flat
        b, rng = f.locate(p)
        view = f.group_of(f.buckets[b]).grads_flat[rng].view_as(p)
        if p.grad.data_ptr() != view.data_ptr():
            # A .grad of its own (the buffer is in another dtype, or someone replaced .grad):
            # fold it into the flat buffer.
            view.add_(p.grad)
            p.grad = view if view.dtype == p.grad.dtype else None
        if self.communicates_now:
            self._mark(p)
            self.reducer.arrived(b)

    def start_grad_sync(self, b: int) -> Handle | CastBack | KeepPiece | None:
        """Launch bucket ``b``'s collective (the reducer calls it once the bucket is ready)."""
        st = self.flat.buckets[b]
        cut = self.flat.cut_of(st)
        chunk = self.flat.group_of(st).grads_flat[st.bucket.start : st.bucket.end]
        if cut.size == 1:  # its own sum already
            return None
        if cut.world > 1:
            return self._reduce(st, chunk)
        # every rank holds the whole state: the sum is kept in place
        sent = in_dtype(chunk, self.flat.reduce_dtype, cut.prescale)
        handle = self.comm.all_reduce(sent, axis=cut.axis, async_op=True)
        return handle if sent is chunk else CastBack(handle, sent, chunk)

    def _piece_out(self, st, sent: torch.Tensor) -> torch.Tensor:
        st.piece = out = sent.new_empty(st.bucket.piece_numel)  # kept for the step
        return out

    def end_backward(self) -> None:
        """A sharded state waits for the boundary's reduction, so no collective's buffers
        outlive backward (as DeepSpeed's engine does)."""
        if self.flat.grads_sharded and self.communicates_now:
            self.reducer.settle()

    def finish_grad_sync(self) -> None:
        """Before the step: launch what backward did not, and wait for every collective."""
        self.flush()

    def grad_piece(self, st) -> torch.Tensor:
        """This rank's summed gradient for the bucket."""
        fg = self.flat.group_of(st)
        if fg.cut.world > 1:
            return st.piece
        return fg.grads_flat[st.bucket.start : st.bucket.end]

    def _window_grad(self, st, rng: slice) -> torch.Tensor:
        """It waits for the boundary's reduction if backward launched it, or sums a copy of the
        local gradients mid-window."""
        fg = self.flat.group_of(st)
        cut = fg.cut
        reduced = self.flat.reduces and self.reducer.settle()
        if reduced and cut.world > 1:
            lo, hi = rng.start - st.bucket.start, rng.stop - st.bucket.start
            return self._whole_bucket(st, st.piece)[lo:hi]
        grad = fg.grads_flat[rng].to(torch.float32, copy=True)
        if cut.size > 1 and not reduced:
            grad.mul_(cut.prescale)
            self.comm.all_reduce(grad, axis=cut.axis)
        return grad

    def _hold_grad(self, st, rng: slice, value: torch.Tensor) -> None:
        """The inverse of :meth:`_window_grad`: before the boundary's reduction each rank's
        own gradient, which the reduction sums over dp (prescaled) into ``value``."""
        fg = self.flat.group_of(st)
        cut = fg.cut
        reduced = self.flat.reduces and self.reducer.settle()
        if cut.size > 1 and not reduced:  # every rank holds an equal share: the sum is the value
            fg.grads_flat[rng].copy_(value / (cut.prescale * cut.size))
            return
        self._write_piece(st, rng, value)


class ShardedGrads(GradBuffer):
    """Stage 2: this rank's pieces only, in the accumulation dtype (fp32 by default; in host
    memory when the optimizer is offloaded); reduced every micro-step."""

    every_micro_step = True
    shard_held = True

    def done(self) -> Callable[[int], None] | None:
        return self._add_piece_of

    def on_grad_ready(self, p: nn.Parameter) -> None:
        b, rng = self.flat.locate(p)
        st = self.flat.buckets[b]
        self._mark(p)
        if st.staging is None:  # in the dtype it is reduced in
            st.staging = self._staging_for(st, p.device)
        st.staging[rng.start - st.bucket.start : rng.stop - st.bucket.start].copy_(p.grad.view(-1))
        p.grad = None  # the full-size gradient does not outlive its bucket
        self.reducer.arrived(b, launch=self.communicates_now)

    def start_grad_sync(self, b: int) -> Handle | KeepPiece | None:
        """Launch bucket ``b``'s reduce-scatter (the reducer calls it once the bucket is
        ready); its piece is added into the shard as it completes."""
        st = self.flat.buckets[b]
        if st.staging is None:  # no parameter of this bucket got a gradient
            st.staging = self._staging_for(st, self.flat.group_of(st).params_flat.device)
        self._zero_missing(st)
        if self.flat.cut_of(st).size == 1:  # the staged bucket is the whole piece
            st.piece, st.staging = st.staging, None
            return None
        return self._reduce(st, st.staging)

    def _piece_out(self, st, sent: torch.Tensor) -> torch.Tensor:
        if st.shard_clean and _same_kind(shard := self._shard_of(st), sent):
            st.piece = None  # the sum is the shard's value: no piece to add
            st.shard_clean = False
            return shard
        st.piece = out = self.pool.take(st.bucket.piece_numel, sent.dtype, sent.device)
        return out

    def _staging_for(self, st, device: torch.device) -> torch.Tensor:
        """A buffer (from the pool: old contents) to stage bucket ``st`` in, its padding zero;
        each parameter's range is written when its gradient arrives (:meth:`_zero_missing`
        zeroes those that did not)."""
        staging = self.pool.take(st.bucket.numel, self.flat.reduce_dtype, device)
        end = max((rng.stop for _, rng in st.ranges), default=st.bucket.start)  # an empty group
        staging[end - st.bucket.start :].zero_()
        return staging

    def _zero_missing(self, st) -> None:
        """Zero the staged ranges of bucket ``st``'s parameters that got no gradient."""
        for p, rng in st.ranges:
            if p not in self._ready:
                st.staging[rng.start - st.bucket.start : rng.stop - st.bucket.start].zero_()

    def _shard_of(self, st) -> torch.Tensor:
        """This rank's part of the group's gradient shard for bucket ``st``."""
        off = st.bucket.shard_offset
        return self.flat.group_of(st).grad_shard[off : off + st.bucket.piece_numel]

    def _add_piece_of(self, b: int) -> None:
        self._add_piece(self.flat.buckets[b])

    def _add_piece(self, st) -> None:
        """Add a bucket's reduced piece (if it was not reduced into the shard) into the group's
        gradient shard; its buffers go back to the pool. A shard in host memory (offloaded)
        gets it from a copy that does not stop the host (:class:`~..offload.host.Downloads`): added
        once the copy is settled; the pool's next use of the piece's buffer is in stream order
        after the copy."""
        if st.piece is not None:
            shard = self._shard_of(st)
            if shard.device == st.piece.device:
                shard.add_(st.piece)
            else:
                self.downloads.settle_sealed()  # the last micro-step's: done long ago
                self.downloads.fetch(st.piece, shard.add_)
        self.pool.give(st.piece, st.staging)
        st.piece = st.staging = None

    def end_backward(self) -> None:
        """Finish this micro-step's reduction: each bucket's piece is added into the shard as
        its collective completes."""
        f = self.flat
        if not f.reduces:  # nothing is reduced: the staged bucket is the whole piece
            for st in f.buckets:
                if st.staging is not None:
                    self._zero_missing(st)
        self.flush()
        if not f.reduces:
            for st in f.buckets:
                st.piece, st.staging = st.staging, None
                self._add_piece(st)
        self.downloads.seal()

    def finish_grad_sync(self) -> None:
        pass  # every micro-step's reduction finished in its backward

    def grad_piece(self, st) -> torch.Tensor:
        return self._shard_of(st)

    def _window_grad(self, st, rng: slice) -> torch.Tensor:
        self.downloads.settle()
        lo, hi = rng.start - st.bucket.start, rng.stop - st.bucket.start
        return self._whole_bucket(st, self._shard_of(st))[lo:hi]

    def _hold_grad(self, st, rng: slice, value: torch.Tensor) -> None:
        self.downloads.settle()  # no late add over what is written
        self._write_piece(st, rng, value)


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device
