"""The backward half of ZeRO stages 0-2 (mixed into
:class:`~.sharded_optimizer.ShardedDataParallel`): each gradient, as backward accumulates it, goes
to its bucket, and the :class:`~.reducer.GradReducer` launches the bucket's collective once the
bucket is complete, in bucket order on every rank.

========  ======================================================================================
stage 0   gradients stay in the flat buffer; on the boundary each bucket is all-reduced in place
stage 1   the same, reduce-scattered: this rank's reduced piece (``st.piece``) for the step
stage 2   every micro-step: the bucket's gradients are copied out (``st.staging``), the
          full-size ones dropped, reduce-scattered, and the piece added into the shard
========  ======================================================================================

At stage 2 the buffers a bucket needs for one micro-step (its staging, the reduce-scatter's
received rows, a piece) come from and go back to ``self.buffers`` (:class:`~.scratch.Pool`), so
the same few bucket-sized buffers serve every bucket and step. A bucket whose part of the shard
is still zero since the last step (``st.shard_clean``; the first micro-step of a window) is
reduce-scattered straight into the shard when it is in the reduce dtype: no piece, no add.

At stages 1-2 with ``reduce_scatter: false`` the bucket is all-reduced in place instead (twice
the bytes) and ``st.piece`` is this rank's slice of the sum (:class:`KeepPiece`).

Two dtypes (``precision.py``): the flat buffer (stages 0-1) or the shard (stage 2) holds the
window's sum in ``self.accum_dtype`` (``data_types.grad_accum_dtype``); when that is not the
parameters' dtype, each micro-step's ``.grad`` is added into the buffer and dropped. A bucket is
reduced in ``self.reduce_dtype`` (``communication_data_type``), cast when the gradients are held
in another. It uses the strategy's own parts: ``groups``, ``buckets``, ``_where``, ``reducer``,
``boundary``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import Handle
from .reducer import CastBack, in_dtype


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


class FlatBackward:
    @property
    def _communicates_now(self) -> bool:
        """Stage 2 reduces every micro-step (only pieces are kept); 0-1 only on the boundary."""
        return self.dp > 1 and (self.stage == 2 or self.boundary)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        b, rng = self._where[p]
        st = self.buckets[b]
        fg = self.groups[st.group]
        if fg.grads_flat is not None:
            view = fg.grads_flat[rng].view_as(p)
            if p.grad.data_ptr() != view.data_ptr():
                # A .grad of its own (the buffer is in another dtype, or someone replaced .grad):
                # fold it into the flat buffer.
                view.add_(p.grad)
                p.grad = view if view.dtype == p.grad.dtype else None
        if not self._communicates_now and self.stage < 2:
            return
        if p in self._ready:
            raise RuntimeError(
                f"a parameter of shape {tuple(p.shape)} got its gradient twice in one backward "
                "(reentrant activation checkpointing?); use use_reentrant=False"
            )
        self._ready.add(p)
        if self.stage == 2:
            if st.staging is None:  # in the dtype it is reduced in
                st.staging = self._staging_for(st, p.device)
            st.staging[rng.start - st.bucket.start : rng.stop - st.bucket.start].copy_(
                p.grad.view(-1)
            )
            p.grad = None  # the full-size gradient does not outlive its bucket
        self.reducer.arrived(b, launch=self._communicates_now)

    def _launch(self, b: int) -> Handle | CastBack:
        st = self.buckets[b]
        fg = self.groups[st.group]
        if self.stage == 2:
            if st.staging is None:  # no parameter of this bucket got a gradient
                st.staging = self._staging_for(st, fg.params_flat.device)
            self._zero_missing(st)
            chunk = st.staging
        else:
            chunk = fg.grads_flat[st.bucket.start : st.bucket.end]
        sent = in_dtype(chunk, self.reduce_dtype, self.prescale)
        if self.stage == 0:
            handle = self.comm.all_reduce(sent, axis="dp", async_op=True)
            return handle if sent is chunk else CastBack(handle, sent, chunk)
        if not self.reduce_scatter:
            handle = self.comm.all_reduce(sent, axis="dp", async_op=True)
            return KeepPiece(handle, sent, st, self.rank, copy=sent is not chunk)
        if self.stage == 1:  # kept for the step
            st.piece = out = sent.new_empty(st.bucket.piece_numel)
        elif st.shard_clean and self._same_kind(shard := self._shard_of(st), sent):
            st.piece, out = None, shard  # the sum is the shard's value: no piece to add
            st.shard_clean = False
        else:
            st.piece = out = self.buffers.take(st.bucket.piece_numel, sent.dtype, sent.device)
        return self.comm.reduce_scatter(out, sent, axis="dp", async_op=True, pool=self.buffers)

    @staticmethod
    def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.dtype == b.dtype and a.device == b.device

    def _staging_for(self, st, device: torch.device) -> torch.Tensor:
        """A buffer (from the pool: old contents) to stage bucket ``st`` in, its padding zero;
        each parameter's range is written when its gradient arrives (:meth:`_zero_missing`
        zeroes those that did not)."""
        staging = self.buffers.take(st.bucket.numel, self.reduce_dtype, device)
        staging[max(rng.stop for _, rng in st.ranges) - st.bucket.start :].zero_()
        return staging

    def _zero_missing(self, st) -> None:
        """Zero the staged ranges of bucket ``st``'s parameters that got no gradient."""
        for p, rng in st.ranges:
            if p not in self._ready:
                st.staging[rng.start - st.bucket.start : rng.stop - st.bucket.start].zero_()

    def _shard_of(self, st) -> torch.Tensor:
        """Stage 2: this rank's part of the group's gradient shard for bucket ``st``."""
        off = st.bucket.shard_offset
        return self.groups[st.group].grad_shard[off : off + st.bucket.piece_numel]

    def _reduced(self, b: int) -> None:
        """Bucket ``b``'s collective is complete: at stage 2 its piece goes into the shard and
        its buffers go (stage 1 keeps the piece for the step)."""
        st = self.buckets[b]
        if self.stage == 2:
            self._add_piece(st)

    def _add_piece(self, st) -> None:
        """Add a bucket's reduced piece (if it was not reduced into the shard) into the group's
        gradient shard; its buffers go back to the pool. A shard in host memory (offloaded)
        gets it from a copy that does not stop the host (:class:`~.offload.Downloads`): added
        once the copy is settled; the pool's next use of the piece's buffer is in stream order
        after the copy."""
        if st.piece is not None:
            shard = self._shard_of(st)
            if shard.device == st.piece.device:
                shard.add_(st.piece)
            else:
                self.downloads.settle_sealed()  # the last micro-step's: done long ago
                self.downloads.fetch(st.piece, shard.add_)
        self.buffers.give(st.piece, st.staging)
        st.piece = st.staging = None

    def accumulated_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """The tensor ``p``'s gradient is summed in over the window at stages 0-1: its view of
        the flat buffer (in the accumulation dtype), which a sum over another axis (a pipeline's
        tied copies) may reduce in place; ``p.grad`` for a parameter the optimizer does not
        train, None at stage 2 (only reduced pieces are kept)."""
        if p not in self._where:
            return p.grad
        b, rng = self._where[p]
        grads_flat = self.groups[self.buckets[b].group].grads_flat
        return None if grads_flat is None else grads_flat[rng].view_as(p)

    def _flush(self) -> None:
        """Launch buckets whose parameters got no gradient, then wait for every collective
        (at dp = 1 there is nothing to reduce)."""
        if self.dp > 1:
            self.reducer.flush()
        else:
            self.reducer.reset()
        self._ready.clear()

    def end_backward(self) -> None:
        """Stage 2: finish this micro-step's reduction (each bucket's piece is added into the
        fp32 shard as its collective completes); stage 1: wait for the boundary's reduction, so
        no collective's buffers outlive backward (as DeepSpeed's engine does)."""
        if self.stage == 1 and self._communicates_now:
            self.reducer.settle()
        if self.stage != 2:
            return
        if self.dp == 1:  # nothing is reduced: the staged bucket is the whole piece
            for st in self.buckets:
                if st.staging is not None:
                    self._zero_missing(st)
        self._flush()
        if self.dp == 1:
            for st in self.buckets:
                st.piece, st.staging = st.staging, None
                self._add_piece(st)
        self.downloads.seal()
