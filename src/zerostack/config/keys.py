"""Every top-level key of DeepSpeed 0.19.8's config, and what zerostack does with it.

:data:`DEEPSPEED_KEYS` is the one table. Each key either

- **works**: a field of :class:`~zerostack.config.ZeroStackConfig` that zerostack implements;
- has **no effect**: accepted so that an existing ``ds_config.json`` loads, and named in one
  warning at ``initialize`` (rank 0, the "zerostack" logger) when set to anything but its
  default; or
- is **not supported**: a one-line :class:`~zerostack.config.ConfigError` naming the key and
  why, unless its value asks for nothing (DeepSpeed's default, or a block with
  ``"enabled": false``).

:data:`NESTED_NO_EFFECT` lists the keys inside zerostack's own blocks that are accepted with no
effect; they are warned about in the same message. ``scripts/config_table.py`` writes the
docs' table from both (``docs/reference/config-keys.md``), and a test holds the page to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WORKS = "works"
NO_EFFECT = "no effect"
UNSUPPORTED = "not supported"

log = logging.getLogger("zerostack")


def _always(value: Any) -> bool:
    return True


def _differs(default: Any) -> Callable[[Any], bool]:
    return lambda value: value != default


def _enabled(value: Any) -> bool:
    return bool(value.get("enabled", False))


def _non_empty(value: Any) -> bool:
    return bool(value)


@dataclass(frozen=True)
class Key:
    """What zerostack does with one DeepSpeed key."""

    status: str
    """WORKS, NO_EFFECT or UNSUPPORTED."""
    note: str
    """What it does here, or why it has no effect / is not supported (one short phrase)."""
    asks: Callable[[Any], bool] = _always
    """Whether a value asks for something (differs from DeepSpeed's default): an unsupported key
    is refused, and a no-effect key warned about, only then. Unused for WORKS keys."""
    kind: type | tuple[type, ...] = object
    """JSON type a key without a field must have (dict: a block)."""


def _works(note: str) -> Key:
    return Key(WORKS, note)


def _no_effect(note: str, asks: Callable[[Any], bool], kind: type | tuple = object) -> Key:
    return Key(NO_EFFECT, note, asks, kind)


def _unsupported(note: str, asks: Callable[[Any], bool] = _always, kind=object) -> Key:
    return Key(UNSUPPORTED, note, asks, kind)


_REMOVED = "removed from DeepSpeed, which refuses it too"

DEEPSPEED_KEYS: dict[str, Key] = {
    # batch and step
    "train_batch_size": _works("global batch; any two of the three batch keys fix the third"),
    "train_micro_batch_size_per_gpu": _works('per-rank micro-batch; "auto": chosen by the planner'),
    "gradient_accumulation_steps": _works("micro-batches per optimizer step"),
    "managed_gradient_accumulation": _unsupported(
        "gradients are reduced in the boundary's backward; use "
        "set_gradient_accumulation_boundary() or no_sync()",
        _differs(True),
        bool,
    ),
    "steps_per_print": _works("the progress line on rank 0; inf (as Accelerate sets it): never"),
    "gradient_clipping": _works("global-norm clipping; default 1.0, as DeepSpeed 0.19.8 (0: off)"),
    "prescale_gradients": _works("divide by dp before the reduction"),
    "gradient_predivide_factor": _works("divide by it before the reduction, by dp / it after"),
    "gradient_allreduce_op": _unsupported(
        'gradients are always averaged over data-parallel ranks: "mean"',
        lambda v: not (isinstance(v, str) and v.lower() == "mean"),
    ),
    "communication_data_type": _works("the dtype gradients are reduced in"),
    "seq_parallel_communication_data_type": _no_effect(
        "Ulysses' all-to-alls move the activations in their own dtype",
        lambda v: v.lower() != "fp32",
        str,
    ),
    "dataloader_drop_last": _works("the engine's data loader drops a last partial batch"),
    # precision
    "fp16": _works("dynamic or static loss scaling, fp32 masters; auto_cast casts inputs"),
    "bf16": _works("bf16 compute, fp32 masters"),
    "bfloat16": _works("DeepSpeed's old name of bf16"),
    "data_types": _works("grad_accum_dtype; the block's other DeepSpeed keys are refused"),
    "torch_autocast": _works(
        "forward under torch.autocast: bf16, with the bf16 block or fp32 weights at stage 0"
    ),
    "amp": _unsupported(_REMOVED + "; use fp16 or bf16"),
    # optimizer
    "optimizer": _works(
        "Adam, AdamW, SGD, Lion, Adagrad, Lamb, Muon (Muon not yet with ep or offload_param "
        "on NVMe); any other: pass a torch optimizer"
    ),
    "scheduler": _works("WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest"),
    "zero_allow_untested_optimizer": _no_effect(
        "any torch optimizer runs under ZeRO", _differs(False), bool
    ),
    "zero_force_ds_cpu_optimizer": _no_effect(
        "offloaded masters are stepped by any optimizer; CPUAdam is not forced",
        _differs(True),
        bool,
    ),
    # parallelism
    "zero_optimization": _works("stages 0-3, CPU / NVMe offload; true (deprecated) is stage 1"),
    "allgather_size": _no_effect(
        "read only with the deprecated zero_optimization: true; all-gathers are not bucketed by "
        "size here",
        _differs(5e8),
        (int, float),
    ),
    "tensor_parallel": _works(
        "autotp_size: Megatron-style tensor parallelism; partition_config: which layers, by pattern"
    ),
    "pipeline": _works("stages, partition, seed_layers, activation_checkpoint_interval"),
    "activation_checkpointing": _works("CPU, partitioned and contiguous checkpoints"),
    "sequence_parallel_size": _works("Ulysses sequence parallelism over neighbouring dp ranks"),
    "data_parallel_size": _no_effect(
        "the data-parallel size is world size / tp / pp / sequence_parallel_size",
        lambda v: v is not None,
    ),
    "expert_parallel": _unsupported("no expert parallelism for MoE layers", _enabled, dict),
    "use_data_before_expert_parallelism": _no_effect(
        "no expert parallelism for MoE layers", _differs(False), bool
    ),
    "disable_allgather": _no_effect(
        "updated parameters are always all-gathered", _differs(False), bool
    ),
    # monitoring and debugging
    "tensorboard": _works("DeepSpeed's event names, on rank 0"),
    "csv_monitor": _works("one CSV file per metric, on rank 0"),
    "wandb": _works("Weights & Biases run, on rank 0"),
    "comet": _unsupported(
        "Comet is not wired; use tensorboard, csv_monitor or wandb", _enabled, dict
    ),
    "comms_logger": _works("collectives summarised by op and size, latency and bandwidth"),
    "flops_profiler": _works("one step's forward profiled and printed"),
    "wall_clock_breakdown": _works("forward / backward / step times with the progress line"),
    "memory_breakdown": _works("engine.memory_breakdown() with the progress line"),
    "timers": _no_effect(
        "throughput is always measured for the progress line and the monitors", _non_empty, dict
    ),
    "log_level": _works('the "zerostack" logger\'s level'),
    "dump_state": _no_effect("no state dump", _differs(False), bool),
    "disable_python_gc": _no_effect(
        "Python's garbage collector is left as it is", _differs(False), bool
    ),
    "vocabulary_size": _no_effect(
        "only DeepSpeed's tensor-core alignment warning reads it", lambda v: v is not None
    ),
    # checkpoints and I/O
    "checkpoint": _works(
        "auto_resume, save_interval, keep_last, async_save; DeepSpeed's I/O sub-keys no effect"
    ),
    "datastates_ckpt": _no_effect(
        "checkpoints are written in zerostack's own format", lambda v: v is not False
    ),
    "aio": _no_effect("the NVMe store does its own file I/O", _non_empty, dict),
    # features zerostack does not have
    "autotuning": _unsupported(
        'use the planner: zerostack plan, or "auto" stage / micro-batch', _enabled, dict
    ),
    "hybrid_engine": _works("generate with the whole model gathered once (stage 3)"),
    "data_efficiency": _works(
        "dynamic batching (variable batch size and LR) and random-LTD (through DeepSpeed's "
        "convert_to_random_ltd); curriculum learning refused"
    ),
    "compile": _unsupported(
        "no DeepCompile (deepcompile: true); engine.compile() compiles block by block",
        lambda v: bool(v.get("deepcompile", False)),
        dict,
    ),
    "weight_quantization": _unsupported("no quantized weights", lambda v: v is not None),
    # DeepSpeed 0.19 removed these and raises on them
    "nebula": _unsupported(_REMOVED),
    "compression_training": _unsupported(_REMOVED),
    "quantize_training": _unsupported(_REMOVED),
    "sparse_gradients": _unsupported(_REMOVED),
    "eigenvalue": _unsupported(_REMOVED),
    "sparse_attention": _unsupported(_REMOVED),
    "elasticity": _unsupported(_REMOVED),
    "graph_harvesting": _unsupported(_REMOVED),
    "curriculum_learning": _unsupported(_REMOVED + "; data_efficiency had it"),
    "progressive_layer_drop": _unsupported(_REMOVED),
}
"""DeepSpeed 0.19.8's top-level keys (``deepspeed/runtime/config.py`` and the blocks it reads)."""

_OFFLOAD_NO_EFFECT = {
    "buffer_size": "the NVMe store sizes its own buffers",
    "max_in_cpu": "offloaded parameters are all in host memory or all in files",
    "fast_init": "the NVMe store initialises its files in one pass",
    "ratio": "the whole optimizer is offloaded",
}

NESTED_NO_EFFECT: dict[str, str] = {
    "tensor_parallel.partition_config.tp_size": "autotp_size decides (DeepSpeed overwrites it)",
    "tensor_parallel.partition_config.use_default_specs": "no preset_model to merge with: the "
    "specs alone decide, as in DeepSpeed without one",
    "tensor_parallel.partition_config.embedding_partition_dim": "embeddings stay whole",
    "tensor_parallel.partition_config.lm_head_patterns": "no vocabulary-parallel LM head",
    "bf16.immediate_grad_update": "gradients are applied at the step",
    "zero_optimization.allgather_partitions": "updated partitions are always all-gathered",
    "zero_optimization.allgather_bucket_size": "stages 1-2 all-gather per reduce bucket, "
    "stage 3 per module",
    "zero_optimization.overlap_comm": "reduction always overlaps backward",
    "zero_optimization.contiguous_gradients": "gradients always live in flat buffers",
    "zero_optimization.round_robin_gradients": "gradient partitions follow bucket order",
    "zero_optimization.elastic_checkpoint": "checkpoints load on any layout already",
    "zero_optimization.ignore_unused_parameters": "parameters without a gradient are "
    "always tolerated",
    "zero_optimization.memory_efficient_linear": "stage 3's linear always saves the weight "
    "parameter, never its gathered storage (the memory-efficient form)",
    "zero_optimization.load_from_fp32_weights": "fp32 masters are always restored from the "
    "checkpoint",
    "checkpoint.tag_validation": "tags are not compared; every rank must pass the same",
    "checkpoint.use_node_local_storage": "checkpoints go to the one folder given",
    "checkpoint.parallel_write.pipeline_stage": "every rank writes its own file",
    "checkpoint.writer": "safetensors files, one per rank",
    "data_efficiency.data_sampling.num_epochs": "curriculum learning's, which is refused",
    "hybrid_engine.max_out_tokens": "no inference kernels: no workspace to size",
    "hybrid_engine.release_inference_cache": "no inference cache",
    "hybrid_engine.pin_parameters": "no inference containers to pin",
    "hybrid_engine.tp_gather_partition_size": "the whole model is gathered at once",
    "hybrid_engine.enable_cuda_graph": "no CUDA graphs",
    **{f"zero_optimization.offload_optimizer.{k}": v for k, v in _OFFLOAD_NO_EFFECT.items()},
    **{f"zero_optimization.offload_param.{k}": v for k, v in _OFFLOAD_NO_EFFECT.items()},
}
"""Keys inside zerostack's blocks (dotted paths) accepted with no effect, and why."""


DEFAULT_DIFFERENCES: dict[str, str] = {
    "steps_per_print": (
        "10 (DeepSpeed None): the progress line is also when the monitors flush their files, "
        "and a run that never flushes loses its metrics when it crashes; `null` or `inf` is "
        "DeepSpeed's silence"
    ),
    "pipeline.partition": (
        "'parameters' (DeepSpeed 'best'): the key must agree with the PipelineModule, whose "
        "partition_method defaults to 'parameters' in DeepSpeed too; there is no 'best' here"
    ),
    "zero_optimization.offload_param.buffer_count": (
        "4 (DeepSpeed 5): one model serves both offload blocks, and offload_optimizer's is 4"
    ),
    "checkpoint.tag_validation": (
        "'Warn' (DeepSpeed 'WARN'): the same setting (either spelling is read); no effect here"
    ),
}
"""Config keys whose default is not DeepSpeed 0.19.8's, with why (tests/test_deepspeed_defaults.py
holds every other default to DeepSpeed's)."""


def unsupported_error(key: str) -> str:
    """The message of the ConfigError for an unsupported key (after ``"<key>: "``)."""
    return f"not supported by zerostack ({DEEPSPEED_KEYS[key].note})"


def _nested_value(cfg, path: str) -> tuple[Any, Any] | None:
    """``(value, default)`` of a dotted field path, None when a block on the way is absent."""
    obj = cfg
    *blocks, name = path.split(".")
    for block in blocks:
        obj = getattr(obj, block)
        if obj is None:
            return None
    return getattr(obj, name), type(obj).model_fields[name].get_default(call_default_factory=True)


def no_effect_settings(cfg) -> list[str]:
    """The keys with no effect that ``cfg`` sets to anything but their default, each as
    ``"<key> (<why it has no effect>)"``, top-level keys first."""
    out = []
    for key, entry in DEEPSPEED_KEYS.items():
        if entry.status != NO_EFFECT:
            continue
        if key in cfg.deepspeed_only:
            value, asks = cfg.deepspeed_only[key], entry.asks(cfg.deepspeed_only[key])
        elif key in type(cfg).model_fields:
            value = getattr(cfg, key)
            asks = value != type(cfg).model_fields[key].get_default(call_default_factory=True)
        else:
            continue
        if asks:
            out.append(f"{key} ({entry.note})")
    for path, why in NESTED_NO_EFFECT.items():
        found = _nested_value(cfg, path)
        if found is not None and found[0] != found[1]:
            out.append(f"{path} ({why})")
    return out


def warn_pageable_offload(cfg, device, rank: int) -> None:
    """One warning on rank 0 when an offload block on a GPU turns ``pin_memory`` off: every copy
    of offloaded state then stops the host until the stream has drained."""
    if device.type != "cuda" or rank != 0:
        return
    zero = cfg.zero_optimization
    for name in ("offload_optimizer", "offload_param"):
        block = getattr(zero, name)
        if block is not None and block.device != "none" and not block.pin_memory:
            log.warning(
                "zero_optimization.%s.pin_memory=false: offloaded state is copied from pageable "
                "host memory, and each copy stops the host until the GPU's stream has drained; "
                "set it true (DeepSpeed's default) unless page-locked memory is short",
                name,
            )


DEEPSPEED_IGNORES_UNKNOWN = frozenset(
    {
        "",
        "activation_checkpointing",
        "aio",
        "autotuning",
        "checkpoint",
        "checkpoint.parallel_write",
        "data_efficiency",
        "data_efficiency.data_sampling",
        "data_efficiency.data_sampling.dynamic_batching",
        "data_types",
        "expert_parallel",
        "flops_profiler",
        "optimizer",
        "pipeline",
        "scheduler",
        "tensor_parallel.partition_config",
        "tensor_parallel.partition_config.layer_specs",
        "timers",
        "torch_autocast",
    }
)
"""The blocks (``""``: the top level) where DeepSpeed 0.19.8 ignores a key it does not know:
they are read key by key, where ``zero_optimization``, ``fp16``, ``bf16``, ``tensor_parallel``,
the monitors, ``comms_logger``, ``compile`` and ``hybrid_engine`` are pydantic models that refuse
one, and ``optimizer.params`` / ``scheduler.params`` are keyword arguments. Under ``deepspeed.
initialize`` such a key is left out with a warning (:func:`zerostack.config.load_config`'s
``unknown_keys``). Measured on DeepSpeed itself: ``scripts/deepspeed_unknown_keys.py``, held to
this set by tests/test_config_keys.py."""


def warn_no_effect(cfg, rank: int) -> None:
    """One warning on rank 0 naming the keys ``cfg`` sets that have no effect in zerostack, and
    one naming those left out because DeepSpeed ignores them too."""
    if cfg.ignored_keys and rank == 0:
        log.warning(
            "config keys neither zerostack nor DeepSpeed 0.19.8 knows, ignored as DeepSpeed "
            "ignores them (zerostack.initialize refuses them): %s",
            ", ".join(cfg.ignored_keys),
        )
    settings = no_effect_settings(cfg)
    if settings and rank == 0:
        log.warning(
            "config keys accepted for DeepSpeed compatibility that have no effect in zerostack: %s",
            "; ".join(settings),
        )
