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

from ..clock import Clock
from ..core import scratch
from ..topology import Topology
from .records import CommLog, CommRecord

# torch 2.13 renamed the tensor-in/tensor-out collectives and deprecates the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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


class _SummedRows:
    """gloo's reduce-scatter as zerostack runs it: an all-to-all hands rank ``r`` row ``r`` of
    every rank's input, and :meth:`wait` sums the received rows in rank order into the output.
    The same bytes cross the wire as in a ring reduce-scatter ((N-1)/N of the input per rank);
    torch's gloo reduce-scatter of a 4M-element bucket took 1.6-2.3x as long at 2 ranks
    (``benchmarks/collectives.py``). The received rows (a whole bucket, in a mapping of its own
    from :data:`~zerostack.core.scratch.MIN_BYTES` up) live until the sum; taken from and
    handed back to ``pool`` (a :class:`~zerostack.core.scratch.Pool`) when one is given."""

    def __init__(
        self, output: torch.Tensor, input: torch.Tensor, group, async_op: bool, pool=None
    ) -> None:
        world = dist.get_world_size(group)
        if input.numel() != output.numel() * world:
            raise ValueError(
                f"reduce_scatter: input of {input.numel()} elements for an output of "
                f"{output.numel()} over {world} ranks (want {output.numel() * world})"
            )

        self._out, self._pool = output, pool
        make = pool.take if pool is not None else scratch.empty
        self._rows = make(input.numel(), input.dtype, input.device)
        self._work = dist.all_to_all_single(
            self._rows, input.reshape(-1), group=group, async_op=async_op
        )

    def wait(self) -> bool:
        if self._rows is not None:
            if self._work is not None:
                self._work.wait()
            rows = self._rows.view(-1, self._out.numel())
            torch.add(rows[0], rows[1], out=self._out.view(-1))
            for r in range(2, rows.shape[0]):
                self._out.view(-1).add_(rows[r])
            if self._pool is not None:
                self._pool.give(self._rows)
            self._rows = self._work = None
        return True


def _gloo(group) -> bool:
    """Whether ``group`` of 2 or more ranks runs on gloo, where zerostack's own reduce-scatter
    and all-gather beat torch's (on NCCL torch's are the ones to use)."""
    return dist.get_backend(group) == "gloo" and dist.get_world_size(group) >= 2


def _reduce_scatter_rows(output, input, *, op, group, async_op, pool=None):
    """A summing reduce-scatter into a contiguous output over a gloo group of 2 or more ranks:
    :class:`_SummedRows`; anything else: torch's."""
    if op != dist.ReduceOp.SUM or not output.is_contiguous() or not _gloo(group):
        return _reduce_scatter(output, input, op=op, group=group, async_op=async_op)
    summed = _SummedRows(output, input, group, async_op, pool)
    if not async_op:
        summed.wait()
        return None
    return summed


class _PeerGather:
    """gloo's all-gather as zerostack runs it: each ``inputs[i]`` goes to every other rank of
    the group and each rank's lands in its row of ``outputs[i]``, all sends and receives of all
    the pairs posted together (``batch_isend_irecv``). The same bytes as a ring all-gather; for
    a 4M-element fp32 output at 2 ranks, 0.62x an all-reduce's time where torch's gloo
    all-gather took 0.77x (``benchmarks/collectives.py``). An input may be its rank's row of
    its output; several pairs need no send or receive buffer around them."""

    def __init__(self, outputs: list, inputs: list, group, async_op: bool) -> None:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        peers = [r for r in range(world) if r != rank]
        sends, recvs = [], []
        for output, input in zip(outputs, inputs, strict=True):
            if output.numel() != input.numel() * world:
                raise ValueError(
                    f"all_gather: output of {output.numel()} elements for an input of "
                    f"{input.numel()} over {world} ranks (want {input.numel() * world})"
                )
            rows = output.view(world, -1)
            src = input.reshape(-1)
            if rows[rank].data_ptr() != src.data_ptr():
                rows[rank].copy_(src)
            for r in peers:  # (a pair's transfers are matched in the order they are posted)
                peer = dist.get_global_rank(group, r)
                sends.append(dist.P2POp(dist.isend, src, peer, group))
                recvs.append(dist.P2POp(dist.irecv, rows[r], peer, group))
        self._works = dist.batch_isend_irecv(sends + recvs) if sends else []
        if not async_op:
            self.wait()

    def wait(self) -> bool:
        for w in self._works:
            w.wait()
        self._works = []
        return True


class _Each:
    """Several in-flight collectives, waited for as one."""

    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self) -> bool:
        for w in self._works:
            w.wait()
        self._works = []
        return True


def _in_place_row(output, input, group) -> bool:
    """Whether ``input`` is exactly this rank's row of ``output`` on an NCCL group, which
    gathers in place (NCCL documents it; torch's gloo does not promise it)."""
    if dist.get_backend(group) != "nccl" or not output.is_contiguous() or not input.is_contiguous():
        return False
    rank, n = dist.get_rank(group), input.numel()
    return input.data_ptr() == output.data_ptr() + rank * n * output.element_size()


def _all_gather_peers(output, input, *, group, async_op):
    """An all-gather into a contiguous output over a gloo group of 2 or more ranks:
    :class:`_PeerGather`; anything else: torch's."""
    if not output.is_contiguous() or not _gloo(group):
        start = output.data_ptr()
        overlaps = start <= input.data_ptr() < start + output.nbytes
        if overlaps and not _in_place_row(output, input, group):  # else not assumed
            input = input.clone()
        return _all_gather(output, input, group=group, async_op=async_op)
    gathered = _PeerGather([output], [input], group, async_op)
    return gathered if async_op else None


def _all_gather_each(outputs, inputs, *, group, async_op):
    """:meth:`Comm.all_gather_each`: one :class:`_PeerGather` over gloo, else one all-gather
    per pair."""
    if _gloo(group) and all(o.is_contiguous() for o in outputs):
        gathered = _PeerGather(outputs, inputs, group, async_op)
        return gathered if async_op else None
    works = [
        _all_gather_peers(o, i, group=group, async_op=True)
        for o, i in zip(outputs, inputs, strict=True)
    ]
    each = _Each(works)
    if not async_op:
        each.wait()
        return None
    return each


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
        return _gloo(group if group is not None else self.group(axis))

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, *, axis: str = "dp", async_op=False
    ) -> Handle | None:
        """Row ``r`` of ``input`` (N equal rows, flattened) goes to the axis's rank ``r``;
        ``output``'s row ``s`` comes from rank ``s``. Logged as the bytes this rank sends."""
        return self._run(
            "all_to_all",
            axis,
            input.numel() * input.element_size(),
            lambda g, a: dist.all_to_all_single(output, input, group=g, async_op=a),
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
