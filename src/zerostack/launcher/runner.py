"""``zerostack launch``: DeepSpeed's ``deepspeed`` launcher flags, torchrun on every node.

    zerostack launch train.py --deepspeed_config ds.json          # this machine, every GPU
    zerostack launch --num_gpus 2 train.py                        # 2 ranks (on CPU: 2 processes)
    zerostack launch -H hostfile train.py                         # pdsh to every host
    zerostack launch -H hostfile --launcher ssh -i "w0@w1:0,1" train.py
    zerostack launch -H hostfile --no_ssh --node_rank 1 train.py  # this node's share, run by hand
    zerostack launch -H hostfile --launcher slurm train.py        # srun, one task per rank

``--dry_run`` prints the commands instead of running them.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

from . import commands
from .commands import Job
from .environment import exports, is_local
from .hostfile import LaunchError, apply_filter, read_hostfile, select

DLTS_HOSTFILE = "/job/hostfile"  # DeepSpeed's default, used when it exists
LAUNCHERS = ("pdsh", "ssh", "local", "slurm", "openmpi", "mpich")
BINARIES = {"pdsh": "pdsh", "ssh": "ssh", "slurm": "srun", "openmpi": "mpirun", "mpich": "mpirun"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """DeepSpeed's runner flags (same names and defaults), and torchrun's rendezvous choice."""
    p.add_argument(
        "-H",
        "--hostfile",
        default=None,
        help="'HOST slots=N' lines (default: "
        f"{DLTS_HOSTFILE} if it exists, else this machine only)",
    )
    p.add_argument("-i", "--include", default="", help="NAME[:SLOT[,SLOT]][@NAME...]: only these")
    p.add_argument("-e", "--exclude", default="", help="same syntax: all but these")
    p.add_argument("--num_nodes", type=int, default=-1, help="the first N hosts of the hostfile")
    p.add_argument(
        "--num_gpus",
        "--num_accelerators",
        type=int,
        default=-1,
        help="slots per node (GPUs; on a CPU machine, processes; default 1 there)",
    )
    p.add_argument("--master_addr", default="", help="rank 0's host (default: the first host)")
    p.add_argument(
        "--master_port",
        type=int,
        default=None,
        help="rendezvous port (default 29500; one local node: a free port)",
    )
    p.add_argument("--node_rank", type=int, default=-1, help="with --no_ssh: this node's index")
    p.add_argument("--no_ssh", action="store_true", help="run only --node_rank's share, here")
    p.add_argument(
        "--launcher",
        default="pdsh",
        type=str.lower,
        choices=LAUNCHERS,
        help="how to reach the nodes",
    )
    p.add_argument("--launcher_args", default="", help="extra arguments for pdsh/ssh/srun/mpirun")
    p.add_argument(
        "--force_multi",
        action="store_true",
        help="use --launcher even when every node is this machine",
    )
    p.add_argument("--ssh_port", type=int, default=None, help="ssh port for remote nodes")
    p.add_argument("--module", action="store_true", help="the script is a module (python -m)")
    p.add_argument("--no_python", action="store_true", help="run the script without python")
    p.add_argument(
        "--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script"
    )
    p.add_argument(
        "--rdzv_backend",
        default="c10d",
        choices=["c10d", "static"],
        help="torchrun's rendezvous: c10d (elastic; node order by host) or static "
        "(fixed --node_rank order, rank 0 on the first host)",
    )
    p.add_argument("--rdzv_id", default="zerostack", help="torchrun's job id (same on all nodes)")
    p.add_argument("--torchrun_args", default="", help="extra torchrun options, one string")
    p.add_argument("--dry_run", action="store_true", help="print the commands; run nothing")
    p.add_argument("user_script", help="the training script (or module, with --module)")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="its arguments")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "launch",
        help="run a script on one or many nodes (DeepSpeed's launcher flags, torchrun per node)",
        description=__doc__.split("\n\n")[0],
    )
    add_arguments(p)
    return p


def _local_pool(args) -> dict[str, int]:
    import torch

    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices and args.num_gpus > devices:
        raise LaunchError(f"--num_gpus {args.num_gpus}: this machine has only {devices} GPUs")
    if devices:
        return {"localhost": devices}
    return {"localhost": max(args.num_gpus, 1)}  # CPU: processes, as many as asked


def plan(args, env=None) -> tuple[Job, bool]:
    """The :class:`Job` the flags ask for, and whether it runs here (every node local)."""
    env = os.environ if env is None else env
    if args.module and args.no_python:
        raise LaunchError("--module and --no_python cannot be used together")
    if (args.num_nodes != -1 or args.num_gpus != -1) and (args.include or args.exclude):
        raise LaunchError("--num_nodes/--num_gpus cannot be combined with --include/--exclude")
    path = args.hostfile or (DLTS_HOSTFILE if os.path.isfile(DLTS_HOSTFILE) else None)
    slurm_counts = args.launcher == "slurm" and path is None
    if slurm_counts:  # srun places the tasks; the hosts are Slurm's to choose
        if args.num_nodes < 1 or args.num_gpus < 1:
            raise LaunchError(
                "--launcher slurm without --hostfile needs --num_nodes and --num_gpus"
            )
        nodes = {f"slurm-node-{i}": list(range(args.num_gpus)) for i in range(args.num_nodes)}
    else:
        if path is None and args.num_nodes > 1:
            raise LaunchError(f"--num_nodes {args.num_nodes} needs a --hostfile listing the nodes")
        pool = read_hostfile(path) if path else _local_pool(args)
        nodes = select(
            apply_filter(pool, args.include, args.exclude), args.num_nodes, args.num_gpus
        )
    local = not slurm_counts and all(is_local(h) for h in nodes)
    master = args.master_addr or ("127.0.0.1" if path is None else next(iter(nodes)))
    port = args.master_port
    if port is None and not (len(nodes) == 1 and local):
        port = 29500
    cwd = os.getcwd()
    job = Job(
        nodes=nodes,
        script=args.user_script,
        script_args=list(args.user_args),
        master_addr=master,
        master_port=port,
        rdzv_backend=args.rdzv_backend,
        rdzv_id=args.rdzv_id,
        module=args.module,
        no_python=args.no_python,
        no_local_rank=args.no_local_rank,
        torchrun_args=shlex.split(args.torchrun_args),
        exports=exports(env, cwd, os.path.expanduser("~")),
    )
    return job, local


def commands_for(args, job: Job, local: bool) -> list[tuple[list[str], dict[str, str]]]:
    """``(argv, extra environment)`` for each process this launch starts on this machine."""
    extra = shlex.split(args.launcher_args)
    cwd = os.getcwd()
    if args.no_ssh or args.node_rank >= 0:
        if not args.no_ssh:
            raise LaunchError("--node_rank needs --no_ssh (each node then runs its own share)")
        if args.node_rank < 0:
            raise LaunchError("--no_ssh needs --node_rank (this node's index in the hostfile)")
        return [
            (commands.torchrun_command(job, args.node_rank), commands.node_env(job, args.node_rank))
        ]
    launcher = args.launcher
    if args.force_multi and launcher == "local":
        raise LaunchError("--force_multi needs a --launcher other than local")
    if launcher == "local" or (local and not args.force_multi):
        return [
            (commands.torchrun_command(job, i), commands.node_env(job, i))
            for i in range(len(job.hosts))
        ]
    if launcher == "ssh":
        out = []
        for i, host in enumerate(job.hosts):
            if is_local(host):
                out.append((commands.torchrun_command(job, i), commands.node_env(job, i)))
            else:
                out.append((commands.ssh_command(job, i, cwd, args.ssh_port, extra), {}))
        return out
    if launcher == "pdsh":
        env = {"PDSH_RCMD_TYPE": "ssh"}
        if args.ssh_port is not None:
            env["PDSH_SSH_ARGS_APPEND"] = f"-p {args.ssh_port}"
        return [(commands.pdsh_command(job, cwd, extra), env)]
    if launcher == "slurm":
        nodelist = args.hostfile is not None or os.path.isfile(DLTS_HOSTFILE)
        argv = commands.srun_command(job, extra, bool(args.master_addr), nodelist=nodelist)
        return [(argv, {})]
    if launcher == "openmpi":
        return [(commands.openmpi_command(job, extra), {})]
    return [(commands.mpich_command(job, extra), {})]


def _check_binaries(cmds: list[tuple[list[str], dict[str, str]]], launcher: str) -> None:
    for argv, _ in cmds:
        if argv[0] in BINARIES.values() and shutil.which(argv[0]) is None:
            raise LaunchError(f"--launcher {launcher}: {argv[0]!r} is not on PATH")


def _show(argv: list[str], env: dict[str, str]) -> str:
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items() if k != "PYTHONPATH")
    return (prefix + " " if prefix else "") + shlex.join(argv)


def run_processes(cmds: list[tuple[list[str], dict[str, str]]], base_env=None) -> int:
    """Start every command, wait for all; the first failure ends the others (SIGTERM, then
    SIGKILL after 30 s), and a SIGINT/SIGTERM to the launcher is passed on. Returns the first
    non-zero exit code (128 + signal for a killed process), else 0."""
    base = dict(os.environ if base_env is None else base_env)
    procs = [subprocess.Popen(argv, env={**base, **env}) for argv, env in cmds]
    stopping: dict[str, float] = {}

    def stop(*_):
        stopping.setdefault("at", time.monotonic())
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        while any(p.poll() is None for p in procs):
            for p in procs:
                rc = p.poll()
                if rc not in (None, 0) and code == 0:
                    code = rc if rc > 0 else 128 - rc
                    stop()
            if "at" in stopping and time.monotonic() - stopping["at"] > 30:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.1)
        for p in procs:
            if p.returncode != 0 and code == 0:
                code = p.returncode if p.returncode > 0 else 128 - p.returncode
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for s, handler in old.items():
            signal.signal(s, handler)
    return code


def run(args) -> int:
    """Plan, build and run the launch; a :class:`LaunchError` is one line on stderr, exit 2."""
    try:
        job, local = plan(args)
        cmds = commands_for(args, job, local)
        if not args.dry_run:
            _check_binaries(cmds, args.launcher)
    except LaunchError as exc:
        print(f"LaunchError: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        for argv, env in cmds:
            print(_show(argv, env))
        return 0
    return run_processes(cmds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="zerostack launch", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))
