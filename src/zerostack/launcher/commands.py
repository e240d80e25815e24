"""The command lines a launch runs, as pure functions of a :class:`Job`: ``torchrun`` for one
node, and the ``ssh``, ``pdsh``, ``srun`` and ``mpirun`` lines around it.

Two shapes, as DeepSpeed has them:

- ``local``, ``ssh`` and ``pdsh`` start one ``torchrun`` agent per node (torch's elastic agent and
  its c10d rendezvous do the rest; zerostack adds no rendezvous of its own);
- ``slurm``, ``openmpi`` and ``mpich`` start one process per rank, and each rank finds its place
  in the environment the scheduler gives it (:mod:`zerostack.launcher.discovery`), meeting rank 0
  at ``MASTER_ADDR``/``MASTER_PORT`` through torch's ``env://`` rendezvous.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field

from .hostfile import LaunchError

LOCAL_RANK_SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "local_rank.py")
PDSH_MAX_FAN_OUT = 1024  # DeepSpeed's


@dataclass
class Job:
    """What to run where: the nodes (host -> slot ids, in rank order) and the user's command."""

    nodes: dict[str, list[int]]
    script: str
    script_args: list[str] = field(default_factory=list)
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: one local node, torchrun --standalone picks a port
    rdzv_backend: str = "c10d"  # or "static" (fixed node ranks, DeepSpeed's rank order)
    rdzv_id: str = "zerostack"
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    torchrun_args: list[str] = field(default_factory=list)
    exports: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable

    @property
    def hosts(self) -> list[str]:
        return list(self.nodes)

    @property
    def world_size(self) -> int:
        return sum(len(slots) for slots in self.nodes.values())

    def port(self) -> int:
        return 29500 if self.master_port is None else self.master_port


def _user_command(job: Job) -> list[str]:
    """The user's program after torchrun's options: the script, or DeepSpeed's ``--local_rank``
    argument added by a small exec shim (torchrun passes the local rank only in the environment)."""
    if job.module and job.no_python:
        raise LaunchError("--module and --no_python cannot be used together")
    if job.no_local_rank:
        mode = ["-m"] if job.module else ["--no-python"] if job.no_python else []
        return [*mode, job.script, *job.script_args]
    mode = ["--module"] if job.module else ["--no_python"] if job.no_python else []
    return [LOCAL_RANK_SHIM, *mode, job.script, *job.script_args]


def torchrun_command(job: Job, node_rank: int) -> list[str]:
    """``python -m torch.distributed.run ...`` for node ``node_rank`` of the job."""
    hosts = job.hosts
    if not 0 <= node_rank < len(hosts):
        raise LaunchError(f"--node_rank {node_rank}: the job has nodes 0-{len(hosts) - 1}")
    nproc = len(job.nodes[hosts[node_rank]])
    cmd = [job.python, "-u", "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    if len(hosts) == 1 and job.master_port is None:
        cmd.append("--standalone")  # a free port on this machine, picked by torchrun
    elif job.rdzv_backend == "static":
        cmd += [
            f"--nnodes={len(hosts)}",
            f"--node_rank={node_rank}",
            f"--master_addr={job.master_addr}",
            f"--master_port={job.port()}",
        ]
    elif job.rdzv_backend == "c10d":
        cmd += [
            f"--nnodes={len(hosts)}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={job.master_addr}:{job.port()}",
            f"--rdzv_id={job.rdzv_id}",
        ]
    else:
        raise LaunchError(f"--rdzv_backend {job.rdzv_backend!r} is not one of c10d, static")
    return cmd + list(job.torchrun_args) + _user_command(job)


def visible_devices(slots: list[int]) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for a node whose slots are not simply its first devices."""
    if slots == list(range(len(slots))):
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, slots))}


def node_env(job: Job, node_rank: int) -> dict[str, str]:
    """The variables node ``node_rank``'s agent runs with, on top of the launcher's own."""
    return {**job.exports, **visible_devices(job.nodes[job.hosts[node_rank]])}


def remote_shell(job: Job, node_rank: int | str, cwd: str, argv: list[str]) -> str:
    """One shell line for a remote node: go to ``cwd``, export, run ``argv``."""
    env = node_env(job, node_rank) if isinstance(node_rank, int) else dict(job.exports)
    parts = [f"cd {shlex.quote(cwd)}"]
    parts += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    parts.append("exec " + " ".join(shlex.quote(a) for a in argv))
    return "; ".join(parts)


def ssh_command(
    job: Job, node_rank: int, cwd: str, ssh_port: int | None = None, ssh_args: list[str] = ()
) -> list[str]:
    """``ssh host '<cd; exports; torchrun ...>'`` for one node."""
    port = ["-p", str(ssh_port)] if ssh_port is not None else []
    line = remote_shell(job, node_rank, cwd, torchrun_command(job, node_rank))
    return ["ssh", *port, *ssh_args, job.hosts[node_rank], line]


def pdsh_command(job: Job, cwd: str, pdsh_args: list[str] = ()) -> list[str]:
    """One ``pdsh`` line for every node; pdsh puts each node's index in the list for ``%n``.

    One line means one command for all nodes, so every node needs the same slots."""
    slot_sets = {tuple(s) for s in job.nodes.values()}
    if len(slot_sets) > 1:
        raise LaunchError(
            f"--launcher pdsh runs one command on every node, but the nodes have different "
            f"slots {dict(job.nodes)}; use --launcher ssh"
        )
    argv = torchrun_command(job, 0)
    if job.rdzv_backend == "static" and not (len(job.hosts) == 1 and job.master_port is None):
        argv = [a if not a.startswith("--node_rank=") else "--node_rank=%n" for a in argv]
    line = remote_shell(job, 0, cwd, argv)
    hosts = ",".join(job.hosts)
    return ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", hosts, *pdsh_args, line]


def _per_rank_program(job: Job) -> list[str]:
    if job.module and job.no_python:
        raise LaunchError("--module and --no_python cannot be used together")
    if job.no_python:
        return [job.script, *job.script_args]
    return [job.python, "-u", *(["-m"] if job.module else []), job.script, *job.script_args]


def _uniform(job: Job, launcher: str) -> int:
    """Slots per node for launchers that place ranks by count, never by device id."""
    counts = {len(s) for s in job.nodes.values()}
    for host, slots in job.nodes.items():
        if slots != list(range(len(slots))):
            raise LaunchError(
                f"--launcher {launcher} cannot pick device ids ({host}: slots {slots}); filter "
                "whole hosts or keep the first N slots of every host"
            )
    if len(counts) > 1:
        sizes = {h: len(s) for h, s in job.nodes.items()}
        raise LaunchError(f"--launcher {launcher} needs the same slot count on every host: {sizes}")
    return counts.pop()


def srun_command(
    job: Job, srun_args: list[str] = (), pass_master_addr: bool = False, nodelist: bool = True
) -> list[str]:
    """``srun`` with one task per rank; each finds its rank in Slurm's variables, and rank 0's
    address in the step's node list unless ``pass_master_addr``."""
    per_node = _uniform(job, "slurm")
    cmd = ["srun", "-n", str(job.world_size), "--nodes", str(len(job.hosts))]
    cmd += ["--ntasks-per-node", str(per_node)]
    if nodelist:
        cmd += ["--nodelist", ",".join(job.hosts)]
    exports = {"MASTER_PORT": str(job.port()), **job.exports}
    if pass_master_addr:
        exports["MASTER_ADDR"] = job.master_addr
    export = ",".join(["--export=ALL", *(f"{k}={v}" for k, v in exports.items())])
    return [*cmd, *srun_args, export, *_per_rank_program(job)]


def _master_exports(job: Job) -> dict[str, str]:
    return {"MASTER_ADDR": job.master_addr, "MASTER_PORT": str(job.port()), **job.exports}


def openmpi_command(job: Job, mpirun_args: list[str] = ()) -> list[str]:
    """Open MPI's ``mpirun`` with one process per rank (``--host h:slots``, in hostfile order);
    each rank reads ``OMPI_COMM_WORLD_*`` and meets rank 0 at the exported ``MASTER_ADDR``."""
    _uniform_ids(job, "openmpi")
    hosts = ",".join(f"{h}:{len(s)}" for h, s in job.nodes.items())
    cmd = ["mpirun", "-n", str(job.world_size), "--host", hosts, *mpirun_args]
    for key, value in _master_exports(job).items():
        cmd += ["-x", f"{key}={value}"]
    return cmd + _per_rank_program(job)


def mpich_command(job: Job, mpirun_args: list[str] = ()) -> list[str]:
    """MPICH's (Hydra) ``mpirun``: ``-n``, ``-ppn`` and ``-hosts``, the variables by ``-genv``;
    each rank reads ``PMI_RANK``/``PMI_SIZE``/``MPI_LOCALRANKID``."""
    per_node = _uniform(job, "mpich")
    cmd = ["mpirun", "-n", str(job.world_size), "-ppn", str(per_node), *mpirun_args]
    for key, value in _master_exports(job).items():
        cmd += ["-genv", key, value]
    return [*cmd, "-hosts", ",".join(job.hosts), *_per_rank_program(job)]


def _uniform_ids(job: Job, launcher: str) -> None:
    for host, slots in job.nodes.items():
        if slots != list(range(len(slots))):
            raise LaunchError(
                f"--launcher {launcher} cannot pick device ids ({host}: slots {slots}); filter "
                "whole hosts or keep the first N slots of every host"
            )
