"""The stepped masters of ZeRO stages 0-2 back into every rank's compute-dtype parameters.

Where every rank holds the whole state (stage 0, or dp 1) each bucket's master is copied into
the parameter buffer (up from host memory when offloaded, without blocking); where each rank
holds a piece (stages 1-2) the pieces are all-gathered, at most two gathers in flight. With
torch's Adam, AdamW, SGD or Adagrad, or zerostack's Lion (each parameter updated on its own)
and masters in memory, the optimizer steps one bucket's master at a time and each bucket's
all-gather starts as soon as it is stepped, so the gathers overlap the rest of the step.
"""

from __future__ import annotations

import torch

from ...comm import Comm
from ...optim.lion import Lion
from ..offload.host import Uploads
from .buffers import FlatBuffers
from .params import BucketState

# Optimizers whose step updates each parameter from its own gradient and state alone: stepping
# the masters one bucket at a time gives what one step of all of them gives.
_ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, Lion)


class WriteBack:
    """The write-back of ``flat``'s buckets (each gathered over its flat group's cut's axis
    when its state is cut); ``uploads`` brings offloaded masters up, ``flat.pool`` lends the
    gathers' inputs."""

    def __init__(self, flat: FlatBuffers, *, comm: Comm, uploads: Uploads) -> None:
        self.groups, self.buckets, self.comm = flat.groups, flat.buckets, comm
        self.uploads, self.buffers = uploads, flat.pool
        self._gathering: list[tuple] | None = None  # all-gathers launched as buckets stepped

    def steps_by_bucket(self, optimizer, offload: str) -> bool:
        """Whether the optimizer may step one bucket's master at a time: one that updates each
        parameter from its own gradient and state alone, masters in memory, and gathers to
        overlap."""
        return (
            any(fg.cut.world > 1 for fg in self.groups)
            and offload == "none"
            and len(self.buckets) > 1
            and type(optimizer) in _ELEMENTWISE
        )

    def step_and_gather(self, optimizer) -> None:
        """Step each bucket's master alone (the others' gradients hidden for the call) and
        launch its all-gather; :meth:`finish` waits for those still in flight."""
        grads = [st.master.grad for st in self.buckets]
        for st in self.buckets:
            st.master.grad = None
        handles: list[tuple] = []
        try:
            for st, grad in zip(self.buckets, grads, strict=True):
                st.master.grad = grad
                optimizer.step()
                st.master.grad = None
                self._bring(st, handles)
        finally:
            for st, grad in zip(self.buckets, grads, strict=True):
                st.master.grad = grad
        self._gathering = handles

    def finish(self) -> None:
        """Bring the updated masters into every rank's compute-dtype parameter buffer: copied
        where every rank holds the whole state, else all-gathered (those launched as buckets
        were stepped only waited for)."""
        handles, self._gathering = self._gathering, None
        if handles is None:
            handles = []
            for st in self.buckets:
                self._bring(st, handles)
        for h, src in handles:
            self._gathered(h, src)

    def _bring(self, st: BucketState, handles: list[tuple]) -> None:
        """Bucket ``st``'s updated master into this rank's parameter buffer: copied where it
        holds the whole (up from host memory when offloaded, without blocking), else the
        all-gather over its cut's axis launched, appended to ``handles`` as ``(handle, input
        copy or None)``; at most two stay in flight (their inputs are buckets' pieces)."""
        fg = self.groups[st.group]
        full = fg.params_flat[st.bucket.start : st.bucket.end]
        src, st.updated = st.updated, None  # (nvme: the stepped piece, already a copy)
        if fg.cut.world == 1:
            master = src if src is not None else st.master.detach()
            if master.data_ptr() != full.data_ptr():  # offloaded: without blocking
                self.uploads.copy(st.master, full, master)
            return
        in_place = False
        if src is None:
            # In fp32 the master is this rank's row of ``full``: gathered in place
            master, own = st.master.detach(), full[fg.cut.rank * st.bucket.piece_numel :]
            in_place = master.data_ptr() == own.data_ptr() and master.dtype == own.dtype
            src = master if in_place else self.on_device(st, master)
        handle = self.comm.all_gather(full, src, axis=fg.cut.axis, async_op=True)
        handles.append((handle, None if in_place else src))
        if len(handles) > 2:
            self._gathered(*handles.pop(0))

    def _gathered(self, handle, src: torch.Tensor) -> None:
        handle.wait()
        self.buffers.give(src)

    def on_device(self, st: BucketState, value: torch.Tensor) -> torch.Tensor:
        """A copy of a bucket's fp32 master piece in the compute dtype on the device (from host
        memory when offloaded: through the bucket's staging buffer, without blocking)."""
        dtype = self.groups[st.group].params_flat.dtype
        out = self.buffers.take(value.numel(), dtype, self.comm.topo.device).view(value.shape)
        self.uploads.copy(st.master, out, value)
        return out
