"""``zerostack launch`` and rank discovery.

Pure: the hostfile, DeepSpeed's ``--include``/``--exclude`` and ``--num_nodes``/``--num_gpus``,
every launcher's command line, the env files, and discovery over Open MPI, MPICH/PMI and Slurm
variables. Real processes: a two-"node" job (two torchrun agents on this machine, started by
``zerostack launch --no_ssh --node_rank 0|1`` and meeting through torchrun's c10d rendezvous)
trains ZeRO-2 and matches the one-node job of the same two ranks exactly; two processes with only
Open MPI's variables form one world of two and match it too; and under such variables a world
with no address is refused instead of becoming one world of one per process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from zerostack.launcher import (
    LaunchError,
    RendezvousError,
    apply_filter,
    discover,
    expand_nodelist,
    parse_filter,
    parse_hostfile,
    select,
)
from zerostack.launcher import commands as C
from zerostack.launcher.environment import exports, parse_env_file
from zerostack.launcher.runner import add_arguments, commands_for, plan, run_processes

from tests.support.models import run_cli
from tests.support.ranks import job, job_env, session

JOB = job("launch_job.py")
PY = sys.executable


# ------------------------------------------------------------------ hostfile and filters
HOSTFILE = """\
# the cluster
worker-0 slots=4

worker-1 slots=4   # a comment after the entry
worker-2 slots=2 max_slots=8
"""
POOL = {"worker-0": 4, "worker-1": 4, "worker-2": 2}


def test_hostfile_in_deepspeeds_format():
    assert parse_hostfile(HOSTFILE) == POOL
    assert list(parse_hostfile(HOSTFILE)) == ["worker-0", "worker-1", "worker-2"]  # the order


@pytest.mark.parametrize(
    "text, message",
    [
        ("w0 slots=2\nw0 slots=4\n", "hf:2: host 'w0' is listed again (first at line 1)"),
        ("w0 slots=2\nw1 slot=4\n", "hf:2: 'w1 slot=4' is not 'HOSTNAME slots=N'"),
        ("w0\n", "hf:1: 'w0' is not 'HOSTNAME slots=N'"),
        ("w0 slots=0\n", "hf:1: host 'w0' has slots=0; needs >= 1"),
        ("# nothing\n\n", "hf: no hosts"),
    ],
)
def test_bad_hostfiles_name_the_line(text, message):
    with pytest.raises(LaunchError) as info:
        parse_hostfile(text, "hf")
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_include_and_exclude_as_deepspeed_reads_them():
    # DeepSpeed's own examples (runner.py): all of worker-0 and slots 0, 2 of worker-1 ...
    assert apply_filter(POOL, include="worker-0@worker-1:0,2") == {
        "worker-0": [0, 1, 2, 3],
        "worker-1": [0, 2],
    }
    # ... and everything but slot 0 of worker-1
    assert apply_filter(POOL, exclude="worker-1:0") == {
        "worker-0": [0, 1, 2, 3],
        "worker-1": [1, 2, 3],
        "worker-2": [0, 1],
    }
    assert apply_filter(POOL, exclude="worker-0@worker-2:1") == {
        "worker-1": [0, 1, 2, 3],
        "worker-2": [0],
    }
    # the hostfile's order, not the filter's, fixes the node order; repeats merge
    assert list(apply_filter(POOL, include="worker-2@worker-0:1@worker-0:0")) == [
        "worker-0",
        "worker-2",
    ]
    assert apply_filter(POOL, include="worker-0:3,1@worker-0:1")["worker-0"] == [1, 3]
    assert apply_filter(POOL) == {h: list(range(n)) for h, n in POOL.items()}
    assert parse_filter("a@b:1,0") == {"a": [], "b": [0, 1]}


@pytest.mark.parametrize(
    "include, exclude, message",
    [
        ("worker-9", "", "--include 'worker-9': host 'worker-9' is not in the hostfile"),
        ("worker-2:2", "", "--include 'worker-2:2': host 'worker-2' has no slot 2 (it has"),
        ("", "worker-1:7", "--exclude 'worker-1:7': host 'worker-1' has no slot 7"),
        ("worker-0", "worker-1", "--include and --exclude are mutually exclusive"),
        ("", "worker-0@worker-1@worker-2", "--exclude 'worker-0@worker-1@worker-2': no slots"),
        ("worker-0:x", "", "--include 'worker-0:x': slots in 'worker-0:x' must be integers"),
        ("worker-0:", "", "--include 'worker-0:': 'worker-0:' is not NAME or NAME:SLOT"),
    ],
)
def test_bad_filters_are_one_line(include, exclude, message):
    with pytest.raises(LaunchError, match="^" + message.replace("(", r"\(")):
        apply_filter(POOL, include, exclude)


def test_num_nodes_and_num_gpus():
    full = apply_filter(POOL)
    assert select(full, num_nodes=2) == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    assert select(full, num_gpus=2) == {h: [0, 1] for h in POOL}
    assert select(full, 1, 3) == {"worker-0": [0, 1, 2]}
    with pytest.raises(LaunchError, match="^--num_nodes 4: the hostfile lists only 3 hosts$"):
        select(full, num_nodes=4)
    with pytest.raises(LaunchError, match="^--num_gpus 3: host 'worker-2' has only 2 slots$"):
        select(full, num_gpus=3)


# ------------------------------------------------------------------ command lines
def _job(**kw) -> C.Job:
    kw.setdefault("nodes", {"w0": [0, 1], "w1": [0, 1]})
    kw.setdefault("master_addr", "w0")
    kw.setdefault("master_port", 29500)
    return C.Job(script="train.py", script_args=["--deepspeed_config", "ds.json"], **kw)


RUN = [PY, "-u", "-m", "torch.distributed.run"]
USER = [C.LOCAL_RANK_SHIM, "train.py", "--deepspeed_config", "ds.json"]


def test_torchrun_per_node_c10d():
    for node in (0, 1):
        assert C.torchrun_command(_job(), node) == [
            *RUN,
            "--nproc_per_node=2",
            "--nnodes=2",
            "--rdzv_backend=c10d",
            "--rdzv_endpoint=w0:29500",
            "--rdzv_id=zerostack",
            *USER,
        ]
    with pytest.raises(LaunchError, match="^--node_rank 2: the job has nodes 0-1$"):
        C.torchrun_command(_job(), 2)


def test_torchrun_per_node_static_has_the_node_rank():
    job = _job(rdzv_backend="static", nodes={"w0": [0, 1], "w1": [0]})
    assert C.torchrun_command(job, 1) == [
        *RUN,
        "--nproc_per_node=1",
        "--nnodes=2",
        "--node_rank=1",
        "--master_addr=w0",
        "--master_port=29500",
        *USER,
    ]


def test_one_local_node_without_a_port_is_standalone():
    job = _job(nodes={"localhost": [0, 1, 2]}, master_port=None, master_addr="127.0.0.1")
    assert C.torchrun_command(job, 0) == [*RUN, "--nproc_per_node=3", "--standalone", *USER]


def test_script_modes_and_local_rank():
    argv = C.torchrun_command(_job(no_local_rank=True, module=True), 0)
    assert argv[-4:] == ["-m", "train.py", "--deepspeed_config", "ds.json"]
    argv = C.torchrun_command(_job(module=True), 0)
    assert argv[-5:] == [C.LOCAL_RANK_SHIM, "--module", "train.py", "--deepspeed_config", "ds.json"]
    argv = C.torchrun_command(_job(no_python=True, no_local_rank=True), 0)
    assert argv[-4:] == ["--no-python", "train.py", "--deepspeed_config", "ds.json"]
    with pytest.raises(LaunchError, match="--module and --no_python"):
        C.torchrun_command(_job(no_python=True, module=True), 0)


def test_the_shim_passes_local_rank_first_as_deepspeed_does(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import sys; print(sys.argv[1:])")
    env = dict(os.environ, LOCAL_RANK="3")
    out = subprocess.run(
        [PY, C.LOCAL_RANK_SHIM, str(script), "a", "b c"], env=env, capture_output=True, text=True
    )
    assert out.stdout.strip() == "['--local_rank=3', 'a', 'b c']", out.stderr


def test_picked_slots_become_visible_devices():
    job = _job(nodes={"w0": [0, 1], "w1": [1, 3]})
    assert C.node_env(job, 0) == {}
    assert C.node_env(job, 1) == {"CUDA_VISIBLE_DEVICES": "1,3"}


def test_ssh_and_pdsh_lines():
    job = _job(exports={"NCCL_DEBUG": "INFO", "PYTHONPATH": "/w d"})
    argv = C.ssh_command(job, 1, "/work dir", ssh_port=2222)
    assert argv[:4] == ["ssh", "-p", "2222", "w1"]
    assert argv[4] == (
        "cd '/work dir'; export NCCL_DEBUG=INFO; export PYTHONPATH='/w d'; exec "
        + " ".join(C.torchrun_command(job, 1))
    )
    pdsh = C.pdsh_command(_job(rdzv_backend="static"), "/w", ["-R", "ssh"])
    assert pdsh[:8] == ["pdsh", "-S", "-f", "1024", "-w", "w0,w1", "-R", "ssh"]
    assert "--node_rank=%n" in pdsh[8] and "--nnodes=2" in pdsh[8]  # pdsh fills in each index
    with pytest.raises(LaunchError, match="different slots"):
        C.pdsh_command(_job(nodes={"w0": [0, 1], "w1": [0]}), "/w")


def test_per_rank_launchers():
    job = _job(exports={"NCCL_DEBUG": "INFO"})
    assert C.srun_command(job, ["-p", "gpu"]) == [
        "srun",
        *("-n", "4", "--nodes", "2", "--ntasks-per-node", "2", "--nodelist", "w0,w1"),
        *("-p", "gpu", "--export=ALL,MASTER_PORT=29500,NCCL_DEBUG=INFO"),
        *(PY, "-u", "train.py", "--deepspeed_config", "ds.json"),
    ]
    assert "--export=ALL,MASTER_PORT=29500,NCCL_DEBUG=INFO,MASTER_ADDR=w0" in C.srun_command(
        job, pass_master_addr=True
    )
    assert C.openmpi_command(job) == [
        *("mpirun", "-n", "4", "--host", "w0:2,w1:2"),
        *("-x", "MASTER_ADDR=w0", "-x", "MASTER_PORT=29500", "-x", "NCCL_DEBUG=INFO"),
        *(PY, "-u", "train.py", "--deepspeed_config", "ds.json"),
    ]
    assert C.mpich_command(job) == [
        *("mpirun", "-n", "4", "-ppn", "2"),
        *("-genv", "MASTER_ADDR", "w0", "-genv", "MASTER_PORT", "29500"),
        *("-genv", "NCCL_DEBUG", "INFO", "-hosts", "w0,w1"),
        *(PY, "-u", "train.py", "--deepspeed_config", "ds.json"),
    ]
    with pytest.raises(LaunchError, match=r"^--launcher slurm cannot pick device ids \(w1"):
        C.srun_command(_job(nodes={"w0": [0, 1], "w1": [1, 2]}))
    with pytest.raises(LaunchError, match="^--launcher mpich needs the same slot count"):
        C.mpich_command(_job(nodes={"w0": [0, 1], "w1": [0]}))


# ------------------------------------------------------------------ the command line
def _args(*argv):
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def _plan(*argv, env=None):
    args = _args(*argv)
    job, local = plan(args, env={} if env is None else env)
    return commands_for(args, job, local)


@pytest.fixture
def hostfile(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("w0 slots=2\nw1 slots=2\nw2 slots=2\n")
    return str(path)


def test_a_hostfile_job_over_ssh(hostfile):
    cmds = _plan("-H", hostfile, "--launcher", "ssh", "-i", "w1@w2:1", "train.py", "--x", "1")
    assert [argv[:2] for argv, _ in cmds] == [["ssh", "w1"], ["ssh", "w2"]]
    first, second = cmds[0][0][2], cmds[1][0][2]
    assert "--rdzv_endpoint=w1:29500" in first  # rank 0's host: the first host left
    assert "--nproc_per_node=2" in first and "CUDA_VISIBLE_DEVICES" not in first
    assert "export CUDA_VISIBLE_DEVICES=1;" in second and "--nproc_per_node=1" in second
    assert second.endswith("train.py --x 1")


def test_no_ssh_runs_this_nodes_share(hostfile):
    (argv, env), *rest = _plan(
        "-H", hostfile, "--no_ssh", "--node_rank", "2", "--master_addr", "10.0.0.1", "t.py"
    )
    assert not rest and argv[0] == PY and "--rdzv_endpoint=10.0.0.1:29500" in argv
    assert "--nnodes=3" in argv


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-i", "w7", "t.py"], "--include 'w7': host 'w7' is not in the hostfile"),
        (["--num_gpus", "3", "t.py"], "--num_gpus 3: host 'w0' has only 2 slots"),
        (["--num_nodes", "4", "t.py"], "--num_nodes 4: the hostfile lists only 3 hosts"),
        (["--num_nodes", "2", "-i", "w0", "t.py"], "--num_nodes/--num_gpus cannot be combined"),
        (["--node_rank", "1", "t.py"], "--node_rank needs --no_ssh"),
        (["--no_ssh", "t.py"], "--no_ssh needs --node_rank"),
        (["--launcher", "pdsh", "-i", "w0:1@w1", "t.py"], "--launcher pdsh runs one command"),
    ],
)
def test_launch_errors_are_one_line(hostfile, argv, message, capsys):
    code, out, err = run_cli("launch", "--dry_run", "-H", hostfile, *argv)
    assert code == 2 and err.startswith(f"LaunchError: {message}"), err
    assert err.count("\n") == 1, err


def test_missing_hostfile_and_launcher(tmp_path, hostfile, monkeypatch):
    code, _, err = run_cli("launch", "-H", str(tmp_path / "nope"), "t.py")
    assert (code, err) == (2, f"LaunchError: --hostfile {tmp_path / 'nope'}: no such file\n")
    code, _, err = run_cli("launch", "--num_nodes", "2", "t.py")
    assert (code, err) == (2, "LaunchError: --num_nodes 2 needs a --hostfile listing the nodes\n")
    monkeypatch.setenv("PATH", str(tmp_path))  # no pdsh, srun or mpirun here
    for launcher, binary in [("pdsh", "pdsh"), ("slurm", "srun"), ("openmpi", "mpirun")]:
        code, _, err = run_cli("launch", "-H", hostfile, "--launcher", launcher, "t.py")
        assert (code, err) == (
            2,
            f"LaunchError: --launcher {launcher}: {binary!r} is not on PATH\n",
        )


def test_dry_run_prints_the_commands(hostfile):
    code, out, err = run_cli("launch", "--dry_run", "-H", hostfile, "--num_nodes", "2", "t.py")
    assert code == 0, err
    assert out.startswith("PDSH_RCMD_TYPE=ssh pdsh -S -f 1024 -w w0,w1 ")
    code, out, _ = run_cli(
        "launch", "--dry_run", "--launcher", "slurm", "--num_nodes", "2", "--num_gpus", "4", "t.py"
    )
    assert code == 0 and "srun -n 8 --nodes 2 --ntasks-per-node 4 --export=ALL" in out
    assert "--nodelist" not in out  # srun's allocation chooses the hosts


def test_every_node_local_runs_here(tmp_path):
    path = tmp_path / "hf"
    path.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    cmds = _plan("-H", str(path), "--master_port", "1234", "t.py")  # default launcher: pdsh
    assert [argv[0] for argv, _ in cmds] == [PY, PY]  # two agents on this machine, no pdsh
    assert all("--rdzv_endpoint=localhost:1234" in argv for argv, _ in cmds)


def test_env_files_and_exports(tmp_path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_IB_DISABLE=1\nA=home\n")
    (cwd / ".deepspeed_env").write_text("# ours\n\nA=cwd\n")
    (cwd / ".zerostack_env").write_text("B=x=y\n")
    env = {"NCCL_DEBUG": "WARN", "HOME_DIR": "no", "PYTHONPATH": "/lib", "GLOO_SOCKET_IFNAME": "lo"}
    got = exports(env, str(cwd), str(home))
    assert got == {
        "NCCL_DEBUG": "WARN",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": f"{cwd}:/lib",
        "NCCL_IB_DISABLE": "1",
        "A": "cwd",
        "B": "x=y",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",  # NCCL's flight recorder: a timeout dumps
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    off = exports({"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}, str(cwd), str(home))  # the user's stands
    assert off["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    (cwd / "my_env").write_text("C=1\n")
    assert exports({"DS_ENV_FILE": "my_env"}, str(cwd), str(home))["C"] == "1"
    with pytest.raises(LaunchError, match="^f:2: 'oops' is not KEY=VALUE$"):
        parse_env_file("A=1\noops\n", "f")


def test_the_first_failure_ends_the_other_nodes(tmp_path):
    """Local agents run together; when one fails, the others are stopped (not left running)
    and the launch exits with the failure's code."""
    pid_file = str(tmp_path / "sleeper.pid")
    sleeper = f"import os, time; open({pid_file!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    failer = "\n".join(
        ["import os, sys, time", f"while not os.path.exists({pid_file!r}): time.sleep(0.05)"]
        + ["time.sleep(0.2)", "sys.exit(3)"]
    )
    t0 = time.monotonic()
    code = run_processes([([PY, "-c", sleeper], {}), ([PY, "-c", failer], {"X": "1"})])
    assert code == 3 and time.monotonic() - t0 < 60
    with open(pid_file) as f:
        assert not os.path.exists(f"/proc/{f.read()}")  # stopped and reaped


# ------------------------------------------------------------------ discovery
def test_slurm_node_lists():
    assert list(expand_nodelist("node[01-03,07],gpu1")) == [
        "node01",
        "node02",
        "node03",
        "node07",
        "gpu1",
    ]
    assert list(expand_nodelist("r[1-2]-n[8-9]")) == ["r1-n8", "r1-n9", "r2-n8", "r2-n9"]
    assert next(expand_nodelist("dgx-[098-101]")) == "dgx-098"


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, None),
        (
            {
                "RANK": "3",
                "WORLD_SIZE": "4",
                "LOCAL_RANK": "1",
                "MASTER_ADDR": "h",
                "MASTER_PORT": "7",
            },
            ("torchrun", 3, 4, 1, "h", 7),
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "5",
                "OMPI_COMM_WORLD_SIZE": "8",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                "MASTER_ADDR": "n0",
            },
            ("Open MPI", 5, 8, 1, "n0", 29500),
        ),
        (  # every rank on this machine: rank 0 is on loopback
            {
                "OMPI_COMM_WORLD_RANK": "1",
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                "MASTER_PORT": "6000",
            },
            ("Open MPI", 1, 2, 1, "127.0.0.1", 6000),
        ),
        (  # a world of one needs no address
            {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"},
            ("Open MPI", 0, 1, 0, None, 29500),
        ),
        (
            {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MASTER_ADDR": "n1"},
            ("MPICH/PMI", 2, 4, 0, "n1", 29500),
        ),
        (
            {
                "SLURM_PROCID": "6",
                "SLURM_NTASKS": "8",
                "SLURM_LOCALID": "2",
                "SLURM_JOB_NODELIST": "gpu[07-08]",
            },
            ("Slurm", 6, 8, 2, "gpu07", 29500),
        ),
        (  # the step's node list and task count win over the job's
            {
                "SLURM_PROCID": "1",
                "SLURM_NTASKS": "8",
                "SLURM_STEP_NUM_TASKS": "2",
                "SLURM_LOCALID": "0",
                "SLURM_JOB_NODELIST": "gpu[01-08]",
                "SLURM_STEP_NODELIST": "gpu[03-04]",
                "MASTER_PORT": "1",
            },
            ("Slurm", 1, 2, 0, "gpu03", 1),
        ),
        (  # torchrun's variables win over the scheduler's
            {"RANK": "0", "WORLD_SIZE": "1", "SLURM_PROCID": "3", "SLURM_NTASKS": "4"},
            ("torchrun", 0, 1, 0, None, 29500),
        ),
    ],
)
def test_discovery(env, want):
    got = discover(env)
    if want is None:
        assert got is None
        return
    assert (
        got.source,
        got.rank,
        got.world_size,
        got.local_rank,
        got.master_addr,
        got.master_port,
    ) == want


def test_discovery_options():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "h"}
    assert discover(env, mpi=False) is None
    assert discover(env, default_port=1234).env() == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1234",
    }
    assert discover({}, rank=0, world_size=1).world_size == 1  # init_distributed's arguments


@pytest.mark.parametrize(
    "env, source",
    [
        (
            {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"},
            "Open MPI says this is rank 1",
        ),
        (
            {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALNRANKS": "1"},
            "MPICH/PMI says this is rank 0",
        ),
        ({"RANK": "1", "WORLD_SIZE": "2"}, "torchrun says this is rank 1 of 2"),
    ],
)
def test_a_world_with_no_address_is_refused(env, source):
    with pytest.raises(RendezvousError) as info:
        discover(env)
    msg = str(info.value)
    assert msg.startswith(source) and ", but MASTER_ADDR is not set" in msg and "\n" not in msg
    assert msg.endswith("or launch with torchrun or zerostack launch")


@pytest.mark.distributed
@pytest.mark.slow
def test_init_distributed_refuses_instead_of_a_world_of_one():
    """The issue's complaint: under mpirun without torchrun's variables each process used to
    become its own world of one, silently. Now the process stops, saying why."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_SIZE="1")
    code = "import zerostack; zerostack.init_distributed('gloo'); print('WORLD OF ONE')"
    out = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "WORLD OF ONE" not in out.stdout
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("zerostack.launcher.discovery.RendezvousError: Open MPI says this is")


# ------------------------------------------------------------------ real jobs
def _run_all(cmds: list[tuple[list[str], dict]], timeout: float = 150) -> list[str]:
    """Run the commands at once, each in a session of its own; anything still running at the
    end (a timeout, a failure here) is killed with all it started. Returns their outputs."""
    procs = [session(argv, env) for argv, env in cmds]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
            else:  # the group may hold stragglers
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-4000:]
    return outs


def _env(**extra) -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return job_env({k: v for k, v in os.environ.items() if k not in drop}, **extra)


def _result(out_dir) -> tuple[list[dict], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    return ranks, load_file(str(out_dir / "params.safetensors"))


LAUNCH = [PY, "-m", "zerostack.launcher"]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """The reference: one node, two ranks (``zerostack launch --num_gpus 2``, torchrun
    --standalone on this CPU machine)."""
    out = tmp_path_factory.mktemp("one_node")
    _run_all([([*LAUNCH, "--num_gpus", "2", JOB, str(out)], _env())])
    return _result(out)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_nodes_match_one_node(tmp_path, one_node):
    """Two torchrun agents, one per "node" of the hostfile, each started by ``zerostack launch
    --no_ssh --node_rank i`` as a user would on each machine, meet through torchrun's c10d
    rendezvous and train to exactly the parameters and losses of the one-node job."""
    import torch.distributed as dist

    ref_ranks, ref_params = one_node
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    out = tmp_path / "out"
    out.mkdir()
    # The rendezvous store is held here, on a port the OS picked (as tests/support/ranks.py does),
    # and both agents join it as clients: no port can be taken between choosing and binding.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    common = ["-H", str(hostfile), "--no_ssh", "--master_addr", "127.0.0.1"]
    common += ["--master_port", str(store.port), "--torchrun_args", "--rdzv_conf is_host=false"]
    _run_all([([*LAUNCH, *common, "--node_rank", str(i), JOB, str(out)], _env()) for i in (0, 1)])
    del store
    ranks, params = _result(out)
    assert sorted(r["node"] for r in ranks) == ["0", "1"]  # one rank on each node
    for r in ranks:
        assert r["world"] == 2 and r["local_rank_env"] == 0 and r["local_rank_arg"] == 0
    assert [r["losses"] for r in ranks] == [r["losses"] for r in ref_ranks]
    assert ref_ranks[0]["node"] == ref_ranks[1]["node"] == "0"  # the reference: one node
    assert params.keys() == ref_params.keys()
    for name in params:
        assert torch.equal(params[name], ref_params[name]), name


@pytest.mark.distributed
@pytest.mark.slow
def test_open_mpi_variables_alone_form_one_world(tmp_path, one_node):
    """Two plain processes with only Open MPI's variables (as ``mpirun -n 2`` sets them; no
    RANK, WORLD_SIZE, LOCAL_RANK or MASTER_ADDR) form one world of two, and train exactly as
    the torchrun job does. Both are on this machine (local size 2), so rank 0 is on loopback;
    the port is a store this test holds, which the ranks join as torchrun's workers would."""
    import torch.distributed as dist

    ref_ranks, ref_params = one_node
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = _env(
        OMPI_COMM_WORLD_SIZE="2",
        OMPI_COMM_WORLD_LOCAL_SIZE="2",
        MASTER_PORT=str(store.port),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    cmds = []
    for r in (0, 1):
        env = dict(base, OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_LOCAL_RANK=str(r))
        cmds.append(([PY, JOB, str(tmp_path)], env))
    _run_all(cmds)
    del store
    ranks, params = _result(tmp_path)
    assert [(r["rank"], r["world"], r["local_rank_env"]) for r in ranks] == [(0, 2, 0), (1, 2, 1)]
    assert [r["losses"] for r in ranks] == [r["losses"] for r in ref_ranks]
    for name in params:
        assert torch.equal(params[name], ref_params[name]), name
