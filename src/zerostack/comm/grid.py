"""Named, counted collectives over the axes of a :class:`~zerostack.topology.Topology`.

Every collective zerostack issues goes through :class:`Comm`, so its
:class:`~zerostack.comm.CommLog` sees the op, the grid axis, the bytes and the time of each call
(see :mod:`zerostack.comm.records` for what ``bytes`` counts)::

    comm = Comm(topo)
    comm.all_reduce(grad, axis="dp")
    comm.log.step_summary()   # {'all_reduce': {'calls': 1, 'bytes': ..., 'seconds': ...}}
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..core.clock import Clock
from ..topology import Topology
from . import gloo
from .gloo import _all_gather_each, _all_gather_peers, _reduce_scatter_rows
from .records import CommLog, CommRecord


class Handle:
    """An in-flight async collective; ``wait()`` adds the wait to the call's recorded seconds.
    On the GPU (``on_device``) it also records an event behind the wait, and the log keeps the
    record in flight until the device reaches it (NCCL's ``wait()`` only orders the current
    stream after the collective)."""

    def __init__(
        self,
        work: dist.Work | None,
        record: CommRecord,
        log: CommLog,
        clock: Clock,
        on_device: bool = False,
    ) -> None:
        self._work = work
        self._record = record
        self._log = log
        self._clock = clock
        self._on_device = on_device

    def wait(self) -> None:
        work, self._work = self._work, None
        if work is not None:
            t0 = self._clock.now()
            try:
                work.wait()
            except RuntimeError as exc:
                raise self._log.failed(self._record, exc) from exc
            self._record.seconds += self._clock.now() - t0
        self._log.end(self._record, _behind() if self._on_device else None)


def _behind() -> torch.cuda.Event:
    """An event on the current stream, recorded after a collective's wait (or a blocking call,
    which waits too): the device reaches it once the collective ran."""
    event = torch.cuda.Event()
    event.record()
    return event


class Comm:
    """Collectives on the process groups of one topology, each logged in ``self.log``."""

    def __init__(self, topo: Topology, log: CommLog | None = None) -> None:
        self.topo = topo
        self.log = log if log is not None else CommLog()
        self.clock = Clock()  # the engine's: synchronizing on a GPU when seconds are wanted

    def group(self, axis: str) -> dist.ProcessGroup:
        """The group of ``axis``: 'pp', 'dp', 'tp' of the grid, or 'world' (every rank)."""
        return dist.group.WORLD if axis == "world" else self.topo.group(axis)

    def _run(
        self, op: str, axis: str, nbytes: int, fn, async_op: bool, group=None
    ) -> Handle | None:
        group = group if group is not None else self.group(axis)
        rec = self.log.begin(op, axis, nbytes, dist.get_world_size(group))
        t0 = self.clock.now()
        try:
            # posted asynchronously even when the caller waits (torch's own blocking call is
            # the same post and wait), so the wait's time is counted in one place
            work = fn(group, True)
        except RuntimeError as exc:
            raise self.log.failed(rec, exc) from exc
        rec.seconds = self.clock.now() - t0
        handle = Handle(work, rec, self.log, self.clock, self.topo.device.type == "cuda")
        if async_op:
            return handle
        handle.wait()
        return None

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        axis: str = "dp",
        op=dist.ReduceOp.SUM,
        async_op=False,
        group: dist.ProcessGroup | None = None,
    ) -> Handle | None:
        """Sum (or ``op``) over ``axis``; ``group`` replaces the axis's group (logged under
        ``axis``), e.g. the stages sharing a tied weight."""
        return self._run(
            "all_reduce",
            axis,
            tensor.numel() * tensor.element_size(),
            lambda g, a: dist.all_reduce(tensor, op=op, group=g, async_op=a),
            async_op,
            group,
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        axis: str = "dp",
        op=dist.ReduceOp.SUM,
        async_op=False,
        pool=None,
    ) -> Handle | None:
        """``output`` (1/N of ``input``) receives this rank's slice of the sum over the axis;
        over gloo the received rows come from and go back to ``pool`` (a
        :class:`~zerostack.core.scratch.Pool`), if given."""
        return self._run(
            "reduce_scatter",
            axis,
            input.numel() * input.element_size(),
            lambda g, a: _reduce_scatter_rows(output, input, op=op, group=g, async_op=a, pool=pool),
            async_op,
        )

    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        axis: str = "dp",
        async_op=False,
        group: dist.ProcessGroup | None = None,
    ) -> Handle | None:
        """``output`` (N x ``input``) receives every rank's ``input``, in rank order; ``input``
        may be this rank's row of ``output``; ``group`` replaces the axis's group (logged under
        ``axis``)."""
        return self._run(
            "all_gather",
            axis,
            output.numel() * output.element_size(),
            lambda g, a: _all_gather_peers(output, input, group=g, async_op=a),
            async_op,
            group,
        )

    def all_gather_each(
        self,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        *,
        axis: str = "dp",
        async_op=False,
        group: dist.ProcessGroup | None = None,
    ) -> Handle | None:
        """Each ``outputs[i]`` (N x ``inputs[i]``, contiguous) receives every rank's
        ``inputs[i]``, in rank order: one logged all-gather of all the pairs. Over gloo
        (:meth:`gathers_each`) its sends and receives go straight from the inputs into the
        outputs; elsewhere it is one all-gather per pair (a caller with many small pairs is
        better served there by one all-gather of their concatenation)."""
        return self._run(
            "all_gather",
            axis,
            sum(o.numel() * o.element_size() for o in outputs),
            lambda g, a: _all_gather_each(outputs, inputs, group=g, async_op=a),
            async_op,
            group,
        )

    def gathers_each(self, axis: str = "dp", group: dist.ProcessGroup | None = None) -> bool:
        """Whether :meth:`all_gather_each` runs as one batch of point-to-point transfers (over
        gloo), cheaper than one all-gather of the inputs' concatenation."""
        # through the module: virtual CUDA's tests take NCCL's branch by patching gloo._gloo
        return gloo._gloo(group if group is not None else self.group(axis))

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        axis: str = "dp",
        async_op=False,
        output_splits: list[int] | None = None,
        input_splits: list[int] | None = None,
    ) -> Handle | None:
        """Row ``r`` of ``input`` (N equal rows, flattened) goes to the axis's rank ``r``;
        ``output``'s row ``s`` comes from rank ``s``; or, given the splits, ``input_splits[r]``
        leading-dimension rows to rank ``r`` and ``output_splits[s]`` from rank ``s``. Logged as
        the bytes this rank sends."""
        return self._run(
            "all_to_all",
            axis,
            input.numel() * input.element_size(),
            lambda g, a: dist.all_to_all_single(
                output, input, output_splits, input_splits, group=g, async_op=a
            ),
            async_op,
        )

    def broadcast(
        self,
        tensor: torch.Tensor,
        *,
        src: int = 0,
        axis: str = "dp",
        async_op=False,
        group: dist.ProcessGroup | None = None,
    ) -> Handle | None:
        """Broadcast from the rank whose coordinate along ``axis`` (or in ``group``) is ``src``."""
        return self._run(
            "broadcast",
            axis,
            tensor.numel() * tensor.element_size(),
            lambda g, a: dist.broadcast(
                tensor, src=dist.get_global_rank(g, src), group=g, async_op=a
            ),
            async_op,
            group,
        )

    def all_gather_strings(self, text: str, *, axis: str = "world") -> list[str]:
        """Every rank's ``text`` along ``axis``, in rank order: UTF-8 bytes in tensors (two
        all-gathers, lengths then padded bytes), so nothing is pickled."""
        world = dist.get_world_size(self.group(axis))
        device = self.topo.device
        data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
        length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        lengths = torch.empty(world, dtype=torch.int64, device=device)
        self.all_gather(lengths, length, axis=axis)
        width = max(int(lengths.max()), 1)
        padded = torch.zeros(width, dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        out = torch.empty(world * width, dtype=torch.uint8, device=device)
        self.all_gather(out, padded, axis=axis)
        rows = out.view(world, width).cpu()
        return [bytes(rows[r, : int(lengths[r])].tolist()).decode() for r in range(world)]

    def send(self, tensor: torch.Tensor, *, dst: int, axis: str = "pp") -> None:
        self._run(
            "send",
            axis,
            tensor.numel() * tensor.element_size(),
            lambda g, a: dist.send(tensor, dst=dist.get_global_rank(g, dst), group=g),
            False,
        )

    def recv(self, tensor: torch.Tensor, *, src: int, axis: str = "pp") -> None:
        self._run(
            "recv",
            axis,
            tensor.numel() * tensor.element_size(),
            lambda g, a: dist.recv(tensor, src=dist.get_global_rank(g, src), group=g),
            False,
        )

    def p2p(self, ops: list[tuple[str, torch.Tensor, int]], *, axis: str = "pp") -> None:
        """Post point-to-point ops together and wait for all of them (``batch_isend_irecv``).

        ``ops`` holds ``("send" | "recv", tensor, peer)`` with ``peer`` a coordinate along
        ``axis``. Posting a batch at once lets two ranks that both send and receive proceed.
        """
        if not ops:
            return
        group = self.topo.group(axis)
        n = dist.get_world_size(group)
        records = [
            self.log.begin(kind, axis, t.numel() * t.element_size(), n) for kind, t, _ in ops
        ]
        t0 = self.clock.now()
        p2p_ops = [
            dist.P2POp(
                dist.isend if kind == "send" else dist.irecv,
                t,
                dist.get_global_rank(group, peer),
                group=group,
            )
            for kind, t, peer in ops
        ]
        try:
            if all(t.is_meta for _, t, _ in ops):
                # a dry run (zerostack.dryrun): the fake group takes each op on its own, while
                # torch's batching looks a backend up by the tensors' device, and meta has none
                works = [op.op(op.tensor, op.peer, op.group) for op in p2p_ops]
            else:
                works = dist.batch_isend_irecv(p2p_ops)
            for w in works:
                w.wait()
        except RuntimeError as exc:
            raise self.log.failed(records[0], exc) from exc
        seconds = self.clock.now() - t0
        event = _behind() if self.topo.device.type == "cuda" else None
        for rec in records:
            rec.seconds = seconds / len(ops)
            self.log.end(rec, event)

    def barrier(self, *, axis: str = "dp") -> None:
        self._run("barrier", axis, 0, lambda g, a: dist.barrier(group=g, async_op=a), False)


def comm_for(topology: Topology) -> Comm:
    """The job's :class:`Comm` on ``topology``'s grid, one per topology (kept on it), so every
    collective (tensor-parallel layers, ZeRO, the engine) lands in one ``CommLog``."""
    if topology._comm is None:
        topology._comm = Comm(topology)
    return topology._comm
