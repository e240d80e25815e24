"""The rest of DeepSpeed's ``deepspeed.comm``: set-up (``init_distributed``, ``configure``), the
process-group queries, and the comms logger's summary (``log_summary``)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as td

from ..world import default_timeout, world_device_type
from ..world import init_distributed as _init_torch
from .collectives import barrier
from .summary import comms_logger


def _require(what: str) -> None:
    if not td.is_initialized():
        raise RuntimeError(
            f"zerostack.comm.{what}: torch.distributed is not initialized; call "
            "zerostack.comm.init_distributed() first"
        )


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config=None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """DeepSpeed's ``init_distributed``: the config's ``comms_logger`` block, then torch's
    process group from torchrun's environment, else (``auto_mpi_discovery``) from Open MPI's,
    MPICH's or Slurm's, with ``distributed_port`` when ``MASTER_PORT`` is unset; a world of one
    without a launcher (see :func:`zerostack.world.init_distributed`). ``timeout`` defaults
    to 30 minutes (DeepSpeed's) on gloo and, on NCCL, to the config's watchdog bound plus a
    minute (:func:`zerostack.world.default_timeout`)."""
    configure(deepspeed_config=config)
    if timeout is None:
        timeout = default_timeout(dist_backend, _watchdog_block(config))
    if dist_init_required is False:
        _require("init_distributed(dist_init_required=False)")
        return
    _init_torch(
        dist_backend,
        timeout,
        init_method,
        rank,
        world_size,
        auto_mpi_discovery=auto_mpi_discovery,
        distributed_port=distributed_port,
    )


def _watchdog_block(config):
    """The ``watchdog`` block of a config (a ZeroStackConfig, dict or JSON path), or None."""
    if config is None:
        return None
    from ..config import load_config

    return load_config(config).watchdog


def configure(
    deepspeed_config=None, enabled=None, prof_all=None, prof_ops=None, verbose=None, debug=None
) -> None:
    """Set the comms logger: from a config's ``comms_logger`` block (a ZeroStackConfig, dict or
    JSON path; a config without the block leaves it as it is), then from the keywords given."""
    if deepspeed_config is not None:
        from ..config import load_config

        cfg = load_config(deepspeed_config)
        if "comms_logger" in cfg.model_fields_set:
            comms_logger.configure(cfg.comms_logger)
    given = dict(enabled=enabled, prof_all=prof_all, verbose=verbose, debug=debug)
    for key, value in given.items():
        if value is not None:
            setattr(comms_logger, key, value)
    if prof_ops is not None:
        comms_logger.prof_ops = list(prof_ops)


def is_initialized() -> bool:
    return td.is_initialized()


def is_available() -> bool:
    return True


def destroy_process_group(group=None) -> None:
    td.destroy_process_group(group)


def new_group(ranks):
    _require("new_group")
    return td.new_group(ranks)


def get_world_group():
    _require("get_world_group")
    return td.group.WORLD


def get_world_size(group=None) -> int:
    _require("get_world_size")
    return td.get_world_size(group)


def get_rank(group=None) -> int:
    _require("get_rank")
    return td.get_rank(group)


def get_local_rank() -> int:
    """This process's rank on its node, from the launcher (``LOCAL_RANK``), else 0."""
    _require("get_local_rank")
    return int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))


def get_global_rank(group=None, group_rank: int = 0) -> int:
    _require("get_global_rank")
    return td.get_global_rank(group if group is not None else td.group.WORLD, group_rank)


def get_all_ranks_from_group(group=None) -> list[int]:
    _require("get_all_ranks_from_group")
    return td.get_process_group_ranks(group if group is not None else td.group.WORLD)


def initialize_mesh_device(mesh_shape, mesh_dim_names):
    _require("initialize_mesh_device")
    device = world_device_type()
    return td.device_mesh.init_device_mesh(device, mesh_shape, mesh_dim_names=mesh_dim_names)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def has_all_reduce_coalesced() -> bool:
    return hasattr(td, "all_reduce_coalesced")


def has_coalescing_manager() -> bool:
    return hasattr(td.distributed_c10d, "_coalescing_manager")


# ------------------------------------------------------------------ the summary
def log_summary(show_straggler: bool = False, return_dict: bool = False):
    """DeepSpeed's table of the profiled collectives, printed on rank 0 between two barriers
    (logged as ``log_summary_barrier``, as DeepSpeed's are); ``return_dict`` returns it on
    every rank, ``show_straggler`` adds the wait for the slowest rank (needs every rank)."""
    if not td.is_initialized():
        return comms_logger.log_all(True, show_straggler, return_dict)
    barrier(log_name="log_summary_barrier")
    result = comms_logger.log_all(td.get_rank() == 0, show_straggler, return_dict)
    barrier(log_name="log_summary_barrier")
    return result


def reset_log() -> None:
    comms_logger.reset_data()


def has_comm_data() -> bool:
    return comms_logger.has_data()


def get_comm_operation_count() -> int:
    return comms_logger.get_total_operations()


def get_logged_comm_ops() -> list[str]:
    return comms_logger.get_operation_names()
