"""Every top-level key of DeepSpeed 0.19.8's config is known to zerostack (zerostack.config.keys):
it works, or it loads with no effect and is named in one warning at ``initialize``, or it is
refused with a one-line ConfigError naming it and saying why."""

from __future__ import annotations

import json
import logging
import os
import sys
import typing

import pydantic
import pytest
import torch

import zerostack
from zerostack.config import ConfigError, ZeroStackConfig, load_config
from zerostack.config.keys import (
    DEEPSPEED_IGNORES_UNKNOWN,
    DEEPSPEED_KEYS,
    NESTED_NO_EFFECT,
    NO_EFFECT,
    UNSUPPORTED,
    WORKS,
    no_effect_settings,
)
from zerostack.optim import CPUAdam, build_optimizer

from tests.support.models import batch, tiny_gpt
from tests.support.ranks import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import config_table  # noqa: E402
from _pages import between  # noqa: E402

# DeepSpeed 0.19.8's top-level config keys, read from its source (deepspeed/runtime/config.py:
# DeepSpeedConfig._initialize_params and the get_* helpers it calls, with the key names in
# runtime/constants.py; the blocks it hands to other modules: comm/config.py, monitor/config.py,
# runtime/activation_checkpointing/config.py, profiling/config.py, autotuning/config.py,
# datastates/config.py, runtime/swap_tensor/aio_config.py, runtime/model_checkpointing/config.py,
# compile/config.py, utils/config.py, runtime/tensor_parallel/config.py,
# runtime/data_pipeline/config.py, runtime/zero/config.py (allgather_size, read with the
# deprecated "zero_optimization": true), runtime/precision_config.py; deepspeed/__init__.py's
# sequence_parallel_size / data_parallel_size; _REMOVED_TOP_LEVEL_CONFIG_KEYS, which it refuses),
# and checked by running DeepSpeedConfig on a dict that records every key read from it.
# Committed here so the suite needs no DeepSpeed.
DEEPSPEED_0_19_8_KEYS = {
    "activation_checkpointing", "aio", "allgather_size", "autotuning", "bf16", "bfloat16",
    "checkpoint", "comet", "communication_data_type", "comms_logger", "compile", "csv_monitor",
    "data_efficiency", "data_parallel_size", "data_types", "dataloader_drop_last",
    "datastates_ckpt", "disable_allgather", "disable_python_gc", "dump_state", "expert_parallel",
    "flops_profiler", "fp16", "gradient_accumulation_steps", "gradient_allreduce_op",
    "gradient_clipping", "gradient_predivide_factor", "hybrid_engine", "log_level",
    "managed_gradient_accumulation", "memory_breakdown", "optimizer", "pipeline",
    "prescale_gradients", "scheduler", "seq_parallel_communication_data_type",
    "sequence_parallel_size", "steps_per_print", "tensor_parallel", "tensorboard", "timers",
    "torch_autocast", "train_batch_size", "train_micro_batch_size_per_gpu",
    "use_data_before_expert_parallelism", "vocabulary_size", "wall_clock_breakdown", "wandb",
    "weight_quantization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "zero_optimization",
    # removed in 0.19; DeepSpeed raises on them
    "amp", "compression_training", "curriculum_learning", "eigenvalue", "elasticity",
    "graph_harvesting", "nebula", "progressive_layer_drop", "quantize_training",
    "sparse_attention", "sparse_gradients",
}  # fmt: skip

REFUSED = object()  # no value of the key loads

# key: (a value that asks for something, a value that asks for nothing: DeepSpeed's default)
SAMPLES = {
    # not supported
    "managed_gradient_accumulation": (False, True),
    "gradient_allreduce_op": ("sum", "MEAN"),
    "expert_parallel": ({"enabled": True, "autoep_size": 2}, {"enabled": False}),
    "comet": ({"enabled": True}, {"enabled": False, "project": "p"}),
    "autotuning": ({"enabled": True}, {"enabled": False, "fast": True}),
    "compile": ({"deepcompile": True}, {"deepcompile": False}),
    "weight_quantization": ({"quantized_initialization": {}}, None),
    **{
        key: ({}, REFUSED)
        for key in (
            "amp",
            "compression_training",
            "curriculum_learning",
            "eigenvalue",
            "elasticity",
            "graph_harvesting",
            "nebula",
            "progressive_layer_drop",
            "quantize_training",
            "sparse_attention",
            "sparse_gradients",
        )
    },
    # no effect
    "seq_parallel_communication_data_type": ("bf16", "fp32"),
    "zero_allow_untested_optimizer": (True, False),
    "zero_force_ds_cpu_optimizer": (False, True),
    "allgather_size": (1e8, 5e8),
    "data_parallel_size": (2, None),
    "use_data_before_expert_parallelism": (True, False),
    "disable_allgather": (True, False),
    "timers": ({"throughput": {"enabled": False}}, {}),
    "dump_state": (True, False),
    "disable_python_gc": (True, False),
    "vocabulary_size": (50257, None),
    "datastates_ckpt": ({"host_cache_size": 16}, False),
    "aio": ({"block_size": 1048576}, {}),
}


def _keys_of(status: str) -> list[str]:
    return [k for k, e in DEEPSPEED_KEYS.items() if e.status == status]


def _named() -> set[str]:
    """ZeroStackConfig's field names and their aliases."""
    names = set(ZeroStackConfig.model_fields)
    for field in ZeroStackConfig.model_fields.values():
        alias = field.validation_alias
        names.update(a for a in getattr(alias, "choices", ()) if isinstance(a, str))
    return names


def test_the_inventory_is_deepspeed_0_19_8s_top_level_keys():
    assert set(DEEPSPEED_KEYS) == DEEPSPEED_0_19_8_KEYS
    assert {e.status for e in DEEPSPEED_KEYS.values()} == {WORKS, NO_EFFECT, UNSUPPORTED}
    assert all(e.note and "\n" not in e.note for e in DEEPSPEED_KEYS.values())


def test_keys_that_work_are_config_fields_and_unsupported_ones_are_not():
    named = _named()
    assert [k for k in _keys_of(WORKS) if k not in named] == []
    assert [k for k in _keys_of(UNSUPPORTED) if k in named] == []
    assert set(SAMPLES) == set(_keys_of(UNSUPPORTED)) | set(_keys_of(NO_EFFECT))


def test_communication_and_accumulation_dtypes_load():
    cfg = load_config(
        {"communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"}}
    )
    assert cfg.communication_data_type == "fp32" and cfg.data_types.grad_accum_dtype == "fp32"


@pytest.mark.parametrize("key", _keys_of(UNSUPPORTED))
def test_an_unsupported_key_is_refused_naming_it_and_why(key):
    asking, quiet = SAMPLES[key]
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 8, key: asking})
    note = DEEPSPEED_KEYS[key].note
    assert str(info.value) == f"{key}: not supported by zerostack ({note})"
    if quiet is not REFUSED:  # DeepSpeed's default asks for nothing: it loads
        assert load_config({key: quiet}).to_dict()[key] == quiet


def test_unsupported_messages():
    cases = {
        "compile": {"deepcompile": True},
        "gradient_allreduce_op": "sum",
        "amp": {"enabled": False},
    }
    got = []
    for key, value in cases.items():
        with pytest.raises(ConfigError) as info:
            load_config({key: value})
        got.append(str(info.value))
    assert got == [
        "compile: not supported by zerostack (no DeepCompile (deepcompile: true); "
        "engine.compile() compiles block by block)",
        "gradient_allreduce_op: not supported by zerostack (gradients are always averaged over "
        'data-parallel ranks: "mean")',
        "amp: not supported by zerostack (removed from DeepSpeed, which refuses it too; use fp16 "
        "or bf16)",
    ]


def test_several_refusals_are_one_line():
    with pytest.raises(ConfigError) as info:
        quantized = {"quantized_initialization": {}}
        load_config({"nebula": {}, "weight_quantization": quantized, "aio": 3})
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.split("; ") == [  # in the inventory's order
        "aio: must be a JSON object (got 3)",
        "weight_quantization: not supported by zerostack (no quantized weights)",
        "nebula: not supported by zerostack (removed from DeepSpeed, which refuses it too)",
    ]


@pytest.mark.parametrize("key", _keys_of(NO_EFFECT))
def test_a_key_with_no_effect_loads_and_is_named_only_when_set(key):
    asking, quiet = SAMPLES[key]
    cfg = load_config({key: asking})
    assert no_effect_settings(cfg) == [f"{key} ({DEEPSPEED_KEYS[key].note})"]
    assert load_config(cfg.to_dict()) == cfg
    assert no_effect_settings(load_config({key: quiet})) == []


def _set(path: str, value) -> dict:
    """A stage-3 config with ``path`` set to ``value`` (offload blocks on the CPU)."""
    out: dict = {"zero_optimization": {"stage": 3}}
    at = out
    *blocks, name = path.split(".")
    for block in blocks:
        at = at.setdefault(block, {"device": "cpu"} if block.startswith("offload_") else {})
    at[name] = value
    return out


# values other than the default where flipping or halving it does not make one
OTHER_THAN = {
    "checkpoint.tag_validation": "Fail",
    "checkpoint.writer": {"type": "fast"},
    "tensor_parallel.partition_config.tp_size": 2,
    "tensor_parallel.partition_config.lm_head_patterns": ["output"],
}


def _other_than(default, path=""):
    if path in OTHER_THAN:
        return OTHER_THAN[path]
    if isinstance(default, bool) or default is None:
        return not default
    return default // 2 if isinstance(default, int) else default / 2


@pytest.mark.parametrize("path", list(NESTED_NO_EFFECT))
def test_a_nested_key_with_no_effect_is_named_only_when_set(path):
    *blocks, name = path.split(".")
    model = ZeroStackConfig
    for block in blocks:
        model = model.model_fields[block].annotation
        model = next((a for a in getattr(model, "__args__", ()) if a is not type(None)), model)
    default = model.model_fields[name].get_default(call_default_factory=True)
    changed = load_config(_set(path, _other_than(default, path)))
    assert no_effect_settings(changed) == [f"{path} ({NESTED_NO_EFFECT[path]})"]
    assert no_effect_settings(load_config(_set(path, default))) == []


def test_misspelled_keys_get_a_suggestion():
    cases = {
        "comms_loger": "comms_logger",
        "torch_autocst": "torch_autocast",
        "zero_force_ds_cpu_optimiser": "zero_force_ds_cpu_optimizer",
        "gradient_clippng": "gradient_clipping",
    }
    for typo, meant in cases.items():
        with pytest.raises(ConfigError) as info:
            load_config({typo: 1})
        assert str(info.value) == f"{typo}: unknown key (did you mean {meant!r}?)"


def test_wrong_types_of_keys_without_a_field():
    cases = {
        "dump_state": (1, "dump_state: must be true or false (got 1)"),
        "allgather_size": (True, "allgather_size: must be a number (got True)"),
        "seq_parallel_communication_data_type": (
            32,
            "seq_parallel_communication_data_type: must be a string (got 32)",
        ),
        "compile": (True, "compile: must be a JSON object (got True)"),
    }
    for key, (value, message) in cases.items():
        with pytest.raises(ConfigError) as info:
            load_config({key: value})
        assert str(info.value) == message


def test_the_deprecated_boolean_zero_optimization():
    assert load_config({"zero_optimization": True}).zero_optimization.stage == 1
    assert load_config({"zero_optimization": False}).zero_optimization.stage == 0
    with pytest.raises(ConfigError) as info:
        load_config({"deepspeed_only": {}})
    assert str(info.value) == "deepspeed_only: not a config key (set by the loader)"


def test_log_level():
    assert load_config({"log_level": "WARNING"}).log_level == "warning"
    with pytest.raises(ConfigError) as info:
        load_config({"log_level": "loud"})
    assert str(info.value).startswith("log_level: must be 'debug', 'info', 'warning', ")


def test_torch_adam_is_torch_optims_plain_adam_also_offloaded():
    params = [torch.nn.Parameter(torch.zeros(3))]
    for torch_adam in (False, True):
        spec = load_config(
            {"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "torch_adam": torch_adam}}}
        ).optimizer
        plain = build_optimizer(spec, [{"params": params}])
        offloaded = build_optimizer(spec, [{"params": params}], offload=True)
        assert type(plain) is torch.optim.AdamW
        assert bool(plain.defaults["fused"]) is not torch_adam
        assert type(offloaded) is (torch.optim.AdamW if torch_adam else CPUAdam)


def test_the_reference_table_is_the_generated_one():
    shown = between(config_table.PAGE, config_table.BEGIN, config_table.END)
    assert shown == config_table.table(), "run: python scripts/config_table.py --write"


# ------------------------------------------------------------------------ at initialize
class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


NO_EFFECT_CONFIG = {
    "zero_allow_untested_optimizer": True,
    "dump_state": False,  # its default: not named
    "aio": {"block_size": 1048576},
    "zero_optimization": {"stage": 1, "overlap_comm": True, "reduce_scatter": True},
}
NAMED = [
    "zero_allow_untested_optimizer (any torch optimizer runs under ZeRO)",
    "aio (the NVMe store does its own file I/O)",
    "zero_optimization.overlap_comm (reduction always overlaps backward)",
]


def _initialize_logs(rank, world):
    log = logging.getLogger("zerostack")
    records = _Records()
    log.addHandler(records)
    base = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    out = {}
    # the no-effect keys, the level from log_level, and the memory line each step
    config = {**base, **NO_EFFECT_CONFIG, "log_level": "INFO", "memory_breakdown": True}
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=config)
    out["level"] = log.level
    x, y = batch(0, 2)
    engine.backward(engine(x, y))
    engine.step()
    out["memory"] = engine.memory_breakdown()
    out["messages"] = [(r.levelname, r.getMessage()) for r in records.records]
    records.records.clear()
    # nothing set: nothing named; log_level "error" silences the warning
    zerostack.initialize(model=tiny_gpt(), config=base)
    zerostack.initialize(
        model=tiny_gpt(), config={**base, **NO_EFFECT_CONFIG, "log_level": "error"}
    )
    out["later"] = [r.getMessage() for r in records.records if r.levelno >= logging.WARNING]
    out["final_level"] = log.level
    log.removeHandler(records)
    log.setLevel(logging.NOTSET)
    return out


@pytest.mark.distributed
def test_at_initialize_warning_level_and_memory_line():
    results = run_distributed(_initialize_logs, 2)
    for rank, out in enumerate(results):
        assert out["level"] == logging.INFO and out["final_level"] == logging.ERROR
        warnings = [m for level, m in out["messages"] if level == "WARNING"]
        if rank == 0:
            assert warnings == [
                "config keys accepted for DeepSpeed compatibility that have no effect in "
                "zerostack: " + "; ".join(NAMED)
            ]
            assert ("INFO", f"memory (bytes): {out['memory']}") in out["messages"]
        else:
            assert warnings == []
        assert out["later"] == []


# --- keys DeepSpeed ignores, under deepspeed.initialize ----------------------------------------

UNKNOWN_GOLDEN = json.load(
    open(os.path.join(ROOT, "tests", "golden", "deepspeed_unknown_keys.json"))
)


def _blocks(model, prefix=""):
    """The dotted paths of a config model's nested blocks."""
    for name, field in model.model_fields.items():
        for kind in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(kind, type) and issubclass(kind, pydantic.BaseModel):
                yield prefix + name
                yield from _blocks(kind, prefix + name + ".")


def test_where_deepspeed_ignores_unknown_keys_is_measured_on_deepspeed():
    assert UNKNOWN_GOLDEN["deepspeed_version"] == "0.19.8"
    assert UNKNOWN_GOLDEN["command"].startswith("DS_ACCELERATOR=cpu .peers/bin/python scripts/")
    probed = UNKNOWN_GOLDEN["blocks"]
    ignores = {block for block, seen in probed.items() if seen["deepspeed"] == "ignored"}
    assert DEEPSPEED_IGNORES_UNKNOWN == ignores
    # every block of zerostack's config and every DeepSpeed block without a field was probed
    ours = {b for b in _blocks(ZeroStackConfig) if b not in {"watchdog", "loss_spike"}}
    theirs = {k for k, entry in DEEPSPEED_KEYS.items() if entry.kind is dict}
    assert ours | theirs <= set(probed)


TRL_KEYS = {  # trl/models/utils.py prepare_deepspeed, for a hidden size of 32
    "zero_optimization.reduce_bucket_size": 1024,
    "zero_optimization.stage3_param_persistence_threshold": 320,
    "zero_optimization.stage3_prefetch_bucket_size": 921.6,
}


def test_as_deepspeed_ignores_what_deepspeed_ignores_and_names_it():
    cfg = {
        "train_batch_size": 2,
        "zero_optimization": {"stage": 3},
        **TRL_KEYS,
        "activation_checkpointing": {"partition_activations": False, "not_a_key": 1},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}, "legacy_fusion": False},
    }
    before = json.dumps(cfg, sort_keys=True)
    loaded = load_config(cfg, unknown_keys="as_deepspeed")
    assert json.dumps(cfg, sort_keys=True) == before  # the caller's dict is left as it was
    assert set(loaded.ignored_keys) == {
        *TRL_KEYS,
        "activation_checkpointing.not_a_key",
        "optimizer.legacy_fusion",
    }
    assert loaded.zero_optimization.stage == 3 and loaded.optimizer.params.lr == 0.1
    # natively every one is an error, named
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    for key in TRL_KEYS:
        assert f"{key}: unknown key" in str(err.value)
    assert load_config({"train_batch_size": 2}).ignored_keys == ()


@pytest.mark.parametrize(
    "block", ["zero_optimization", "zero_optimization.offload_optimizer", "fp16", "bf16"]
)
def test_as_deepspeed_still_refuses_where_deepspeed_refuses(block):
    cfg: dict = {"train_batch_size": 2, "zero_optimization": {"stage": 2}}
    inner = cfg
    for part in block.split("."):
        inner = inner.setdefault(part, {})
    inner["stage3_prefetch_bucket_sise"] = 1
    with pytest.raises(ConfigError, match=rf"^{block}\.stage3_prefetch_bucket_sise: unknown key"):
        load_config(cfg, unknown_keys="as_deepspeed")


def _facade_and_native(rank, world):
    import zerostack.compat.deepspeed as deepspeed

    records = _Records()
    logging.getLogger("zerostack").addHandler(records)
    cfg = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = deepspeed.initialize(model=tiny_gpt(), config={**cfg, **TRL_KEYS})
    try:
        zerostack.initialize(model=tiny_gpt(), config={**cfg, **TRL_KEYS})
        native = "accepted"
    except ConfigError as exc:
        native = str(exc)
    warned = [r.getMessage() for r in records.records if r.levelno >= logging.WARNING]
    return {"stage": engine.zero_optimization_stage(), "native": native, "warned": warned}


@pytest.mark.distributed
def test_deepspeed_initialize_warns_and_zerostack_initialize_refuses():
    for rank, out in enumerate(run_distributed(_facade_and_native, 2)):
        assert out["native"].startswith("zero_optimization.reduce_bucket_size: unknown key")
        expected = (
            "config keys neither zerostack nor DeepSpeed 0.19.8 knows, ignored as DeepSpeed "
            "ignores them (zerostack.initialize refuses them): " + ", ".join(TRL_KEYS)
        )
        assert out["warned"] == ([expected] if rank == 0 else [])
