"""``deepspeed.monitor``: ``monitor.MonitorMaster``, as DeepSpeed's monitor tutorial uses it."""

from . import monitor

__all__ = ["monitor"]
