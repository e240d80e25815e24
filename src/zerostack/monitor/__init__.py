"""Training metrics to TensorBoard, CSV files or Weights & Biases: DeepSpeed's ``tensorboard``,
``csv_monitor`` and ``wandb`` config blocks, with DeepSpeed's event names and file layout.

``writers.py`` holds the monitors (``write_events([(name, value, step)])``), ``master.py`` the
fan-out written on global rank 0 only, ``training.py`` what the engine writes each optimizer step
(its event names are listed there)::

    config = {..., "csv_monitor": {"enabled": True, "output_path": "runs", "job_name": "gpt"}}
    engine, *_ = zerostack.initialize(model=model, config=config)
    # runs/gpt/Train_Samples_train_loss.csv, Train_Samples_lr.csv, ...
"""

from .master import MonitorMaster, open_monitors
from .training import StepMonitor
from .writers import CSVMonitor, Event, Monitor, TensorBoardMonitor, WandbMonitor

__all__ = [
    "CSVMonitor",
    "Event",
    "Monitor",
    "MonitorMaster",
    "StepMonitor",
    "TensorBoardMonitor",
    "WandbMonitor",
    "open_monitors",
]
