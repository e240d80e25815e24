"""Pipeline schedules as per-rank instruction streams, and a simulator that times and checks them.

A schedule is a plain list of :class:`Instruction` per pipeline rank. The executor runs one list;
:func:`simulate` runs all of them together without processes, so deadlock-freedom, the bubble and
activation memory are unit-tested as arithmetic::

    streams = build_streams("1f1b", stages=4, micro_batches=8)
    streams[3][:4]     # [RecvAct(mb=0, chunk=0), Load(mb=0), F(mb=0, chunk=0), B(mb=0, chunk=0)]
    simulate(streams).bubble_fraction   # 0.2727... = (p - 1) / (m + p - 1)

With ``p`` ranks and ``v`` model chunks per rank, chunk ``c`` of rank ``s`` is virtual stage
``c * p + s``: activations flow from virtual stage ``vs`` to ``vs + 1``, gradients back.

Communication model (the executor implements exactly this): a maximal run of consecutive
Send/Recv instructions in one stream is one batch, posted at once (``batch_isend_irecv``); the
rank then waits until every op of the batch is matched, and an op is matched once the peer has
posted the batch holding its counterpart (rendezvous: a Send waits for its Recv too). A Send to
the same rank (``p == 1`` with several chunks) is a local handoff: matched at once, and it must
precede its Recv. A Recv may come a few compute instructions before the one that consumes it
(interleaved), so the executor keeps received tensors by ``(micro, chunk)`` until used.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import ClassVar, NamedTuple


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
    if name == "interleaved":
        return interleaved(stages, micro_batches, stage, chunks)
    return (gpipe if name == "gpipe" else one_f_one_b)(stages, micro_batches, stage)


def build_streams(name: str, stages: int, micro_batches: int, chunks: int = 1) -> list[list]:
    """Every rank's stream, ready for :func:`simulate`."""
    return [build_schedule(name, stages, micro_batches, s, chunks) for s in range(stages)]


# --- simulator ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimResult:
    """Timing of one simulated step, in the units of ``simulate``'s costs."""

    makespan: float
    busy: tuple[float, ...]  # per rank: time in Forward/Backward
    idle: tuple[float, ...]  # per rank: makespan - busy
    finish: tuple[float, ...]  # per rank: when its last instruction completed
    peak_activations: tuple[int, ...]  # per rank: most (micro, chunk) forwarded, not backward

    @property
    def bubble_fraction(self) -> float:
        """Mean over ranks of idle / makespan."""
        return sum(self.idle) / len(self.idle) / self.makespan if self.makespan else 0.0


class _Op(NamedTuple):
    ins: CommInstruction
    key: tuple  # (kind, micro, sender's virtual stage, is_send)
    peer: int
    waits_on: tuple | None  # the counterpart's key; None for a local Send, matched at once


# What must come earlier in the same stream. A Recv is needed only where the virtual stage has a
# neighbour on that side, a Load only on the ranks that read data.
_NEEDS = {
    Forward: (RecvActivation, LoadMicroBatch),
    Backward: (Forward, RecvGrad),
    SendActivation: (Forward,),
    SendGrad: (Backward,),
}


_COMM = (SendActivation, RecvActivation, SendGrad, RecvGrad)
_TAIL = {type(i) for i in STEP_TAIL}


def _parse(rank: int, stream: list, stages: int, chunks: int) -> list:
    """Check one rank's own order; return its compute instructions and batches (lists of _Op)."""
    last = stages * chunks - 1
    owns_io = rank in (0, last % stages)
    seen: set[tuple] = set()
    steps: list = []

    def fail(i: int, why: str) -> ScheduleError:
        return ScheduleError(f"rank {rank}, instruction {i}: {stream[i]!r}: {why}")

    in_batch = False  # whether the previous instruction was a transfer
    for i, ins in enumerate(stream):
        kind = type(ins)  # exact types: the executor dispatches on them too
        if kind in _TAIL:
            in_batch = False
            continue
        if kind is LoadMicroBatch:
            if not owns_io:
                raise fail(i, f"rank {rank} holds neither the first nor the last virtual stage")
            key = (kind, ins.micro, None)
        elif kind is Forward or kind is Backward or kind in _COMM:
            if not 0 <= ins.chunk < chunks:
                raise fail(i, f"chunk out of range 0..{chunks - 1}")
            vs = ins.chunk * stages + rank
            for need in _NEEDS.get(kind, ()):
                if need is LoadMicroBatch:
                    missing = owns_io and (need, ins.micro, None) not in seen
                else:
                    absent = (need is RecvActivation and vs == 0) or (
                        need is RecvGrad and vs == last
                    )
                    missing = not absent and (need, ins.micro, ins.chunk) not in seen
                if missing:
                    raise fail(i, f"comes before its {need.__name__}")
            key = (kind, ins.micro, ins.chunk)
        else:
            raise fail(i, "not an Instruction of this module")
        if key in seen:
            raise fail(i, "appears twice")
        seen.add(key)
        if kind is Forward or kind is Backward:
            steps.append(ins)
        elif kind in _COMM:
            peer, _ = peer_of(ins, rank, stages, chunks)
            sender = vs if ins.is_send else vs + (-1 if ins.kind == "act" else 1)
            key = (ins.kind, ins.micro, sender)
            local_send = peer == rank and ins.is_send
            op = _Op(
                ins, (*key, ins.is_send), peer, None if local_send else (*key, not ins.is_send)
            )
            if in_batch:
                steps[-1].append(op)
            else:
                steps.append([op])
        in_batch = kind in _COMM
    return steps


def _parse_all(streams: list[list[Instruction]], chunks: int) -> list[list]:
    if not streams:
        raise ScheduleError("streams: need at least one rank")
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunks: must be an integer >= 1, got {chunks!r}")
    steps = [_parse(rank, s, len(streams), chunks) for rank, s in enumerate(streams)]
    ends: dict[tuple, tuple[int, int, _Op]] = {}  # key -> (rank, position among its ops, op)
    for rank, rank_steps in enumerate(steps):
        ops = [op for step in rank_steps if isinstance(step, list) for op in step]
        ends.update((op.key, (rank, pos, op)) for pos, op in enumerate(ops))
    for rank, pos, op in ends.values():
        other = ends.get((*op.key[:3], not op.ins.is_send))
        if other is None:
            want = ("Recv" if op.ins.is_send else "Send") + type(op.ins).__name__[4:]
            raise ScheduleError(f"{op.ins} on rank {rank} has no matching {want} on rank {op.peer}")
        if op.peer == rank and op.ins.is_send and other[1] < pos:
            raise ScheduleError(f"{op.ins} on rank {rank} is a local handoff after its Recv")
    return steps


def validate(streams: list[list[Instruction]], *, chunks: int = 1) -> None:
    """Raise :class:`ScheduleError` unless every stream keeps its own dependencies (Recv before
    Forward/Backward, Forward before Backward, ...) and every Send has exactly one Recv."""
    _parse_all(streams, chunks)


def simulate(
    streams: list[list[Instruction]],
    *,
    forward: float = 1.0,
    backward: float = 1.0,
    comm: float = 0.0,
    chunks: int = 1,
) -> SimResult:
    """Run all ranks' streams together under the batch-rendezvous model; time and check them.

    ``forward``/``backward`` cost one micro-batch through all of a rank's layers, so a chunk
    takes ``1 / chunks`` of it. A batch completes ``comm`` after the last of its ops and their
    counterparts was posted (``0`` if all are local). Loads and the step tail take no time.
    Raises :class:`ScheduleError` for malformed streams (see :func:`validate`) and
    :class:`DeadlockError` naming each stuck rank and an op it waits on.
    """
    for name, value in (("forward", forward), ("backward", backward), ("comm", comm)):
        if not value >= 0:
            raise ValueError(f"{name}: must be a cost >= 0, got {value!r}")
    steps = _parse_all(streams, chunks)
    p = len(streams)
    cost = {Forward: forward / chunks, Backward: backward / chunks}
    posted: dict[tuple, float] = {}  # op key -> when its batch was posted
    pc, clock, busy, live, peak = [0] * p, [0.0] * p, [0.0] * p, [0] * p, [0] * p
    waiting = [False] * p

    def advance(r: int) -> bool:
        moved = False
        while pc[r] < len(steps[r]):
            step = steps[r][pc[r]]
            if isinstance(step, ComputeInstruction):
                clock[r] += cost[type(step)]
                busy[r] += cost[type(step)]
                live[r] += 1 if isinstance(step, Forward) else -1
                peak[r] = max(peak[r], live[r])
            else:
                if not waiting[r]:
                    posted.update((op.key, clock[r]) for op in step)
                    waiting[r] = moved = True
                matched = [posted.get(op.waits_on) for op in step if op.waits_on]
                if None in matched:
                    return moved
                remote = any(op.peer != r for op in step)
                clock[r] = max([clock[r], *matched]) + (comm if remote else 0.0)
                waiting[r] = False
            pc[r], moved = pc[r] + 1, True
        return moved

    while True:
        moved = [advance(r) for r in range(p)]  # a list, not any(): every rank gets its turn
        stuck = [r for r in range(p) if pc[r] < len(steps[r])]
        if not stuck:
            break
        if not any(moved):
            waits = []
            for r in stuck:
                op = next(o for o in steps[r][pc[r]] if o.waits_on and o.waits_on not in posted)
                waits.append(f"rank {r} waits on {op.ins} with rank {op.peer}")
            ranks = ", ".join(map(str, stuck))
            raise DeadlockError(f"deadlock: ranks {ranks} are stuck; " + "; ".join(waits))
    makespan = max(clock)
    return SimResult(
        makespan=makespan,
        busy=tuple(busy),
        idle=tuple(makespan - b for b in busy),
        finish=tuple(clock),
        peak_activations=tuple(peak),
    )
