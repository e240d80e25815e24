"""What a Megatron- or DeepSpeed-style ``mpu`` object (the model-parallel unit a script hands
``initialize(mpu=...)``) gives zerostack's grid: its sizes (:func:`mpu_sizes`), and a check that
its groups are the grid's (:func:`check_mpu_groups`). DeepSpeed's sequence-parallel one
(``parallel_state_sp``, what ``UlyssesSPAttentionHF.register_with_transformers`` returns) is
sp only."""

from __future__ import annotations

import torch.distributed as dist

from .config import ConfigError
from .topology import Topology


def mpu_sizes(mpu) -> tuple[int, int, int]:
    """(tp, pp, sp) from a Megatron/DeepSpeed-style ``mpu`` object. DeepSpeed's
    sequence-parallel one (``parallel_state_sp``, what ``UlyssesSPAttentionHF.
    register_with_transformers`` returns; it has ``initialize_sequence_parallel``) is sp only:
    its model-parallel getters answer for its sp group, as DeepSpeed reads them."""
    if hasattr(mpu, "initialize_sequence_parallel"):
        return 1, 1, int(mpu.get_sequence_parallel_world_size())

    def ask(*names: str) -> int | None:
        for name in names:
            fn = getattr(mpu, name, None)
            if callable(fn):
                return int(fn())
        return None

    tp = ask("get_tensor_model_parallel_world_size", "get_model_parallel_world_size")
    if tp is None:
        raise ConfigError("mpu: it has no get_model_parallel_world_size() (or the tensor_ form)")
    return tp, ask("get_pipeline_model_parallel_world_size") or 1, 1


def check_mpu_groups(mpu, topo: Topology) -> None:
    """The mpu's group of this rank (tp's, or sp's for DeepSpeed's sequence-parallel one) is
    the grid's, else a ``ConfigError`` naming both."""
    if hasattr(mpu, "initialize_sequence_parallel"):  # sp only (see mpu_sizes)
        theirs = dist.get_process_group_ranks(mpu.get_sequence_parallel_group())
        ours = dist.get_process_group_ranks(topo.group("sp"))
        if sorted(theirs) != sorted(ours):
            raise ConfigError(
                f"mpu: its sequence-parallel group of this rank is ranks {sorted(theirs)}, "
                f"zerostack's grid puts it at {sorted(ours)} (runs of neighbouring dp ranks)"
            )
        return
    get = getattr(mpu, "get_tensor_model_parallel_group", None) or getattr(
        mpu, "get_model_parallel_group", None
    )
    if get is None:
        return
    theirs = dist.get_process_group_ranks(get())
    ours = dist.get_process_group_ranks(topo.group("tp"))
    if sorted(theirs) != sorted(ours):
        raise ConfigError(
            f"mpu: its tensor-parallel group of this rank is ranks {sorted(theirs)}, zerostack's "
            f"grid (tp innermost) puts it at {sorted(ours)}; build the mpu with tp innermost"
        )
