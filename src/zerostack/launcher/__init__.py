"""Launching a job: ``zerostack launch`` (DeepSpeed's ``deepspeed`` flags, ``torchrun`` on every
node) and the rank discovery ``init_distributed`` does under ``mpirun`` or ``srun``.

- :mod:`.hostfile`: the hostfile, ``--include``/``--exclude``, ``--num_nodes``/``--num_gpus``;
- :mod:`.commands`: the torchrun, ssh, pdsh, srun and mpirun command lines (pure);
- :mod:`.environment`: exported variables and ``.deepspeed_env``/``.zerostack_env``;
- :mod:`.discovery`: rank, world size and rank 0's address from torchrun, Open MPI, MPICH/PMI
  or Slurm variables (pure);
- :mod:`.runner`: the command-line front end that plans, prints or runs a launch.

These modules do not import torch (the runner does, only to count this machine's GPUs), so
discovery and command building are cheap and testable without processes.
"""

from .discovery import Placement, RendezvousError, discover, expand_nodelist
from .hostfile import LaunchError, apply_filter, parse_filter, parse_hostfile, select

__all__ = [
    "LaunchError",
    "Placement",
    "RendezvousError",
    "apply_filter",
    "discover",
    "expand_nodelist",
    "parse_filter",
    "parse_hostfile",
    "select",
]
