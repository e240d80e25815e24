"""The mutants of src/zerostack/launcher/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "launch: static rendezvous without --node_rank",
        "launcher/commands.py",
        '            f"--node_rank={node_rank}",\n',
        "",
        ("tests/test_launch.py::test_torchrun_per_node_static_has_the_node_rank",),
    ),
    Mutant(
        "launch: c10d agents each told they are the only node",
        "launcher/commands.py",
        '            f"--nnodes={len(hosts)}",\n            "--rdzv_backend=c10d",',
        '            "--nnodes=1",\n            "--rdzv_backend=c10d",',
        ("tests/test_launch.py::test_torchrun_per_node_c10d",),
    ),
    Mutant(
        "launch: --include slot list ignored (whole host taken)",
        "launcher/hostfile.py",
        "chosen[host] = slots or full[host]",
        "chosen[host] = full[host]",
        ("tests/test_launch.py::test_include_and_exclude_as_deepspeed_reads_them",),
    ),
    Mutant(
        "discovery: Slurm node list loses its zero padding",
        "launcher/discovery.py",
        'yield from _expand_one(f"{head}{n:0{width}d}{tail}")',
        'yield from _expand_one(f"{head}{n}{tail}")',
        (
            "tests/test_launch.py::test_slurm_node_lists",
            "tests/test_launch.py::test_discovery",
        ),
    ),
    Mutant(
        "discovery: MPI and Slurm variables ignored",
        "launcher/discovery.py",
        "        found = _from_launcher(env, default_port)",
        "        found = None",
        (
            "tests/test_launch.py::test_discovery",
            "tests/test_launch.py::test_init_distributed_refuses_instead_of_a_world_of_one",
        ),
    ),
    Mutant(
        "discovery: a world with no MASTER_ADDR is not refused",
        "launcher/discovery.py",
        "    if found.world_size > 1 and found.master_addr is None:",
        "    if False:",
        (
            "tests/test_launch.py::test_a_world_with_no_address_is_refused",
            "tests/test_launch.py::test_init_distributed_refuses_instead_of_a_world_of_one",
        ),
    ),
]
