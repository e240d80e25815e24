"""DeepSpeed's ``deepspeed.comm`` collectives: torch.distributed's, with DeepSpeed's names and
signatures, each timed into the process's comms logger while it profiles it::

    import zerostack.comm as dist       # as `import deepspeed.comm as dist`
    dist.init_distributed()
    dist.configure(enabled=True)        # or the config's "comms_logger" block
    dist.all_reduce(t)
    dist.log_summary()                  # DeepSpeed's table, printed on rank 0

A profiled call is recorded in :data:`log` (a :class:`~zerostack.comm.CommLog`) and summarised by
:data:`comms_logger`; with the logger disabled a call costs one ``if`` over torch's. An async
call (``async_op=True``, ``isend``, ``irecv``, ``batch_isend_irecv``) returns torch's work
object wrapped so that its latency runs until ``wait()`` returns.
"""

from __future__ import annotations

import functools
import inspect
import sys
import time
from enum import Enum

import torch
import torch.distributed as td
from torch.distributed import GradBucket  # noqa: F401 - deepspeed.comm re-exports it

from .gloo import _all_gather, _reduce_scatter
from .records import CommLog
from .summary import comms_logger

log = CommLog()  # the module functions' profiled collectives


class ReduceOp(Enum):
    """DeepSpeed's reduction names (torch's ``ReduceOp`` values are accepted as well)."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7
    UNUSED = 8


def _op(op):
    if not isinstance(op, ReduceOp):
        return op
    if op is ReduceOp.UNUSED:
        raise ValueError("op: ReduceOp.UNUSED is not a reduction")
    return getattr(td.ReduceOp, op.name)


def _nbytes(x) -> int:
    if isinstance(x, list | tuple):
        return sum(_nbytes(t) for t in x)
    x = getattr(x, "tensor", x)  # a P2POp carries its tensor
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


class _Timed:
    """torch's work object of a profiled async op; the op is recorded when ``wait()`` returns."""

    def __init__(self, work, done, fail) -> None:
        self._work, self._done, self._fail = work, done, fail

    def wait(self, *args, **kwargs):
        try:
            out = self._work.wait(*args, **kwargs)
        except Exception as exc:
            self._fail(exc)
            raise
        if self._done is not None:
            self._done()
            self._done = None
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


def _collective(buffer: str | None = None, *, asynchronous: bool = False):
    """Profile a module function: ``buffer`` names the argument whose bytes the CommLog counts
    (the full buffer: an all-gather's output list or tensor); ``asynchronous`` marks ops that
    always return work objects."""

    def wrap(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not comms_logger.enabled:
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            name = a.get("log_name", fn.__name__)
            if not comms_logger.profiles(name, a.get("prof", False)):
                return fn(*args, **kwargs)
            if comms_logger.debug:
                name = f"{name} | [Caller Func: {sys._getframe(1).f_code.co_name}]"
            group = a.get("group")
            axis = "world" if group is None or group is td.group.WORLD else "group"
            ranks = td.get_world_size(group)
            rec = log.begin(fn.__name__, axis, _nbytes(a[buffer]) if buffer else 0, ranks)
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            except Exception as exc:
                log.failed(rec, exc)
                raise

            def done() -> None:
                rec.seconds = time.perf_counter() - t0
                log.end(rec)
                comms_logger.add(rec.op, name, rec.seconds, rec.bytes, ranks)

            def fail(exc: Exception) -> None:
                log.failed(rec, exc)

            if out is None or not (asynchronous or a.get("async_op", False)):
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    torch.cuda.synchronize()  # a sync NCCL call returns once enqueued
                done()
                return out
            if isinstance(out, list):  # batch_isend_irecv: done when every work is
                left = [len(out)]

                def one_done() -> None:
                    left[0] -= 1
                    if left[0] == 0:
                        done()

                return [_Timed(w, one_done, fail) for w in out]
            return _Timed(out, done, fail)

        return call

    return wrap


# ------------------------------------------------------------------ collectives
@_collective("tensor")
def all_reduce(
    tensor,
    op=ReduceOp.SUM,
    group=None,
    async_op=False,
    prof=False,
    log_name="all_reduce",
    debug=None,
):
    return td.all_reduce(tensor, op=_op(op), group=group, async_op=async_op)


@_collective("tensor")
def inference_all_reduce(
    tensor,
    op=ReduceOp.SUM,
    group=None,
    async_op=False,
    prof=False,
    log_name="all_reduce",
    debug=None,
):
    return td.all_reduce(tensor, op=_op(op), group=group)


@_collective("tensors")
def all_reduce_coalesced(
    tensors,
    op=ReduceOp.SUM,
    group=None,
    async_op=False,
    prof=False,
    log_name="all_reduce",
    debug=None,
):
    return td.all_reduce_coalesced(tensors, op=_op(op), group=group, async_op=async_op)


@_collective("tensor")
def reduce(
    tensor,
    dst,
    op=ReduceOp.SUM,
    group=None,
    async_op=False,
    prof=False,
    log_name="reduce",
    debug=None,
):
    return td.reduce(tensor, dst, op=_op(op), group=group, async_op=async_op)


@_collective("tensor")
def broadcast(
    tensor, src, group=None, async_op=False, prof=False, log_name="broadcast", debug=None
):
    return td.broadcast(tensor, src, group=group, async_op=async_op)


@_collective()
def broadcast_object_list(
    object_list,
    src,
    group=None,
    device=None,
    prof=False,
    log_name="broadcast_object_list",
    debug=None,
):
    return td.broadcast_object_list(object_list, src, group=group, device=device)


@_collective("tensor_list")
def all_gather(
    tensor_list, tensor, group=None, async_op=False, prof=False, log_name="all_gather", debug=None
):
    return td.all_gather(tensor_list, tensor, group=group, async_op=async_op)


@_collective()
def all_gather_object(
    object_list, obj, group=None, prof=False, log_name="all_gather_object", debug=None
):
    return td.all_gather_object(object_list, obj, group=group)


@_collective("output_tensor")
def all_gather_into_tensor(
    output_tensor,
    tensor,
    group=None,
    async_op=False,
    prof=False,
    log_name="all_gather_into_tensor",
    debug=None,
):
    return _all_gather(output_tensor, tensor, group=group, async_op=async_op)


def allgather_fn(output_tensor, input_tensor, group=None, async_op=False, debug=None):
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def all_gather_coalesced(output_tensors, input_tensors, group=None, async_op=False):
    """Each input gathered into its output; with ``async_op`` the last op's work (DeepSpeed's)."""
    if len(output_tensors) != len(input_tensors):
        raise ValueError("all_gather_coalesced: output_tensors and input_tensors differ in length")
    works = [
        all_gather_into_tensor(o, i, group=group, async_op=True)
        for o, i in zip(output_tensors, input_tensors, strict=True)
    ]
    for w in works[:-1]:
        w.wait()
    if async_op:
        return works[-1] if works else None
    if works:
        works[-1].wait()
    return None


@_collective("tensor")
def reduce_scatter_tensor(
    output_tensor,
    tensor,
    op=ReduceOp.SUM,
    group=None,
    async_op=False,
    prof=False,
    log_name="reduce_scatter_tensor",
    debug=None,
):
    return _reduce_scatter(output_tensor, tensor, op=_op(op), group=group, async_op=async_op)


def reduce_scatter_fn(
    output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, debug=None
):
    return reduce_scatter_tensor(
        output_tensor, tensor, op=op, group=group, async_op=async_op, prof=prof
    )


@_collective("input_list")
def reduce_scatter(
    output,
    input_list,
    op=ReduceOp.SUM,
    group=None,
    async_op=False,
    prof=False,
    log_name="reduce_scatter",
    debug=None,
):
    return td.reduce_scatter(output, input_list, op=_op(op), group=group, async_op=async_op)


@_collective("tensor")
def all_to_all_single(
    output,
    tensor,
    output_split_sizes=None,
    input_split_sizes=None,
    group=None,
    async_op=False,
    prof=False,
    log_name="all_to_all_single",
    debug=None,
):
    return td.all_to_all_single(
        output, tensor, output_split_sizes, input_split_sizes, group=group, async_op=async_op
    )


@_collective("input_tensor_list")
def all_to_all(
    output_tensor_list,
    input_tensor_list,
    group=None,
    async_op=False,
    prof=False,
    log_name="all_to_all",
    debug=None,
):
    return td.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


@_collective("tensor")
def gather(
    tensor,
    gather_list=None,
    dst=0,
    group=None,
    async_op=False,
    prof=False,
    log_name="gather",
    debug=None,
):
    return td.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op)


@_collective("tensor")
def scatter(
    tensor,
    scatter_list=None,
    src=0,
    group=None,
    async_op=False,
    prof=False,
    log_name="scatter",
    debug=None,
):
    return td.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op)


@_collective()
def barrier(
    group=None, async_op=False, device_ids=None, prof=False, log_name="barrier", debug=None
):
    return td.barrier(group=group, async_op=async_op, device_ids=device_ids)


@_collective()
def monitored_barrier(
    group=None,
    timeout=None,
    wait_all_ranks=False,
    prof=False,
    log_name="monitored_barrier",
    debug=None,
):
    return td.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


# ------------------------------------------------------------------ point to point
@_collective("tensor")
def send(tensor, dst, group=None, tag=0, prof=False, log_name="send", debug=None):
    return td.send(tensor, dst, group=group, tag=tag)


@_collective("tensor")
def recv(tensor, src=None, group=None, tag=0, prof=False, log_name="recv", debug=None):
    return td.recv(tensor, src, group=group, tag=tag)


@_collective("tensor", asynchronous=True)
def isend(tensor, dst, group=None, tag=0, prof=False, log_name="isend", debug=None):
    return td.isend(tensor, dst, group=group, tag=tag)


@_collective("tensor", asynchronous=True)
def irecv(tensor, src=None, group=None, tag=0, prof=False, log_name="irecv", debug=None):
    return td.irecv(tensor, src, group=group, tag=tag)


class P2POp:
    """One op of :func:`batch_isend_irecv`: ``op`` is :func:`isend` or :func:`irecv`, ``peer``
    a global rank."""

    def __init__(self, op, tensor, peer, group=None, tag=0) -> None:
        if op not in (isend, irecv):
            raise ValueError("P2POp: op must be zerostack.comm.isend or zerostack.comm.irecv")
        self.op = "isend" if op is isend else "irecv"
        self.tensor, self.peer, self.group, self.tag = tensor, peer, group, tag


@_collective("p2p_op_list", asynchronous=True)
def batch_isend_irecv(p2p_op_list, prof=False, log_name="batch_isend_irecv", debug=None):
    ops = [td.P2POp(getattr(td, p.op), p.tensor, p.peer, p.group, p.tag) for p in p2p_op_list]
    return td.batch_isend_irecv(ops)
