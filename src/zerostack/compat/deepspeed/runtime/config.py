"""``deepspeed.runtime.config``: ``DeepSpeedConfig`` (scripts read a config's resolved batch
sizes from it, and DeepSpeed's monitor tutorial hands its ``monitor_config`` to
``MonitorMaster``) and DeepSpeed's optimizer-name constants."""

from __future__ import annotations

import torch.distributed as dist

from zerostack.config import load_config

ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"
DEEPSPEED_OPTIMIZERS = [
    ADAGRAD_OPTIMIZER,
    ADAM_OPTIMIZER,
    ADAMW_OPTIMIZER,
    LAMB_OPTIMIZER,
    ONEBIT_ADAM_OPTIMIZER,
    ONEBIT_LAMB_OPTIMIZER,
    ZERO_ONE_ADAM_OPTIMIZER,
    MUADAM_OPTIMIZER,
    MUADAMW_OPTIMIZER,
    MUSGD_OPTIMIZER,
    LION_OPTIMIZER,
    MUON_OPTIMIZER,
]
"""DeepSpeed's optimizer ``type`` names (lower case); which zerostack builds is in its config
reference."""


class DeepSpeedConfig:
    """DeepSpeed's ``DeepSpeedConfig(config, mpu=None)``: a config (dict, JSON path or text)
    checked as ``deepspeed.initialize`` checks it, with its batch sizes resolved for the data
    parallel size (the mpu's, or the world's once torch.distributed is up, else 1).

    Attributes as DeepSpeed's: ``train_batch_size``, ``train_micro_batch_size_per_gpu``,
    ``gradient_accumulation_steps``, ``zero_enabled``, ``zero_optimization_stage``,
    ``fp16_enabled``, ``bfloat16_enabled``, ``gradient_clipping``, ``steps_per_print``,
    ``wall_clock_breakdown``, ``optimizer_name``, ``optimizer_params``, ``scheduler_name``,
    ``scheduler_params``, ``zero_config`` and ``monitor_config`` (what
    ``deepspeed.monitor.monitor.MonitorMaster`` takes); ``typed`` is zerostack's config."""

    def __init__(self, config, mpu=None, mesh_device=None) -> None:
        self.typed = cfg = load_config(config, unknown_keys="as_deepspeed")
        if mpu is not None:
            dp = mpu.get_data_parallel_world_size()
        else:
            dp = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        batch = cfg.resolve_batch(dp)
        self.train_batch_size, self.train_micro_batch_size_per_gpu = batch[0], batch[1]
        self.gradient_accumulation_steps = batch[2]
        self.zero_config = cfg.zero_optimization
        self.zero_optimization_stage = cfg.zero_optimization.stage
        self.zero_enabled = self.zero_optimization_stage > 0
        self.fp16_enabled, self.bfloat16_enabled = cfg.fp16.enabled, cfg.bf16.enabled
        self.gradient_clipping = cfg.gradient_clipping
        self.steps_per_print = cfg.steps_per_print
        self.wall_clock_breakdown = cfg.wall_clock_breakdown
        self.optimizer_name = cfg.optimizer.type.lower() if cfg.optimizer else None
        self.optimizer_params = cfg.optimizer.params.model_dump() if cfg.optimizer else None
        self.scheduler_name = cfg.scheduler.type if cfg.scheduler else None
        self.scheduler_params = cfg.scheduler.params.model_dump() if cfg.scheduler else None
        self.monitor_config = cfg


__all__ = ["DEEPSPEED_OPTIMIZERS", "DeepSpeedConfig", "LAMB_OPTIMIZER"]
