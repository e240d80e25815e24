"""The schedule simulator: runs every rank's instruction stream together, without processes.

It implements the executor's communication model exactly (see :mod:`.schedule`): batches of
consecutive sends and receives posted at once, each op matched when the peer has posted its
counterpart. It reports the step's makespan, each rank's busy and idle time and peak live
activations, and raises :class:`~.schedule.DeadlockError` naming the stuck ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .schedule import (
    STEP_TAIL,
    Backward,
    CommInstruction,
    ComputeInstruction,
    DeadlockError,
    Forward,
    Instruction,
    LoadMicroBatch,
    RecvActivation,
    RecvGrad,
    ScheduleError,
    SendActivation,
    SendGrad,
    build_streams,
    peer_of,
)

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
    queues: dict[tuple, list] = {}  # (sender, receiver, is_send) -> messages in posting order
    for rank, pos, op in sorted(ends.values(), key=lambda e: e[:2]):
        other = ends.get((*op.key[:3], not op.ins.is_send))
        if other is None:
            want = ("Recv" if op.ins.is_send else "Send") + type(op.ins).__name__[4:]
            raise ScheduleError(f"{op.ins} on rank {rank} has no matching {want} on rank {op.peer}")
        if op.peer == rank and op.ins.is_send and other[1] < pos:
            raise ScheduleError(f"{op.ins} on rank {rank} is a local handoff after its Recv")
        if op.peer != rank:
            pair = (rank, op.peer) if op.ins.is_send else (op.peer, rank)
            queues.setdefault((*pair, op.ins.is_send), []).append((op.key[:3], rank, op.ins))
    for (sender, receiver, is_send), sent in queues.items():
        if not is_send:
            continue
        got = queues[(sender, receiver, False)]
        for (key, _, send), (other, _, recv) in zip(sent, got, strict=True):
            if key != other:  # gloo and NCCL match a pair's messages in the order posted
                raise ScheduleError(
                    f"{send} on rank {sender} meets {recv} on rank {receiver}: rank {receiver} "
                    f"receives from rank {sender} in another order than it sends"
                )
    return steps


def validate(streams: list[list[Instruction]], *, chunks: int = 1) -> None:
    """Raise :class:`ScheduleError` unless every stream keeps its own dependencies (Recv before
    Forward/Backward, Forward before Backward, ...), every Send has exactly one Recv, and two
    ranks post the messages between them in the same order."""
    _parse_all(streams, chunks)


def check_schedule(name: str, stages: int, micro_batches: int, chunks: int = 1) -> SimResult:
    """Build schedule ``name`` for every rank and simulate it: what ``initialize`` runs before it
    accepts a pipeline configuration, so a schedule the executor would hang on is refused there.

    >>> check_schedule("interleaved", stages=2, micro_batches=1, chunks=2).makespan
    4.0
    """
    return simulate(build_streams(name, stages, micro_batches, chunks), chunks=chunks)


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
