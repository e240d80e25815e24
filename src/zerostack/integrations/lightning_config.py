"""The config a :class:`~.lightning.ZeroStackStrategy` gives ``initialize``: the strategy's
own (its ``config``, ``stage`` and offload flags) with the Trainer's accumulation, clipping,
micro-batch and precision filled in; a setting given in two places that disagree is refused,
naming both, where DeepSpeed's strategy lets one silently win.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl

from ..config import read_config


def engine_config(strategy_config: dict, trainer: pl.Trainer, precision: str) -> dict:
    """``strategy_config`` with the Trainer's settings filled in (see the module)."""
    config = copy.deepcopy(strategy_config)
    _agree(
        config,
        "gradient_accumulation_steps",
        trainer.accumulate_grad_batches,
        "Trainer(accumulate_grad_batches=...)",
    )
    if trainer.gradient_clip_algorithm == "value" and trainer.gradient_clip_val:
        raise ValueError(
            "ZeroStackStrategy: gradient_clip_algorithm='value' is not supported; the "
            "engine clips by global norm (gradient_clip_algorithm='norm')"
        )
    if trainer.gradient_clip_val is not None:
        _agree(
            config,
            "gradient_clipping",
            float(trainer.gradient_clip_val),
            "Trainer(gradient_clip_val=...)",
        )
    config.setdefault("gradient_clipping", 0.0)  # Lightning's default: no clipping
    config.setdefault("train_micro_batch_size_per_gpu", _loader_batch_size(trainer))
    for key, wanted in (("bf16", "bf16-"), ("fp16", "16-")):
        on = precision.startswith(wanted)
        given = config.get(key, {}).get("enabled", False) if key in config else None
        if given is None:
            if on:
                config[key] = {"enabled": True}
        elif bool(given) != on:
            raise ValueError(
                f"ZeroStackStrategy: the config's {key}.enabled={given} contradicts "
                f"Trainer(precision={precision!r})"
            )
    return config


def strategy_config(config, stage, offload_optimizer: bool, offload_parameters: bool) -> dict:
    """The strategy's own config: ``config`` (a dict, JSON path or string; None: empty) with
    ``stage`` and the offload flags in its ``zero_optimization`` block (stage 2 by default, as
    DeepSpeed's strategy)."""
    config = {} if config is None else copy.deepcopy(read_config(config))
    zero = config.setdefault("zero_optimization", {})
    if stage is not None:
        _agree(zero, "stage", stage, f"ZeroStackStrategy(stage={stage})", "zero_optimization.")
    zero.setdefault("stage", 2)  # DeepSpeed's strategy's default
    for flag, key in (
        (offload_optimizer, "offload_optimizer"),
        (offload_parameters, "offload_param"),
    ):
        if flag:
            device = zero.setdefault(key, {"device": "cpu"}).get("device", "none")
            if device == "none":
                raise ValueError(
                    f"ZeroStackStrategy: {key}=True contradicts the config's "
                    f"zero_optimization.{key}.device='none'"
                )
    return config


def _agree(config: dict, key: str, value, source: str, prefix: str = "") -> None:
    if key in config and config[key] != value:
        raise ValueError(
            f"ZeroStackStrategy: the config's {prefix}{key}={config[key]!r} contradicts "
            f"{source} = {value!r}; set it in one place"
        )
    config[key] = value


def _loader_batch_size(trainer: pl.Trainer) -> int:
    """The training loader's batch size (the engine counts samples with it), else 1."""
    source = trainer.fit_loop._data_source
    if source.is_defined():
        sampler = getattr(source.dataloader(), "batch_sampler", None)
        if getattr(sampler, "batch_size", None):
            return sampler.batch_size
    return 1
