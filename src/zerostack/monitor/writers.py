"""The monitors DeepSpeed's config names (``tensorboard``, ``csv_monitor``, ``wandb``), each a
writer of ``(name, value, step)`` events with DeepSpeed's output layout.

They write what they are given; which rank writes is :class:`~.master.MonitorMaster`'s choice
(global rank 0). Output goes to ``<output_path>/<job_name>/``::

    csv = CSVMonitor(config.csv_monitor)
    csv.write_events([("Train/Samples/train_loss", 2.31, 64)])
    # -> <output_path>/<job_name>/Train_Samples_train_loss.csv: "step,train_loss" / "64,2.31"
"""

from __future__ import annotations

import csv
import os
from typing import Protocol

from ..config import ConfigError, MonitorConfig, WandbConfig

Event = tuple[str, float, int]
"""``(name, value, step)``: DeepSpeed's event, TensorBoard's ``add_scalar`` arguments."""


class Monitor(Protocol):
    """A sink for training metrics."""

    def write_events(self, events: list[Event]) -> None:
        """Record each ``(name, value, step)``."""

    def flush(self) -> None:
        """Put what was written on disk."""

    def close(self) -> None:
        """Flush and release files."""


def require(key: str, package: str, extra: str) -> None:
    """Raise a one-line ConfigError naming ``key`` and the pip command when ``package`` cannot
    be imported (every rank checks, so every rank fails alike)."""
    try:
        __import__(package)
    except ImportError:
        raise ConfigError(
            f"{key}: needs the {package} package, which is not installed: "
            f"pip install {package} (or pip install 'zerostack[{extra}]')"
        ) from None


def log_dir(cfg: MonitorConfig, key: str) -> str:
    """``<output_path>/<job_name>``, created (DeepSpeed's layout; "" is the current directory)."""
    path = os.path.join(cfg.output_path, cfg.job_name)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{key}.output_path: cannot create {path}: {exc.strerror}") from None
    if not os.access(path, os.W_OK):
        raise ConfigError(f"{key}.output_path: cannot write to {path}: permission denied")
    return path


class CSVMonitor:
    """DeepSpeed's ``csv_monitor``: one CSV file per metric, named after the metric with ``/``
    and spaces as ``_`` (``Train/Samples/lr`` -> ``Train_Samples_lr.csv``), with the header
    ``step,<last part of the name>`` and a ``step,value`` row per event. As DeepSpeed does, a
    file is appended to and gets its header when this process first writes it (so a resumed
    run continues the same files)."""

    def __init__(self, cfg: MonitorConfig, key: str = "csv_monitor") -> None:
        self.log_dir = log_dir(cfg, key)
        self._files: dict[str, tuple] = {}

    def _writer(self, name: str):
        entry = self._files.get(name)
        if entry is None:
            filename = name.replace("/", "_").replace(" ", "_") + ".csv"
            f = open(os.path.join(self.log_dir, filename), "a", newline="", encoding="utf-8")
            entry = (f, csv.writer(f))
            entry[1].writerow(["step", name.split("/")[-1]])
            self._files[name] = entry
        return entry[1]

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            self._writer(name).writerow([step, value])

    def flush(self) -> None:
        for f, _ in self._files.values():
            f.flush()

    def close(self) -> None:
        for f, _ in self._files.values():
            f.close()
        self._files.clear()


class TensorBoardMonitor:
    """DeepSpeed's ``tensorboard``: a ``torch.utils.tensorboard.SummaryWriter`` on
    ``<output_path>/<job_name>``; each event is one ``add_scalar(name, value, step)``."""

    def __init__(self, cfg: MonitorConfig, key: str = "tensorboard") -> None:
        require(f"{key}.enabled", "tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir(cfg, key)
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbMonitor:
    """DeepSpeed's ``wandb``: one ``wandb.init(project, group, entity=team)`` run; each event is
    ``run.log({name: value}, step=step)``. Set ``WANDB_MODE=offline`` to keep it on disk."""

    def __init__(self, cfg: WandbConfig, key: str = "wandb") -> None:
        require(f"{key}.enabled", "wandb", "wandb")
        import wandb

        try:
            self.run = wandb.init(project=cfg.project, group=cfg.group, entity=cfg.team)
        except Exception as exc:  # noqa: BLE001 - any failure to start is the block's error
            raise ConfigError(f"{key}: wandb.init failed: {exc}") from None

    def write_events(self, events: list[Event]) -> None:
        by_step: dict[int, dict[str, float]] = {}  # wandb takes a step's values in one call
        for name, value, step in events:
            by_step.setdefault(step, {})[name] = value
        for step, values in by_step.items():
            self.run.log(values, step=step)

    def flush(self) -> None:
        pass  # wandb streams its run file itself

    def close(self) -> None:
        self.run.finish()
