"""Typed, strict zerostack configuration, with DeepSpeed's JSON key names and defaults.

Usage::

    from zerostack.config import load_config

    cfg = load_config({
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
        "bf16": {"enabled": True},
    })                                          # or a JSON file path, or a JSON string
    cfg.optimizer.params.lr                     # 0.0003
    cfg.resolve_batch(dp_world_size=8)          # (64, 4, 2)

Every problem surfaces as one :class:`ConfigError` whose one-line message starts with the dotted
JSON key path, e.g. ``fp16.initial_scale_powr: unknown key (did you mean 'initial_scale_power'?)``.
Every top-level key of DeepSpeed's config is known (:mod:`zerostack.config.keys`): it works, or
it is accepted with no effect (warned about once at ``initialize``), or it is refused with a
``ConfigError`` saying why.

The schema is split by section: ``base`` (ConfigError, value types, the strict model),
``optim``, ``zero`` (precision and ZeRO), ``parallel``, ``runs`` (monitors, watchdog,
checkpoints), ``top`` (:class:`ZeroStackConfig`) and ``load``; every name is importable from here.
"""

from __future__ import annotations

from .base import (
    DEFAULT_BUCKET_NUMEL,
    SUPPORTED_ZERO_STAGES,
    BatchSize,
    Beta,
    ConfigError,
    EveryOrNever,
    Int,
    NonNegFloat,
    NonNegInt,
    PositiveFloat,
    PositiveInt,
    Ratio,
    StageOrAuto,
    WarmupType,
)
from .load import load_config, read_config
from .optim import (
    AdamParams,
    OptimizerConfig,
    SchedulerConfig,
    SGDParams,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)
from .parallel import ActivationCheckpointingConfig, PipelineConfig, TensorParallelConfig
from .runs import (
    CheckpointConfig,
    CommsLoggerConfig,
    FlopsProfilerConfig,
    LossSpikeConfig,
    MonitorConfig,
    ParallelWriteConfig,
    WandbConfig,
    WatchdogConfig,
)
from .top import ZeroStackConfig
from .zero import (
    BF16Config,
    DataTypesConfig,
    DtypeName,
    FP16Config,
    OffloadConfig,
    ZeroConfig,
    grad_accum_refusal,
)

__all__ = [
    "ActivationCheckpointingConfig",
    "AdamParams",
    "BF16Config",
    "BatchSize",
    "Beta",
    "CheckpointConfig",
    "CommsLoggerConfig",
    "ConfigError",
    "DEFAULT_BUCKET_NUMEL",
    "DataTypesConfig",
    "DtypeName",
    "EveryOrNever",
    "FP16Config",
    "FlopsProfilerConfig",
    "Int",
    "LossSpikeConfig",
    "MonitorConfig",
    "NonNegFloat",
    "NonNegInt",
    "OffloadConfig",
    "OptimizerConfig",
    "ParallelWriteConfig",
    "PipelineConfig",
    "PositiveFloat",
    "PositiveInt",
    "Ratio",
    "SGDParams",
    "SUPPORTED_ZERO_STAGES",
    "SchedulerConfig",
    "StageOrAuto",
    "TensorParallelConfig",
    "WandbConfig",
    "WarmupCosineLRParams",
    "WarmupDecayLRParams",
    "WarmupLRParams",
    "WarmupType",
    "WatchdogConfig",
    "ZeroConfig",
    "ZeroStackConfig",
    "grad_accum_refusal",
    "load_config",
    "read_config",
]
