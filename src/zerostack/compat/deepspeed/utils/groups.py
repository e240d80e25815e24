"""``deepspeed.utils.groups``: the sequence-parallel getters Hugging Face ALST code calls after
``deepspeed.initialize`` (ArcticTraining, DeepSpeed's own ALST tests, trainers built on them)::

    engine, *_ = deepspeed.initialize(model=model, config=cfg, mpu=mpu)
    group = groups._get_sequence_parallel_group()

DeepSpeed answers from the ``mpu`` the last ``initialize`` was given; zerostack answers from the
grid of the last engine ``deepspeed.initialize`` built (:func:`_set_grid`), its 'sp' axis (with
ring attention, every sp rank: Ulysses' and the ring's). With no engine, or sp 1, the world
size is 1 and the rank 0, as DeepSpeed's without an mpu; asking for the group then is a
``KeyError``, as DeepSpeed's is.
"""

from __future__ import annotations

import logging
from typing import Any

_GRID: Any = None  # the Topology of the last engine deepspeed.initialize built
log = logging.getLogger("zerostack")


def initialize(ep_size: int = 1, mpu=None) -> None:
    """DeepSpeed's deprecated call ("model training code does not need to call this anymore":
    its MoE tutorial). Nothing to do: the expert groups come from the MoE layers' ``ep_size``
    when ``initialize`` builds the grid, which checks they agree."""
    if not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"groups.initialize: ep_size must be an integer >= 1, got {ep_size!r}")
    log.info(
        "deepspeed.utils.groups.initialize(ep_size=%d): deprecated in DeepSpeed; the MoE "
        "layers' ep_size makes the groups at initialize",
        ep_size,
    )


def _set_grid(topology: Any) -> None:
    global _GRID
    _GRID = topology


def _sp() -> Any:
    return _GRID if _GRID is not None and _GRID.sp > 1 else None


def _get_sequence_parallel_world_size() -> int:
    return _sp().sp if _sp() is not None else 1


def _get_sequence_parallel_rank() -> int:
    return _sp().rank("sp") if _sp() is not None else 0


def _get_sequence_parallel_group():
    if _sp() is None:
        raise KeyError(
            "No sequence parallel group found: no engine with sequence_parallel_size "
            "> 1 was initialized"
        )
    return _sp().group("sp")


def _get_sequence_data_parallel_world_size() -> int:
    return _GRID.dp if _GRID is not None else 1


def _get_sequence_data_parallel_rank() -> int:
    return _GRID.dp_rank if _GRID is not None else 0


def _get_sequence_data_parallel_group():
    if _GRID is None:
        raise KeyError("No sequence data parallel group found: no engine was initialized")
    return _GRID.group("dp")  # the dp axis counts the sp ranks
