"""DeepSpeed's ``MonitorMaster``: the enabled monitors of a config, opened and written on global
rank 0 only; every other rank holds an empty one (``enabled`` alike on every rank, so every rank
joins the collectives that compute what rank 0 writes)."""

from __future__ import annotations

import torch

from ..config import ConfigError, ZeroStackConfig
from .writers import CSVMonitor, Event, Monitor, TensorBoardMonitor, WandbMonitor, require

# (config key, the class that writes it, its pip package or None)
_KINDS = (
    ("tensorboard", TensorBoardMonitor, "tensorboard"),
    ("csv_monitor", CSVMonitor, None),
    ("wandb", WandbMonitor, "wandb"),
)


class MonitorMaster:
    """Fans each event list out to the enabled monitors (none off rank 0)."""

    def __init__(self, monitors: list[Monitor], enabled: bool) -> None:
        self.monitors = monitors
        self.enabled = enabled
        """Some monitor block is enabled (True on every rank, though only rank 0 writes)."""

    def write_events(self, events: list[Event]) -> None:
        for m in self.monitors:
            m.write_events(events)

    def flush(self) -> None:
        for m in self.monitors:
            m.flush()

    def close(self) -> None:
        for m in self.monitors:
            m.close()
        self.monitors = []


def open_monitors(config: ZeroStackConfig, *, rank: int, comm=None) -> MonitorMaster:
    """The config's monitors, opened on ``rank`` 0. A missing package fails on every rank; a
    path rank 0 cannot write fails there with its reason and on the others naming the key
    (``comm``, when given and the world has several ranks, carries rank 0's verdict)."""
    enabled = [(key, cls) for key, cls, _ in _KINDS if getattr(config, key).enabled]
    for key, _, package in _KINDS:
        if package is not None and getattr(config, key).enabled:
            require(f"{key}.enabled", package, package)
    if not enabled:
        return MonitorMaster([], enabled=False)
    monitors: list[Monitor] = []
    failed, error = 0, None
    if rank == 0:
        for i, (key, cls) in enumerate(enabled):
            try:
                monitors.append(cls(getattr(config, key), key))
            except (ConfigError, OSError) as exc:  # told to the other ranks before raising
                failed, error = i + 1, exc
                if isinstance(exc, OSError):
                    error = ConfigError(f"{key}.output_path: {exc}")
                break
    if comm is not None and comm.topo.world_size > 1:
        verdict = torch.tensor([failed], dtype=torch.int64, device=comm.topo.device)
        comm.broadcast(verdict, src=0, axis="world")
        failed = int(verdict)
    if error is not None:
        for m in monitors:
            m.close()
        raise error
    if failed:
        key = enabled[failed - 1][0]
        raise ConfigError(f"{key}: rank 0 could not open this monitor (its error says why)")
    return MonitorMaster(monitors, enabled=True)
