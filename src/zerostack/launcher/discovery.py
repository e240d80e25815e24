"""Where this process sits in the job, from whichever launcher started it: torchrun (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``), Open MPI (``OMPI_COMM_WORLD_*``), MPICH and
Intel MPI (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``) or Slurm's ``srun`` (``SLURM_PROCID``,
``SLURM_NTASKS``, ``SLURM_LOCALID``, the node list).

Pure functions over an environment mapping; :func:`zerostack.init_distributed` applies the answer
to ``os.environ`` and forms the world with torch's own ``env://`` rendezvous. MPI says nothing
about where rank 0 listens, so a multi-node MPI job needs ``MASTER_ADDR`` (``zerostack launch
--launcher openmpi|mpich`` passes it); DeepSpeed asks mpi4py instead, which zerostack does not
depend on. A world of more than one that cannot rendezvous is an error, never a silent world of
one per process.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

DEFAULT_PORT = 29500  # torch's and DeepSpeed's default MASTER_PORT
_LOOPBACK = "127.0.0.1"


class RendezvousError(RuntimeError):
    """The environment says world > 1 but gives no way for the ranks to meet."""


@dataclass(frozen=True)
class Placement:
    """This process's rank, world size, local rank and rank 0's address, and who said so."""

    source: str  # "torchrun", "arguments", "Open MPI", "MPICH/PMI" or "Slurm"
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None

    def env(self) -> dict[str, str]:
        """The torchrun-style variables torch's ``env://`` rendezvous reads."""
        out = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
        }
        if self.master_addr is not None:
            out["MASTER_ADDR"] = self.master_addr
        if self.master_port is not None:
            out["MASTER_PORT"] = str(self.master_port)
        return out


def expand_nodelist(nodelist: str) -> Iterator[str]:
    """Slurm's compressed host list, host by host: ``node[01-03,07],gpu1`` -> node01, node02,
    node03, node07, gpu1 (zero padding kept; several bracket groups in one name multiply)."""
    for item in _split_top(nodelist):
        yield from _expand_one(item)


def _split_top(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [s.strip() for s in items if s.strip()]


def _expand_one(name: str) -> Iterator[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if match is None:
        yield name
        return
    head, tail = name[: match.start()], name[match.end() :]
    for part in match.group(1).split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"Slurm node list {name!r}: bad range {part!r}")
        width = len(lo)
        for n in range(int(lo), int(hi if sep else lo) + 1):
            yield from _expand_one(f"{head}{n:0{width}d}{tail}")


def first_slurm_host(env: Mapping[str, str]) -> str | None:
    """The first host of this step's (else the job's) node list: where ``srun`` puts rank 0."""
    for key in ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"):
        if env.get(key):
            return next(expand_nodelist(env[key]), None)
    return None


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int | None:
    value = env.get(key)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise RendezvousError(f"{key}={value!r} is not an integer") from None


def _port(env: Mapping[str, str], default_port: int) -> int:
    port = _int(env, "MASTER_PORT")
    return default_port if port is None else port


def _from_launcher(env: Mapping[str, str], default_port: int) -> Placement | None:
    """Open MPI, MPICH/PMI or Slurm: rank and size, rank 0's address when it can be known."""
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        source, pre = "Open MPI", "OMPI_COMM_WORLD_"
        rank, world = _int(env, pre + "RANK"), _int(env, pre + "SIZE")
        local, local_size = _int(env, pre + "LOCAL_RANK", 0), _int(env, pre + "LOCAL_SIZE")
        addr = None
    elif "PMI_RANK" in env and "PMI_SIZE" in env:
        source = "MPICH/PMI"
        rank, world = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
        local = _int(env, "MPI_LOCALRANKID", _int(env, "PALS_LOCAL_RANKID", 0))
        local_size = _int(env, "MPI_LOCALNRANKS")
        addr = None
    elif "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env):
        source = "Slurm"
        rank = _int(env, "SLURM_PROCID")
        world = _int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS"))
        local, local_size = _int(env, "SLURM_LOCALID", 0), None
        addr = first_slurm_host(env)
    else:
        return None
    if env.get("MASTER_ADDR"):
        addr = env["MASTER_ADDR"]
    elif addr is None and local_size == world:
        addr = _LOOPBACK  # every rank is on this machine
    return Placement(source, rank, world, local, addr, _port(env, default_port))


def discover(
    env: Mapping[str, str],
    *,
    rank: int = -1,
    world_size: int = -1,
    default_port: int = DEFAULT_PORT,
    mpi: bool = True,
) -> Placement | None:
    """This process's :class:`Placement`, or None when nothing says there is a job (a plain
    ``python script.py``: a world of one).

    Precedence: the ``rank``/``world_size`` arguments, torchrun's ``RANK``/``WORLD_SIZE``, then
    (with ``mpi``) Open MPI, MPICH/PMI and Slurm. ``MASTER_ADDR``/``MASTER_PORT`` from the
    environment win over what a launcher implies; a missing port is ``default_port``. Raises
    :class:`RendezvousError` when the world is larger than one and rank 0's address is unknown.
    """
    if world_size > 0 or rank >= 0:
        if world_size < 1 or rank < 0:
            raise RendezvousError(
                f"init_distributed(rank={rank}, world_size={world_size}): give both or neither"
            )
        found = Placement(
            "arguments",
            rank,
            world_size,
            _int(env, "LOCAL_RANK", 0),
            env.get("MASTER_ADDR") or None,
            _port(env, default_port),
        )
    elif "RANK" in env and "WORLD_SIZE" in env:
        found = Placement(
            "torchrun",
            _int(env, "RANK"),
            _int(env, "WORLD_SIZE"),
            _int(env, "LOCAL_RANK", 0),
            env.get("MASTER_ADDR") or None,
            _port(env, default_port),
        )
    elif mpi:
        found = _from_launcher(env, default_port)
    else:
        found = None
    if found is None:
        return None
    if not 0 <= found.rank < found.world_size:
        raise RendezvousError(
            f"{found.source} says rank {found.rank} of a world of {found.world_size}"
        )
    if found.world_size > 1 and found.master_addr is None:
        raise RendezvousError(
            f"{found.source} says this is rank {found.rank} of {found.world_size}, but "
            "MASTER_ADDR is not set, so the ranks cannot meet: set MASTER_ADDR (rank 0's host) "
            "and MASTER_PORT, or launch with torchrun or zerostack launch"
        )
    return found
