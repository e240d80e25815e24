"""``deepspeed.monitor.monitor``: ``MonitorMaster(monitor_config)`` writes a script's own events
to the monitors a config enables (TensorBoard, CSV, Weights & Biases), on global rank 0, as in
DeepSpeed's monitor tutorial::

    ds_config = DeepSpeedConfig("ds_config.json")
    monitor = MonitorMaster(ds_config.monitor_config)
    monitor.write_events([("Train/Samples/loss", loss.item(), engine.global_samples)])
"""

from __future__ import annotations

import torch.distributed as dist

from zerostack.config import load_config
from zerostack.monitor import MonitorMaster as _MonitorMaster
from zerostack.monitor import open_monitors


class MonitorMaster(_MonitorMaster):
    """The monitors ``monitor_config`` enables (a ``DeepSpeedConfig``'s ``monitor_config``, or a
    config itself), opened on global rank 0; the other ranks write nothing."""

    def __init__(self, monitor_config) -> None:
        given = getattr(monitor_config, "typed", monitor_config)
        cfg = load_config(given, unknown_keys="as_deepspeed")
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        opened = open_monitors(cfg, rank=rank)
        super().__init__(opened.monitors, opened.enabled)


__all__ = ["MonitorMaster"]
