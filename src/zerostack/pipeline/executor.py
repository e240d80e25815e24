"""Runs one rank's instruction stream: forward and backward of its chunks, point-to-point traffic.

A maximal run of consecutive send/receive instructions is posted as one batch
(``batch_isend_irecv``) and waited for as a whole, which is the model the schedule simulator checks
for deadlock. Activations and their gradients travel in the dtype the layers produce (the compute
dtype).

A receiver must size its buffer before it posts the batch, so the shape and dtype of the activation
crossing each boundary is learnt once, before the first stream: micro-batch 0 goes forward through
every virtual stage in turn (no grad, eval mode), each activation behind a small header (see
:meth:`PipelineExecutor.learn_shapes`). A later activation of another shape is an error (until
:meth:`PipelineExecutor.forget_shapes`: DeepSpeed's ``reset_activation_shape``). Gradients
need no header: they have the shape of the activation the receiver sent. (Sending the header
inside the schedule's own batch would split the batch in two rounds, the header's then the
payload's, which the simulator does not model: with interleaved 1F1B and one micro-batch, rank 0's
header round waits on a header that rank 1 sends only after its payload round, which waits on
rank 0's payload round: a deadlock.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from ..comm import Comm
from ..core.clock import Clock
from ..engine.micro_batches import cast_inputs
from .module import PipelineModule
from .schedule import (
    Backward,
    Forward,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)

_COMM = (SendActivation, RecvActivation, SendGrad, RecvGrad)
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_HEADER = 10  # [ndim, dtype code, up to 8 sizes]


def _header(t: torch.Tensor) -> torch.Tensor:
    """``t``'s shape and dtype as a tensor on its device (NCCL sends device tensors only)."""
    if t.dim() > _HEADER - 2 or t.dtype not in _DTYPES:
        raise ValueError(f"pipeline: cannot send a {t.dtype} activation of shape {tuple(t.shape)}")
    h = [t.dim(), _DTYPES.index(t.dtype), *t.shape] + [0] * (_HEADER - 2 - t.dim())
    return torch.tensor(h, dtype=torch.int64, device=t.device)


def forward_only(stages: int, micro_batches: int, stage: int, chunks: int) -> list:
    """The evaluation stream: every micro-batch through every chunk in order, no backward."""
    last = stages * chunks - 1
    out: list = []
    for mb in range(micro_batches):
        if stage in (0, last % stages):
            out.append(LoadMicroBatch(mb))
        for c in range(chunks):
            vs = c * stages + stage
            if vs > 0:
                out.append(RecvActivation(mb, c))
            out.append(Forward(mb, c))
            if vs < last:
                out.append(SendActivation(mb, c))
    return out


class PipelineExecutor:
    """Executes instruction streams for one rank of a :class:`PipelineModule`.

    ``stats`` after a run: seconds in forward/backward (``compute_s``), in waiting on
    point-to-point batches (``comm_s``), in the optimizer step (``step_s``) and in all
    (``total_s``).
    """

    def __init__(self, module: PipelineModule, comm: Comm, auto_cast: bool = False) -> None:
        # auto_cast: fp16.auto_cast, DeepSpeed's rule for the first stage's inputs (the labels
        # are never cast); see zerostack.engine.micro_batches.cast_inputs
        self.module, self.comm, self.auto_cast = module, comm, auto_cast
        self.clock = Clock()  # the engine's (synchronizing on a GPU when seconds are wanted)
        self.p, self.stage, self.v = module.num_stages, module.stage_id, module.virtual_stages
        self.last_vs = self.p * self.v - 1
        self._meta_in: dict[int, tuple[torch.Size, torch.dtype]] = {}  # per chunk received
        self._meta_out: dict[int, tuple[torch.Size, torch.dtype]] = {}  # per chunk sent
        self._shapes_known = self.p == 1  # one rank: every handoff is local, no buffer to size

    def _vs(self, chunk: int) -> int:
        return chunk * self.p + self.stage

    def _peer(self, chunk: int, step: int) -> tuple[int, int]:
        """(pp rank, chunk) of the virtual stage ``step`` away from this chunk's."""
        vs = self._vs(chunk) + step
        return vs % self.p, vs // self.p

    def run(
        self,
        instructions: list,
        data_iter: Iterator | None,
        *,
        loss_scale: float,
        micro_batches: int,
        train: bool,
        on_tied: Callable[[], None] | None = None,
        on_step: Callable[[], None] | None = None,
        around_backward: tuple[Callable[[bool], None], Callable[[], None]] | None = None,
    ) -> list[torch.Tensor]:
        """Run the stream; returns this rank's per-micro-batch losses (last stage only).
        ``around_backward``: (before, after) each backward; ``before(final)`` says whether it is
        its chunk's last in the stream (ZeRO-3 reduces each backward's gradients as it ends)."""
        self.around_backward = around_backward
        self.last_backward = {
            ins.chunk: (ins.micro, ins.chunk) for ins in instructions if isinstance(ins, Backward)
        }
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.grad_out: dict[tuple[int, int], torch.Tensor] = {}
        self.grad_in: dict[tuple[int, int], torch.Tensor] = {}
        self.local: dict[tuple[str, int, int], torch.Tensor] = {}
        self.batches: dict[int, tuple] = {}
        self.side: dict[tuple[int, int], torch.Tensor] = {}
        losses: list[torch.Tensor] = []
        self.stats = {"compute_s": 0.0, "comm_s": 0.0, "step_s": 0.0, "total_s": 0.0}
        t0 = self.clock.now()
        if not self._shapes_known:
            self.learn_shapes(data_iter)
        with torch.set_grad_enabled(train):
            self._run(instructions, data_iter, losses, loss_scale / micro_batches, on_tied, on_step)
        self.stats["total_s"] = self.clock.now() - t0
        return losses

    def _run(self, instructions, data_iter, losses, scale, on_tied, on_step) -> None:
        i = 0
        while i < len(instructions):
            ins = instructions[i]
            if isinstance(ins, _COMM):
                j = i
                while j < len(instructions) and isinstance(instructions[j], _COMM):
                    j += 1
                t0 = self.clock.now()
                self._exchange(instructions[i:j])
                self.stats["comm_s"] += self.clock.now() - t0
                i = j
                continue
            if isinstance(ins, LoadMicroBatch):
                self._load(ins.micro, data_iter)
            elif isinstance(ins, (Forward, Backward)):
                t0 = self.clock.now()
                if isinstance(ins, Forward):
                    self._forward(ins.micro, ins.chunk, losses)
                else:
                    self._backward(ins.micro, ins.chunk, scale)
                self.stats["compute_s"] += self.clock.now() - t0
            elif isinstance(ins, ReduceTiedGrads):
                if on_tied is not None:
                    on_tied()
            elif isinstance(ins, OptimizerStep):
                t0 = self.clock.now()
                if on_step is not None:
                    on_step()
                self.stats["step_s"] += self.clock.now() - t0
            elif not isinstance(ins, ReduceGrads):  # dp reduction happens in the optimizer step
                raise TypeError(f"pipeline: unknown instruction {ins!r}")
            i += 1

    def forget_shapes(self) -> None:
        """DeepSpeed's ``reset_activation_shape``: learn the shapes again before the next run."""
        self._shapes_known = self.p == 1

    def learn_shapes(self, data_iter: Iterator | None) -> None:
        """Send micro-batch 0 forward through every virtual stage once, so that each rank learns
        the shape and dtype of the activation it receives at each boundary (collective over pp).

        No grad, eval mode (no dropout draw, no running-statistics update), the RNG restored;
        the micro-batch read here is the one the next stream loads as micro-batch 0. A chain, one
        virtual stage after the other, so it cannot deadlock; it costs one micro-batch's forward,
        once.
        """
        was_training = self.module.training
        device = self.comm.topo.device
        if device.type == "meta":
            self._learn_shapes_here(data_iter)
            return
        self.module.eval()
        try:
            with (
                torch.no_grad(),
                torch.random.fork_rng(
                    devices=[device] if device.type == "cuda" else [], device_type=device.type
                ),
            ):
                for chunk in range(self.v):
                    vs = self._vs(chunk)
                    if vs == 0:
                        self._load(0, data_iter)
                        x = self._first_input(0)
                    else:
                        rank, _ = self._peer(chunk, -1)
                        h = torch.zeros(_HEADER, dtype=torch.int64, device=device)
                        self.comm.p2p([("recv", h, rank)], axis="pp")
                        ndim = int(h[0])
                        meta = (torch.Size(h[2 : 2 + ndim].tolist()), _DTYPES[int(h[1])])
                        self._meta_in[chunk] = meta
                        x = torch.empty(meta[0], dtype=meta[1], device=device)
                        self.comm.p2p([("recv", x, rank)], axis="pp")
                    if vs == self.last_vs:
                        break
                    out = self.module(x, chunk).contiguous()
                    self._meta_out[chunk] = (out.shape, out.dtype)
                    rank, _ = self._peer(chunk, +1)
                    # two batches, as the receiver posts them (NCCL groups each batch's P2P)
                    self.comm.p2p([("send", _header(out), rank)], axis="pp")
                    self.comm.p2p([("send", out, rank)], axis="pp")
        finally:
            self.module.train(was_training)
        self._shapes_known = True

    def _learn_shapes_here(self, data_iter: Iterator | None) -> None:
        """:meth:`learn_shapes` in a dry run (:mod:`zerostack.dryrun`: meta tensors, no other
        rank to send a header): this process runs micro-batch 0 through the layers of every
        virtual stage up to the last, each built afresh on the meta device in this rank's
        parameters' dtype (no grad), and keeps the shapes at this rank's boundaries. What the
        other ranks' layers issue (tensor parallelism's collectives) stays out of this rank's
        CommLog; its own chunks' are in it, as their forward here is the one the cluster runs."""
        from ..comm.records import CommLog

        self._load(0, data_iter)
        x, tied, parts = self._first_input(0), {}, self.module.parts
        dtype = next(p.dtype for p in self.module.parameters() if p.is_floating_point())
        log, others = self.comm.log, CommLog()
        try:
            with torch.no_grad(), torch.device("meta"):
                for vs in range(self.last_vs):
                    self.comm.log = log if vs % self.p == self.stage else others
                    for idx in range(parts[vs], parts[vs + 1]):
                        x = self.module.layer_alone(idx, tied, dtype)(x)
                    x = x.contiguous()
                    if vs % self.p == self.stage:  # this rank sends it
                        self._meta_out[vs // self.p] = (x.shape, x.dtype)
                    if (vs + 1) % self.p == self.stage:  # this rank receives it
                        self._meta_in[(vs + 1) // self.p] = (x.shape, x.dtype)
        finally:
            self.comm.log = log
        self._shapes_known = True

    # ------------------------------------------------------------------ compute
    def _load(self, mb: int, data_iter: Iterator | None) -> None:
        if mb in self.batches:  # read ahead by learn_shapes
            return
        if data_iter is None:
            raise ValueError("train_batch: no data iterator (pass one or training_data)")
        self.batches[mb] = next(data_iter)

    def _first_input(self, mb: int):
        x = self.batches[mb][0]
        if torch.is_tensor(x):
            x = x.to(self.comm.topo.device)
        return cast_inputs(x, self.auto_cast)

    def _forward(self, mb: int, chunk: int, losses: list) -> None:
        vs = self._vs(chunk)
        x = self._first_input(mb) if vs == 0 else self.inputs[(mb, chunk)]
        out = self.module(x, chunk)
        side = self.module.side_loss(chunk) if torch.is_grad_enabled() else None
        if side is not None:
            self.side[(mb, chunk)] = side
        if vs == self.last_vs:
            labels = self.batches.pop(mb)[1]
            if torch.is_tensor(labels):
                labels = labels.to(self.comm.topo.device)
            loss = self.module.loss_fn(out, labels) if self.module.loss_fn else out
            if loss.dim() != 0:
                raise ValueError(f"pipeline: the loss must be a scalar, got {tuple(loss.shape)}")
            losses.append(loss.detach().float())
            out = loss
        elif vs == 0 and self.stage != self.last_vs % self.p:
            self.batches.pop(mb)  # the last stage (another rank) reads the labels
        self.outputs[(mb, chunk)] = out
        if not torch.is_grad_enabled():
            self.inputs.pop((mb, chunk), None)

    def _backward(self, mb: int, chunk: int, scale: float) -> None:
        out = self.outputs.pop((mb, chunk))
        if self.around_backward is not None:
            self.around_backward[0](self.last_backward[chunk] == (mb, chunk))
        side = self.side.pop((mb, chunk), None)  # a term of the loss from this chunk's layers
        if self._vs(chunk) == self.last_vs:
            loss = out.float() if side is None else out.float() + side.float()
            (loss * scale).backward()
        elif side is None:
            torch.autograd.backward(out, grad_tensors=self.grad_out.pop((mb, chunk)))
        else:
            grads = [self.grad_out.pop((mb, chunk)), torch.full_like(side, scale)]
            torch.autograd.backward([out, side], grad_tensors=grads)
        if self.around_backward is not None:
            self.around_backward[1]()
        if self._vs(chunk) > 0:
            inp = self.inputs.pop((mb, chunk))
            self.grad_in[(mb, chunk)] = inp.grad

    # ------------------------------------------------------------------ communication
    def _exchange(self, batch: list) -> None:
        """Post one batch of transfers at once and wait for all of it; buffers sized up front."""
        ops = []
        for ins in batch:
            key = (ins.micro, ins.chunk)
            if isinstance(ins, SendActivation):
                t = self.outputs[key].detach().contiguous()
                rank, peer_chunk = self._peer(ins.chunk, +1)
                if rank == self.stage:
                    self.local[("act", ins.micro, peer_chunk)] = t
                    continue
                if self._meta_out[ins.chunk] != (t.shape, t.dtype):
                    shape, dtype = self._meta_out[ins.chunk]
                    raise ValueError(
                        f"pipeline: stage {self.stage} chunk {ins.chunk} sends an activation of "
                        f"{tuple(t.shape)} {t.dtype}, earlier ones were {tuple(shape)} {dtype}; "
                        "every micro-batch must have the same shape"
                    )
                ops.append(("send", t, rank))
            elif isinstance(ins, RecvActivation):
                rank, _ = self._peer(ins.chunk, -1)
                if rank == self.stage:
                    t = self.local.pop(("act", ins.micro, ins.chunk)).detach()
                else:
                    shape, dtype = self._meta_in[ins.chunk]
                    t = torch.empty(shape, dtype=dtype, device=self.comm.topo.device)
                    ops.append(("recv", t, rank))
                if t.is_floating_point() and torch.is_grad_enabled():
                    t.requires_grad_(True)
                self.inputs[key] = t
            elif isinstance(ins, SendGrad):
                g = self.grad_in.pop(key)
                rank, peer_chunk = self._peer(ins.chunk, -1)
                if rank == self.stage:
                    self.local[("grad", ins.micro, peer_chunk)] = g
                else:
                    ops.append(("send", g.contiguous(), rank))
            elif isinstance(ins, RecvGrad):
                rank, _ = self._peer(ins.chunk, +1)
                if rank == self.stage:
                    self.grad_out[key] = self.local.pop(("grad", ins.micro, ins.chunk))
                    continue
                out = self.outputs[key]
                buf = torch.empty(out.shape, dtype=out.dtype, device=out.device)
                ops.append(("recv", buf, rank))
                self.grad_out[key] = buf
        self.comm.p2p(ops, axis="pp")
