"""Which hosts and slots a job runs on: DeepSpeed's hostfile, ``--include``/``--exclude`` and
``--num_nodes``/``--num_gpus``, as pure functions over plain data.

A hostfile names one host per line with its slot count (GPUs, or processes on a CPU host)::

    # comments and blank lines are skipped
    worker-0 slots=8
    worker-1 slots=8

A filter is ``NODE_SPEC[@NODE_SPEC ...]`` with ``NODE_SPEC = NAME[:SLOT[,SLOT ...]]``:
``--include "worker-0@worker-1:0,2"`` runs on every slot of worker-0 and slots 0 and 2 of
worker-1; ``--exclude "worker-1:0"`` runs on everything but slot 0 of worker-1. The result keeps
the hostfile's order, which fixes the order of the nodes (and so of the ranks).
"""

from __future__ import annotations

import re
from pathlib import Path

Resources = dict[str, list[int]]  # host -> slot ids, in hostfile order

_LINE = re.compile(r"^(\S+)\s+slots=(\d+)(\s+\w+=\S+)*$")  # Open MPI's max_slots=N may follow


class LaunchError(ValueError):
    """The job cannot be launched as asked (hostfile, filters, launcher); one line."""


def parse_hostfile(text: str, path: str = "hostfile") -> dict[str, int]:
    """``{host: slots}`` from a hostfile's text, in its order; a bad line names ``path:line``."""
    pool: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if match is None:
            raise LaunchError(
                f"{path}:{number}: {raw.strip()!r} is not 'HOSTNAME slots=N' (DeepSpeed's format)"
            )
        host, slots = match.group(1), int(match.group(2))
        if host in pool:
            raise LaunchError(
                f"{path}:{number}: host {host!r} is listed again (first at line {first_line[host]})"
            )
        if slots < 1:
            raise LaunchError(f"{path}:{number}: host {host!r} has slots={slots}; needs >= 1")
        pool[host] = slots
        first_line[host] = number
    if not pool:
        raise LaunchError(f"{path}: no hosts (expected lines like 'worker-0 slots=8')")
    return pool


def read_hostfile(path: str) -> dict[str, int]:
    """:func:`parse_hostfile` on a file; a missing file is a :class:`LaunchError` naming it."""
    file = Path(path)
    if not file.is_file():
        raise LaunchError(f"--hostfile {path}: no such file")
    return parse_hostfile(file.read_text(), str(path))


def parse_filter(spec: str, flag: str = "--include") -> dict[str, list[int]]:
    """``{host: sorted slot ids}`` from ``NAME[:SLOT,...]@...``; an empty list means every slot."""
    nodes: dict[str, list[int]] = {}
    for part in spec.split("@"):
        name, sep, slots = part.partition(":")
        if not name or (sep and not slots):
            raise LaunchError(f"{flag} {spec!r}: {part!r} is not NAME or NAME:SLOT[,SLOT...]")
        try:
            ids = [int(s) for s in slots.split(",")] if sep else []
        except ValueError:
            raise LaunchError(f"{flag} {spec!r}: slots in {part!r} must be integers") from None
        nodes[name] = sorted(set(nodes.get(name, []) + ids))
    return nodes


def apply_filter(pool: dict[str, int], include: str = "", exclude: str = "") -> Resources:
    """The hosts and slots left after ``--include`` or ``--exclude`` (mutually exclusive), in
    the pool's order; a host or slot the pool does not have is an error, as in DeepSpeed."""
    if include and exclude:
        raise LaunchError("--include and --exclude are mutually exclusive")
    full: Resources = {host: list(range(n)) for host, n in pool.items()}
    if not include and not exclude:
        return full
    flag, spec = ("--include", include) if include else ("--exclude", exclude)
    chosen: Resources = {} if include else {h: list(s) for h, s in full.items()}
    for host, slots in parse_filter(spec, flag).items():
        if host not in full:
            raise LaunchError(f"{flag} {spec!r}: host {host!r} is not in the hostfile")
        for slot in slots:
            if slot not in full[host]:
                raise LaunchError(
                    f"{flag} {spec!r}: host {host!r} has no slot {slot} "
                    f"(it has slots 0-{len(full[host]) - 1})"
                )
        if include:
            chosen[host] = slots or full[host]
        else:
            chosen[host] = [s for s in chosen[host] if s not in slots] if slots else []
    kept = {host: chosen[host] for host in full if chosen.get(host)}
    if not kept:
        raise LaunchError(f"{flag} {spec!r}: no slots left to run on")
    return kept


def select(resources: Resources, num_nodes: int = -1, num_gpus: int = -1) -> Resources:
    """The first ``num_nodes`` hosts and the first ``num_gpus`` slots of each (-1: all).

    Unlike DeepSpeed, which quietly runs on fewer nodes or more slots than there are, asking for
    more nodes than the hostfile lists or more slots than a host has is an error."""
    hosts = list(resources)
    if num_nodes == 0 or num_nodes < -1 or num_gpus == 0 or num_gpus < -1:
        raise LaunchError("--num_nodes and --num_gpus must be >= 1")
    if num_nodes > len(hosts):
        raise LaunchError(f"--num_nodes {num_nodes}: the hostfile lists only {len(hosts)} hosts")
    if num_nodes > 0:
        hosts = hosts[:num_nodes]
    out: Resources = {}
    for host in hosts:
        slots = resources[host]
        if num_gpus > len(slots):
            raise LaunchError(f"--num_gpus {num_gpus}: host {host!r} has only {len(slots)} slots")
        out[host] = slots[:num_gpus] if num_gpus > 0 else list(slots)
    return out
