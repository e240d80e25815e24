"""Pipeline schedules as per-rank instruction streams.

A schedule is a plain list of :class:`Instruction` per pipeline rank. The executor runs one list;
:func:`zerostack.pipeline.simulate.simulate` runs all of them together without processes, so
deadlock-freedom, the bubble and activation memory are unit-tested as arithmetic::

    streams = build_streams("1f1b", stages=4, micro_batches=8)
    streams[3][:4]     # [RecvAct(mb=0, chunk=0), Load(mb=0), F(mb=0, chunk=0), B(mb=0, chunk=0)]
    simulate(streams).bubble_fraction   # 0.2727... = (p - 1) / (m + p - 1)

With ``p`` ranks and ``v`` model chunks per rank, chunk ``c`` of rank ``s`` is virtual stage
``c * p + s``: activations flow from virtual stage ``vs`` to ``vs + 1``, gradients back.

Communication model (the executor implements exactly this): a maximal run of consecutive
Send/Recv instructions in one stream is one batch, posted at once (``batch_isend_irecv``); the
rank then waits until every op of the batch is matched, and an op is matched once the peer has
posted the batch holding its counterpart (rendezvous: a Send waits for its Recv too). Between two
ranks, messages are matched in the order they are posted (as gloo and NCCL match them), so the
sends from rank ``a`` to rank ``b`` come in the same order as ``b``'s receives from ``a``. A
Send to the same rank (``p == 1`` with several chunks) is a local handoff: matched at once, and
it must precede its Recv. A Recv may come a few compute instructions before the one that consumes it
(interleaved), so the executor keeps received tensors by ``(micro, chunk)`` until used.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import ClassVar


class ScheduleError(ValueError):
    """A stream is malformed: an unmatched Send/Recv, a Backward before its Forward, ..."""


class DeadlockError(RuntimeError):
    """Every unfinished rank waits on a batch that no peer will ever match."""


@dataclass(frozen=True, repr=False)
class Instruction:
    """One step of a rank's stream. Prints as e.g. ``F(mb=3, chunk=1)``."""

    tag: ClassVar[str] = ""

    def __repr__(self) -> str:
        args = (
            f"{'mb' if f.name == 'micro' else f.name}={getattr(self, f.name)}" for f in fields(self)
        )
        return f"{self.tag or type(self).__name__}({', '.join(args)})"

    __str__ = __repr__


@dataclass(frozen=True, repr=False)
class LoadMicroBatch(Instruction):
    """Read micro-batch ``micro`` (inputs on the first virtual stage's rank, labels on the last's),
    once per micro-batch, before its first Forward on this rank."""

    tag: ClassVar[str] = "Load"
    micro: int


@dataclass(frozen=True, repr=False)
class ComputeInstruction(Instruction):
    """Run this rank's model chunk ``chunk`` on micro-batch ``micro``: :class:`Forward` or
    :class:`Backward` (the last virtual stage computes the loss in its Forward)."""

    micro: int
    chunk: int = 0


@dataclass(frozen=True, repr=False)
class Forward(ComputeInstruction):
    tag: ClassVar[str] = "F"


@dataclass(frozen=True, repr=False)
class Backward(ComputeInstruction):
    tag: ClassVar[str] = "B"


@dataclass(frozen=True, repr=False)
class CommInstruction(Instruction):
    """A point-to-point op for ``(micro, chunk)``; consecutive ones form one batch."""

    kind: ClassVar[str] = ""  # "act" flows to virtual stage + 1, "grad" to virtual stage - 1
    is_send: ClassVar[bool] = False
    micro: int
    chunk: int = 0


@dataclass(frozen=True, repr=False)
class SendActivation(CommInstruction):
    """Send the output of Forward(micro, chunk) to the next virtual stage."""

    tag, kind, is_send = "SendAct", "act", True


@dataclass(frozen=True, repr=False)
class RecvActivation(CommInstruction):
    """Receive the input of Forward(micro, chunk) from the previous virtual stage."""

    tag, kind, is_send = "RecvAct", "act", False


@dataclass(frozen=True, repr=False)
class SendGrad(CommInstruction):
    """Send the gradient of the input of (micro, chunk) to the previous virtual stage."""

    tag, kind, is_send = "SendGrad", "grad", True


@dataclass(frozen=True, repr=False)
class RecvGrad(CommInstruction):
    """Receive the gradient of the output of (micro, chunk) from the next virtual stage."""

    tag, kind, is_send = "RecvGrad", "grad", False


@dataclass(frozen=True, repr=False)
class ReduceTiedGrads(Instruction):
    """All-reduce gradients of weights shared across stages (e.g. tied embeddings)."""


@dataclass(frozen=True, repr=False)
class ReduceGrads(Instruction):
    """Data-parallel gradient reduction."""


@dataclass(frozen=True, repr=False)
class OptimizerStep(Instruction):
    """Step the optimizer."""


STEP_TAIL = (ReduceTiedGrads(), ReduceGrads(), OptimizerStep())  # ends every stream, in order


def peer_of(ins: CommInstruction, stage: int, stages: int, chunks: int = 1) -> tuple[int, int]:
    """``(rank, chunk)`` at the other end of ``ins`` issued by rank ``stage``.

    >>> peer_of(SendActivation(0, chunk=0), stage=3, stages=4, chunks=2)   # vs 3 -> vs 4
    (0, 1)
    """
    vs = ins.chunk * stages + stage
    other = vs + (1 if (ins.kind == "act") == ins.is_send else -1)
    if not 0 <= other < stages * chunks:
        side = "next" if other > vs else "previous"
        raise ScheduleError(f"{ins} on rank {stage}: virtual stage {vs} has no {side} stage")
    return other % stages, other // stages


# --- schedules ---------------------------------------------------------------------------------

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def _check_args(stages: int, micro_batches: int, stage: int, chunks: int) -> None:
    for name, value in (("stages", stages), ("micro_batches", micro_batches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < stages:
        raise ValueError(f"stage: {stage!r} is out of range 0..{stages - 1} for stages={stages}")


def _gpipe_slots(stages: int, micro_batches: int, stage: int, chunks: int) -> list:
    fwd = [[Forward(mb)] for mb in range(micro_batches)]
    return fwd + [[Backward(mb)] for mb in range(micro_batches)]


def _one_f_one_b_slots(stages: int, micro_batches: int, stage: int, chunks: int) -> list:
    warmup = min(stages - stage - 1, micro_batches)
    order = [Forward(mb) for mb in range(warmup)]
    for mb in range(micro_batches - warmup):
        order += [Forward(mb + warmup), Backward(mb)]
    order += [Backward(mb) for mb in range(micro_batches - warmup, micro_batches)]
    return [[op] for op in order]


def _group_sizes(stages: int, micro_batches: int) -> list[int]:
    """Micro-batches per group: as even as possible, none smaller than ``stages``."""
    total = max(micro_batches, stages)  # below `stages`, one group padded with phantoms
    groups = total // stages
    return [total // groups + (i < total % groups) for i in range(groups)]


def _interleaved_slots(stages: int, micro_batches: int, stage: int, chunks: int) -> list:
    # Slot k runs forward k, then backward k - warmup, of the table (Megatron runs them back to
    # back, with no transfer between). Warm-ups differ by 2 between neighbouring ranks, which is
    # what lines up the batches of equal phase in `_streams`.
    sizes = _group_sizes(stages, micro_batches)
    table, first = [], 0
    for size in sizes:
        table += [(mb, c) for c in range(chunks) for mb in range(first, first + size)]
        first += size
    warmup = 2 * (stages - stage - 1) + (chunks - 1) * max(sizes)
    slots = []
    for k in range(len(table) + warmup):
        slot = [Forward(*table[k])] if k < len(table) else []
        if k >= warmup:
            mb, c = table[k - warmup]
            slot.append(Backward(mb, chunks - 1 - c))
        slots.append([op for op in slot if op.micro < micro_batches])  # phantoms leave gaps
    return slots


_SLOTS = {"gpipe": _gpipe_slots, "1f1b": _one_f_one_b_slots, "interleaved": _interleaved_slots}


def _source(op: ComputeInstruction, vs: int, last: int) -> tuple | None:
    """``(type, micro, virtual stage)`` of the op whose output ``op`` consumes, if remote."""
    if isinstance(op, Forward) and vs > 0:
        return (Forward, op.micro, vs - 1)
    if isinstance(op, Backward) and vs < last:
        return (Backward, op.micro, vs + 1)
    return None


@functools.lru_cache(maxsize=1024)
def _streams(name: str, stages: int, micro_batches: int, chunks: int) -> tuple[tuple, ...]:
    """All ranks' streams: compute slots, with one batch of transfers between consecutive slots.

    A send goes in the batch right after the slot that produced it. GPipe and 1F1B receive in
    the batch right before the consuming slot (Megatron's ``send_forward_recv_backward``).
    Interleaved receives in the batch of the sender's phase (batch ``i`` of rank ``s`` has phase
    ``i + s``), at or before the consuming slot: matched batches then share a phase that grows
    along every stream, so a batch only waits on batches of lower phase and nothing deadlocks,
    for any ``micro_batches`` (empty slots merge neighbouring batches, which keeps this). The
    tests check every schedule by simulation as well.
    """
    slots = [_SLOTS[name](stages, micro_batches, s, chunks) for s in range(stages)]
    last = stages * chunks - 1
    made = {
        (type(op), op.micro, op.chunk * stages + rank): k
        for rank, rank_slots in enumerate(slots)
        for k, slot in enumerate(rank_slots)
        for op in slot
    }
    streams = []
    for rank, rank_slots in enumerate(slots):
        sends: list[list] = [[] for _ in range(len(rank_slots) + 1)]  # batch k precedes slot k
        recvs: list[list] = [[] for _ in range(len(rank_slots) + 1)]
        for k, slot in enumerate(rank_slots):
            for op in slot:
                vs = op.chunk * stages + rank
                source = _source(op, vs, last)
                if source is not None:
                    sender = source[2] % stages
                    batch = made[source] + 1 + sender - rank if name == "interleaved" else k
                    low = made[source] + 1 if sender == rank else 0
                    assert low <= batch <= k, f"{name}: {op} on rank {rank} received out of order"
                    recv = RecvActivation if isinstance(op, Forward) else RecvGrad
                    recvs[batch].append(recv(op.micro, op.chunk))
                if isinstance(op, Forward) and vs < last:
                    sends[k + 1].append(SendActivation(op.micro, op.chunk))
                elif isinstance(op, Backward) and vs > 0:
                    sends[k + 1].append(SendGrad(op.micro, op.chunk))
        loads = rank in (0, last % stages)
        loaded: set[int] = set()
        stream: list[Instruction] = []
        for k in range(len(rank_slots) + 1):
            stream += sends[k] + recvs[k]  # sends first: a local handoff's Send precedes its Recv
            for op in rank_slots[k] if k < len(rank_slots) else ():
                if loads and isinstance(op, Forward) and op.micro not in loaded:
                    loaded.add(op.micro)
                    stream.append(LoadMicroBatch(op.micro))
                stream.append(op)
        streams.append(tuple(stream) + STEP_TAIL)
    return tuple(streams)


def gpipe(stages: int, micro_batches: int, stage: int) -> list[Instruction]:
    """GPipe: all forwards, then all backwards (``micro_batches`` live activations per rank)."""
    _check_args(stages, micro_batches, stage, 1)
    return list(_streams("gpipe", stages, micro_batches, 1)[stage])


def one_f_one_b(stages: int, micro_batches: int, stage: int) -> list[Instruction]:
    """1F1B (PipeDream-flush, as Megatron and DeepSpeed): GPipe's bubble, but at most
    ``stages - stage`` live activations: ``min(stages - stage - 1, m)`` warm-up forwards, then
    one forward / one backward, then the cool-down backwards."""
    _check_args(stages, micro_batches, stage, 1)
    return list(_streams("1f1b", stages, micro_batches, 1)[stage])


def interleaved(stages: int, micro_batches: int, stage: int, chunks: int = 2) -> list[Instruction]:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron's virtual pipeline), ``chunks`` per rank.

    Micro-batches go in groups: a rank runs chunk 0 on the whole group, then chunk 1, ..., and
    backwards visit the chunks in reverse; after ``2 * (stages - stage - 1) + (chunks - 1) * g``
    warm-up forwards (``g`` the largest group) each slot is one forward then one backward. With
    groups of ``stages`` (when it divides ``micro_batches``) this is Megatron's schedule and the
    bubble is ``(p - 1) / (v * m + p - 1)``: about ``chunks`` times smaller than 1F1B's, for
    ``chunks`` times more transfers and more live activations.

    Any ``micro_batches >= 1`` works. A group needs at least ``stages`` micro-batches: rank 0
    starts chunk ``c + 1`` of a group right after chunk ``c`` of its last micro-batch, and the
    first one's input only returns ``stages`` slots after it left. So the remainder is spread
    over the groups (m=7, p=3: groups of 4 and 3; more warm-up, so more memory), and below
    ``stages`` one group is padded with phantom micro-batches whose slots stay empty. (The same
    warm-up with a smaller last group, as Megatron's schedule table builds it, leaves the ranks
    waiting on each other in a cycle at e.g. p=5, m=7, v=2.) ``chunks=1`` is :func:`one_f_one_b`.
    """
    _check_args(stages, micro_batches, stage, chunks)
    if chunks == 1:
        return one_f_one_b(stages, micro_batches, stage)
    return list(_streams("interleaved", stages, micro_batches, chunks)[stage])


def build_schedule(
    name: str, stages: int, micro_batches: int, stage: int, chunks: int = 1
) -> list[Instruction]:
    """Rank ``stage``'s stream for schedule ``name``, one of :data:`SCHEDULES`."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule: {name!r} is not one of {', '.join(SCHEDULES)}")
    if name != "interleaved" and chunks != 1:
        raise ValueError(f"chunks: {name!r} runs one chunk per stage, got chunks={chunks!r}")
    if name == "interleaved" and chunks == 1:  # as the config: one chunk is "1f1b" by its name
        raise ValueError("chunks: 'interleaved' needs chunks >= 2 (with one chunk it is '1f1b')")
    if name == "interleaved":
        return interleaved(stages, micro_batches, stage, chunks)
    return (gpipe if name == "gpipe" else one_f_one_b)(stages, micro_batches, stage)


def build_streams(name: str, stages: int, micro_batches: int, chunks: int = 1) -> list[list]:
    """Every rank's stream, ready for :func:`simulate`."""
    return [build_schedule(name, stages, micro_batches, s, chunks) for s in range(stages)]
