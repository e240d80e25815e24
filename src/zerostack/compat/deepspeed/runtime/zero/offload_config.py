"""``deepspeed.runtime.zero.offload_config``: the enums RL code hands to
``engine.offload_states()`` (OpenRLHF imports them from here)."""

from __future__ import annotations

import enum

from zerostack.zero.offload.states import StateKind as OffloadStateTypeEnum


class OffloadDeviceEnum(enum.StrEnum):
    """Where offloaded state goes (DeepSpeed's names and values)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]
