"""zerostack.config: DeepSpeed-compatible parsing, strictness and one-line error messages."""

import copy
import json
import math
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from zerostack import config as config_module
from zerostack.config import (
    SUPPORTED_ZERO_STAGES,
    AdamParams,
    ConfigError,
    SGDParams,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
    ZeroStackConfig,
    load_config,
)
from zerostack.config import zero as zero_section

# Shaped like the example in DeepSpeed's config documentation, sizes written as floats.
DEEPSPEED_EXAMPLE = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "steps_per_print": 10,
    "optimizer": {
        "type": "Adam",
        "params": {"lr": 0.00015, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000},
    },
    "gradient_clipping": 1.0,
    "fp16": {
        "enabled": True,
        "auto_cast": False,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "consecutive_hysteresis": False,
        "min_loss_scale": 1,
    },
    "zero_optimization": {
        "stage": 0,
        "allgather_partitions": True,
        "allgather_bucket_size": 5e8,
        "overlap_comm": False,
        "reduce_scatter": True,
        "reduce_bucket_size": 5e8,
        "contiguous_gradients": True,
    },
    "wall_clock_breakdown": False,
}


def _at(path: str, problem: str) -> str:
    """Regex: the message starts with the key path, then says the problem."""
    return "^" + re.escape(f"{path}: ") + problem


def _assert_subset(given, loaded, where="config"):
    if isinstance(given, dict):
        for key, value in given.items():
            _assert_subset(value, loaded[key], f"{where}.{key}")
    elif isinstance(given, list):
        assert len(given) == len(loaded), where
        for i, (g, got) in enumerate(zip(given, loaded, strict=True)):
            _assert_subset(g, got, f"{where}[{i}]")
    else:
        assert given == loaded, where
        assert isinstance(given, bool) == isinstance(loaded, bool), where


# --- positive ------------------------------------------------------------------------------


def test_deepspeed_example_loads_unchanged_from_dict_string_and_file(tmp_path):
    given = copy.deepcopy(DEEPSPEED_EXAMPLE)
    cfg = load_config(given)
    assert given == DEEPSPEED_EXAMPLE  # the caller's dict is not modified
    _assert_subset(DEEPSPEED_EXAMPLE, cfg.to_dict())

    text = json.dumps(DEEPSPEED_EXAMPLE, indent=2)
    assert load_config("\n  " + text) == cfg
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    assert load_config(path) == cfg
    assert load_config(str(path)) == cfg

    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert type(cfg.zero_optimization.allgather_bucket_size) is int
    assert cfg.optimizer.params.betas == (0.8, 0.999)
    assert cfg.optimizer.params.lr == 0.00015
    assert isinstance(cfg.optimizer.params, AdamParams)
    assert isinstance(cfg.scheduler.params, WarmupLRParams)
    assert cfg.scheduler.params.warmup_type == "log"
    assert cfg.resolve_batch(2) == (16, 4, 2)


def test_to_dict_is_json_and_round_trips():
    cfg = load_config(DEEPSPEED_EXAMPLE)
    d = cfg.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert load_config(d) == cfg
    assert load_config(json.dumps(d)) == cfg
    sched = {"type": "WarmupDecayLR", "params": {"total_num_steps": 5000}}
    cfg = load_config({"scheduler": sched, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    d = cfg.to_dict()
    assert d["scheduler"]["params"]["total_num_steps"] == 5000
    assert d["optimizer"]["params"]["momentum"] == 0.0
    assert load_config(d) == cfg


def test_steps_per_print_inf_means_never():
    # Accelerate always sets it to float("inf"); a whole float (5.0) is the integer
    assert load_config({"steps_per_print": math.inf}).steps_per_print is None
    assert load_config({"steps_per_print": 5.0}).steps_per_print == 5


def test_defaults_match_deepspeed():
    cfg = load_config({})
    assert cfg.train_batch_size is None
    assert cfg.train_micro_batch_size_per_gpu is None
    assert cfg.gradient_accumulation_steps is None
    assert cfg.steps_per_print == 10
    assert cfg.gradient_clipping == 1.0  # runtime/constants.py: GRADIENT_CLIPPING_DEFAULT
    assert cfg.seed == 0  # DeepSpeed's DistributedSampler seed
    assert cfg.wall_clock_breakdown is False
    assert cfg.dataloader_drop_last is False
    assert cfg.prescale_gradients is False
    assert cfg.gradient_predivide_factor == 1.0
    assert cfg.zero_allow_untested_optimizer is False
    assert cfg.memory_breakdown is False
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.fp16.model_dump() == {
        "enabled": False,
        "auto_cast": False,
        "loss_scale": 0.0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "consecutive_hysteresis": False,
        "min_loss_scale": 1.0,
        "fp16_master_weights_and_grads": False,
    }
    assert cfg.bf16.model_dump() == {
        "enabled": False,
        "immediate_grad_update": False,
        "bf16_master_weights_and_grads": False,
        "bf16_optimizer_states": False,
    }
    assert cfg.zero_optimization.model_dump() == {
        "stage": 0,
        "allgather_partitions": True,
        "allgather_bucket_size": 500_000_000,
        "overlap_comm": None,
        "reduce_scatter": True,
        "reduce_bucket_size": 500_000_000,
        "contiguous_gradients": True,
        "sub_group_size": 1_000_000_000,
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_param_persistence_threshold": 100_000,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
        "stage3_gather_16bit_weights_on_model_save": False,
        "round_robin_gradients": False,
        "elastic_checkpoint": False,
        "ignore_unused_parameters": True,
        "load_from_fp32_weights": True,
        "leaf_module": {  # DeepSpeed 0.19.8's MoE blocks
            "classes": [
                "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
            ],
            "names": [],
            "name_suffixes": [],
        },
        "zero_quantized_weights": False,  # ZeRO++: DeepSpeed's defaults, off
        "memory_efficient_linear": True,  # no effect: always the memory-efficient form
        "zero_quantized_nontrainable_weights": False,  # DeepSpeed's default
        "zero_quantized_gradients": False,
        "zero_quantized_gradients_bits": 8,  # zerostack's key: qgZ's value width
        "zero_hpz_partition_size": 1,
        "offload_optimizer": None,
        "offload_param": None,
    }
    monitor = {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"}
    assert cfg.tensorboard.model_dump() == monitor
    assert cfg.csv_monitor.model_dump() == monitor


def test_optimizer_and_scheduler_param_defaults():
    adam = load_config({"optimizer": {"type": "Adam"}}).optimizer.params
    assert adam.model_dump() == {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.0,
        "adam_w_mode": True,
        "torch_adam": False,
        "amsgrad": False,
        "set_grad_none": True,
    }
    sgd = load_config({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}).optimizer.params
    assert isinstance(sgd, SGDParams)
    assert (sgd.momentum, sgd.dampening, sgd.weight_decay, sgd.nesterov) == (0, 0, 0, False)
    assert (sgd.maximize, sgd.foreach) == (False, None)  # torch's
    assert load_config({"optimizer": {"type": "SGD"}}).optimizer.params.lr == 0.001  # torch's

    # WarmupLR warms up to each group's own lr (None), WarmupDecayLR to 0.001: DeepSpeed's
    warm = {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000}
    warm |= {"warmup_type": "log", "last_batch_iteration": -1}
    sched = load_config({"scheduler": {"type": "WarmupLR"}}).scheduler.params
    assert sched.model_dump() == warm
    sched = {"type": "WarmupDecayLR", "params": {"total_num_steps": 2000}}
    decay = load_config({"scheduler": sched}).scheduler.params
    assert isinstance(decay, WarmupDecayLRParams)
    assert decay.model_dump() == warm | {"total_num_steps": 2000, "warmup_max_lr": 0.001}
    sched = {"type": "WarmupCosineLR", "params": {"total_num_steps": 2000}}
    cosine = load_config({"scheduler": sched}).scheduler.params
    assert isinstance(cosine, WarmupCosineLRParams)
    assert cosine.model_dump() == {
        "total_num_steps": 2000,
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    }


@pytest.mark.parametrize(
    "given, expected",
    [("adamw", "AdamW"), ("ADAM", "Adam"), ("Adam", "Adam"), ("AdamW", "AdamW"), ("sgd", "SGD")],
)
def test_optimizer_type_is_case_insensitive(given, expected):
    opt = load_config({"optimizer": {"type": given, "params": {"lr": 0.5}}}).optimizer
    assert opt.type == expected
    assert opt.params.lr == 0.5


def test_adam_w_mode_semantics():
    def opt(type_, **params):
        return load_config({"optimizer": {"type": type_, "params": params}}).optimizer

    assert opt("Adam").decoupled_weight_decay  # DeepSpeed's Adam defaults to adam_w_mode
    assert not opt("Adam", adam_w_mode=False).decoupled_weight_decay
    assert opt("AdamW", adam_w_mode=False).decoupled_weight_decay
    assert not opt("SGD", lr=0.1).decoupled_weight_decay


def test_aliases():
    cfg = load_config(
        {
            "bfloat16": {"enabled": True},
            "zero_optimization": {
                "prefetch_bucket_size": 7,
                "param_persistence_threshold": 8,
                "max_live_parameters": 9,
                "max_reuse_distance": 10,
                "stage3_gather_fp16_weights_on_model_save": True,
            },
        }
    )
    zero = cfg.zero_optimization
    assert cfg.bf16.enabled
    assert zero.stage3_prefetch_bucket_size == 7
    assert zero.stage3_param_persistence_threshold == 8
    assert zero.stage3_max_live_parameters == 9
    assert zero.stage3_max_reuse_distance == 10
    assert zero.stage3_gather_16bit_weights_on_model_save
    zero = load_config({"zero_optimization": {"gather_16bit_weights_on_model_save": True}})
    assert zero.zero_optimization.stage3_gather_16bit_weights_on_model_save
    d = cfg.to_dict()  # written back with the canonical names
    assert "bf16" in d and "bfloat16" not in d
    assert d["zero_optimization"]["stage3_prefetch_bucket_size"] == 7
    assert "prefetch_bucket_size" not in d["zero_optimization"]


def test_auto_batch_values_mean_not_given():
    cfg = load_config(
        {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": "auto",
        }
    )
    assert cfg.train_batch_size is None and cfg.gradient_accumulation_steps is None
    assert cfg.resolve_batch(4) == (32, 8, 1)


def test_integral_float_sizes_become_ints():
    cfg = load_config({"train_batch_size": 32.0, "zero_optimization": {"sub_group_size": 1e9}})
    assert cfg.train_batch_size == 32 and type(cfg.train_batch_size) is int
    assert cfg.zero_optimization.sub_group_size == 10**9


def test_cpu_offload_false_is_accepted_and_dropped():
    zero = load_config({"zero_optimization": {"cpu_offload": False}}).zero_optimization
    assert zero.cpu_offload is None and zero.offload_optimizer is None
    assert "cpu_offload" not in load_config({}).to_dict()["zero_optimization"]


def test_load_config_passes_a_config_through():
    cfg = load_config({"train_batch_size": 8})
    assert load_config(cfg) is cfg


def test_an_unbuilt_stage_is_refused_in_one_place(monkeypatch):
    assert SUPPORTED_ZERO_STAGES == frozenset({0, 1, 2, 3})
    monkeypatch.setattr(zero_section, "SUPPORTED_ZERO_STAGES", frozenset({0, 1, 2}))
    with pytest.raises(
        ConfigError,
        match=_at(
            "zero_optimization.stage",
            re.escape("3 is not implemented yet in this version of zerostack (supported: 0, 1, 2)"),
        ),
    ):
        load_config(zero(stage=3))
    monkeypatch.setattr(zero_section, "_SUPPORTED_OFFLOAD_DEVICES", frozenset({"none"}))
    zero_cfg = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    with pytest.raises(ConfigError, match=_at("zero_optimization.offload_optimizer.device", "")):
        load_config({"zero_optimization": zero_cfg})


@pytest.mark.parametrize(
    "zero_cfg,key,message",
    [
        ({"stage": 2, "offload_param": {"device": "cpu"}}, "offload_param", "only valid with"),
        ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "offload_optimizer", "needs ZeRO"),
        ({"stage": 3, "offload_param": {"device": "nvme"}}, "offload_param.nvme_path", "required"),
    ],
)
def test_offload_rules(zero_cfg, key, message):
    with pytest.raises(ConfigError, match=_at(f"zero_optimization.{key}", message)):
        load_config({"zero_optimization": zero_cfg})


def test_every_field_is_documented():
    models = [
        m
        for m in vars(config_module).values()
        if isinstance(m, type)
        and issubclass(m, BaseModel)
        and m.__module__.startswith(config_module.__name__ + ".")
    ]
    assert ZeroStackConfig in models and len(models) >= 12
    for model in models:
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"


# --- batch arithmetic ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, dp, expected",
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
        ({"train_batch_size": 32}, 4, (32, 8, 1)),
        ({"train_micro_batch_size_per_gpu": 4}, 8, (32, 4, 1)),
        (
            {
                "train_batch_size": 32,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 2,
            },
            4,
            (32, 4, 2),
        ),
        ({"train_batch_size": 1}, 1, (1, 1, 1)),
    ],
)
def test_resolve_batch(given, dp, expected):
    assert load_config(given).resolve_batch(dp) == expected


ALL_BATCH_KEYS = "train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps"


def test_inconsistent_batch_triple_names_all_keys_and_numbers():
    cfg = load_config(
        {
            "train_batch_size": 32,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
        }
    )
    problem = re.escape("32 != 4 * 2 * 2 (micro * gas * data-parallel size)")
    with pytest.raises(ConfigError, match=_at(ALL_BATCH_KEYS, problem)):
        cfg.resolve_batch(2)


@pytest.mark.parametrize(
    "given, dp, problem",
    [
        (
            {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
            2,
            "30 is not divisible by 4 * 2",
        ),
        (
            {"train_batch_size": 30, "gradient_accumulation_steps": 4},
            1,
            "30 is not divisible by 4 * 1",
        ),
        ({"train_batch_size": 30}, 4, "30 is not divisible by 4"),
        (
            {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4},
            2,
            "4 is not divisible by 4 * 2",
        ),
    ],
)
def test_non_divisible_batch(given, dp, problem):
    with pytest.raises(ConfigError, match=_at(ALL_BATCH_KEYS, re.escape(problem))):
        load_config(given).resolve_batch(dp)


@pytest.mark.parametrize("given", [{}, {"gradient_accumulation_steps": 4}])
def test_batch_size_needed(given):
    with pytest.raises(ConfigError, match=_at("train_batch_size", "at least one of")):
        load_config(given).resolve_batch(1)


@pytest.mark.parametrize("dp", [0, -1, 2.0, True])
def test_resolve_batch_rejects_bad_dp_size(dp):
    with pytest.raises(ValueError, match="dp_world_size"):
        load_config({"train_batch_size": 8}).resolve_batch(dp)


# --- bad configs ---------------------------------------------------------------------------


def zero(**kw):
    return {"zero_optimization": kw}


def opt(type_, **params):
    return {"optimizer": {"type": type_, "params": params}}


def sched(type_, **params):
    return {"scheduler": {"type": type_, "params": params}}


MEAN = "unknown key (did you mean"

# (config, key path the message must start with, literal problem text that must follow it)
BAD_CONFIGS = [
    # unknown keys, with suggestions at every nesting level
    ({"gradient_clippng": 1.0}, "gradient_clippng", f"{MEAN} 'gradient_clipping'?)"),
    (
        {"fp16": {"initial_scale_powr": 8}},
        "fp16.initial_scale_powr",
        f"{MEAN} 'initial_scale_power'?)",
    ),
    (
        zero(reduce_bucket_sise=8),
        "zero_optimization.reduce_bucket_sise",
        f"{MEAN} 'reduce_bucket_size'?)",
    ),
    (
        zero(offload_optimizer={"devce": "cpu"}),
        "zero_optimization.offload_optimizer.devce",
        f"{MEAN} 'device'?)",
    ),
    (opt("AdamW", weight_decy=0.1), "optimizer.params.weight_decy", f"{MEAN} 'weight_decay'?)"),
    (opt("SGD", lr=1, momentun=0.9), "optimizer.params.momentun", f"{MEAN} 'momentum'?)"),
    (
        sched("WarmupLR", warmup_max_rl=1),
        "scheduler.params.warmup_max_rl",
        f"{MEAN} 'warmup_max_lr'?)",
    ),
    ({"bfloat16": {"enabld": True}}, "bf16.enabld", f"{MEAN} 'enabled'?)"),
    ({"frobnicate": {"tag_validation": "Warn"}}, "frobnicate", "unknown key"),
    (opt("Adam", momentum=0.9), "optimizer.params.momentum", "unknown key"),
    ({"bf16": {}, "bfloat16": {}}, "bf16", "given twice (as 'bf16' and 'bfloat16')"),
    # wrong types
    (
        {"train_micro_batch_size_per_gpu": "8"},
        "train_micro_batch_size_per_gpu",
        "must be a valid integer (got '8')",
    ),
    ({"steps_per_print": True}, "steps_per_print", "must be a positive integer or inf (got True)"),
    ({"steps_per_print": 0}, "steps_per_print", "must be a positive integer or inf (got 0)"),
    ({"steps_per_print": None}, "steps_per_print", "must be a positive integer or inf (got None)"),
    ({"steps_per_print": -math.inf}, "steps_per_print", "must be an integer (got -inf)"),
    (
        {"wall_clock_breakdown": [True]},
        "wall_clock_breakdown",
        "must be a valid boolean (got [True])",
    ),
    ({"fp16": {"enabled": 1}}, "fp16.enabled", "must be a valid boolean (got 1)"),
    ({"gradient_clipping": "1.0"}, "gradient_clipping", "must be a valid number (got '1.0')"),
    ({"fp16": True}, "fp16", "must be a JSON object (got True)"),
    ({"optimizer": {"type": "Adam", "params": [0.1]}}, "optimizer.params", "must be a JSON object"),
    (opt("Adam", betas=["0.9", 0.99]), "optimizer.params.betas[0]", "must be a valid number"),
    # ranges and sizes
    ({"train_batch_size": 0}, "train_batch_size", "must be greater than 0 (got 0)"),
    (
        zero(reduce_bucket_size=-1),
        "zero_optimization.reduce_bucket_size",
        "must be greater than 0 (got -1)",
    ),
    (
        {"fp16": {"loss_scale_window": 0}},
        "fp16.loss_scale_window",
        "must be greater than 0 (got 0)",
    ),
    (
        {"fp16": {"initial_scale_power": 65}},
        "fp16.initial_scale_power",
        "must be less than or equal to 64",
    ),
    ({"fp16": {"loss_scale": -1.0}}, "fp16.loss_scale", "must be greater than or equal to 0"),
    (
        zero(allgather_bucket_size=5e8 + 0.5),
        "zero_optimization.allgather_bucket_size",
        "must be an integer (got 500000000.5)",
    ),
    (
        zero(prefetch_bucket_size=-5),
        "zero_optimization.stage3_prefetch_bucket_size",
        "must be greater than or equal to 0",
    ),
    ({"gradient_clipping": -1.0}, "gradient_clipping", "must be greater than or equal to 0"),
    ({"gradient_clipping": float("nan")}, "gradient_clipping", "must be a finite number"),
    ({"gradient_predivide_factor": 0.0}, "gradient_predivide_factor", "must be greater than 0"),
    (opt("Adam", betas=[0.9, 1.0]), "optimizer.params.betas[1]", "must be less than 1"),
    (
        opt("Adam", betas=[0.9, 0.99, 0.9]),
        "optimizer.params.betas",
        "Tuple should have at most 2 items",
    ),
    (opt("Adam", eps=0.0), "optimizer.params.eps", "must be greater than 0"),
    (opt("Adam", lr=-0.1), "optimizer.params.lr", "must be greater than or equal to 0"),
    # optimizer / scheduler types and params
    (
        {"optimizer": {"type": "MuAdam"}},
        "optimizer.type",
        "'MuAdam' is not supported (supported: Adam, AdamW, SGD, Lion, Adagrad, Lamb, Muon)",
    ),
    (opt("Lion", eps=1e-8), "optimizer.params.eps", "unknown key"),
    (opt("Adagrad", amsgrad=True), "optimizer.params.amsgrad", "Adagrad has no AMSGrad variant"),
    (opt("Adagrad", betas=[0.9, 0.99]), "optimizer.params.betas", "unknown key"),
    ({"optimizer": {"type": "OneBitAdam"}}, "optimizer.type", "'OneBitAdam' is not supported"),
    ({"optimizer": {"params": {"lr": 0.1}}}, "optimizer.type", "required key is missing"),
    (opt("SGD", lr=0.1, nesterov=True), "optimizer.params.nesterov", "requires momentum > 0"),
    (
        sched("CyclicLR"),
        "scheduler.type",
        "'CyclicLR' is not supported (supported: WarmupLR, WarmupDecayLR, WarmupCosineLR, "
        "OneCycle, LRRangeTest)",
    ),
    (sched("warmuplr"), "scheduler.type", "'warmuplr' is not supported"),
    (
        {"scheduler": {"type": "WarmupDecayLR"}},
        "scheduler.params.total_num_steps",
        "required key is missing",
    ),
    (sched("WarmupCosineLR"), "scheduler.params.total_num_steps", "required key is missing"),
    (
        sched("WarmupDecayLR", total_num_steps=10),
        "scheduler.params.total_num_steps",
        "10 is less than warmup_num_steps (1000)",
    ),
    (
        sched("WarmupLR", warmup_type="cosine"),
        "scheduler.params.warmup_type",
        "must be 'log' or 'linear' (got 'cosine')",
    ),
    (
        sched("WarmupCosineLR", total_num_steps=9, cos_min_ratio=2),
        "scheduler.params.cos_min_ratio",
        "must be less than or equal to 1",
    ),
    # ZeRO stages, offload, precision
    (zero(stage=4), "zero_optimization.stage", "4 is not one of 0, 1, 2, 3"),
    (zero(stage=-1), "zero_optimization.stage", "-1 is not one of 0, 1, 2, 3"),
    (zero(stage="1"), "zero_optimization.stage", "must be a valid integer"),
    (
        {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
        "fp16.enabled, bf16.enabled",
        "only one of fp16 and bf16 can be enabled",
    ),
    (
        {"fp16": {"enabled": True}, "bfloat16": {"enabled": True}},
        "fp16.enabled, bf16.enabled",
        "only one of",
    ),
    (
        zero(stage=0, offload_param={"device": "cpu"}),
        "zero_optimization.offload_param",
        "only valid with stage 3 (stage is 0)",
    ),
    (
        zero(stage=3, offload_param={"device": "nvme"}),
        "zero_optimization.offload_param.nvme_path",
        "required when device is 'nvme'",
    ),
    (
        zero(offload_optimizer={"device": "nvme"}),
        "zero_optimization.offload_optimizer.nvme_path",
        "required when device is 'nvme'",
    ),
    (
        zero(offload_optimizer={"device": "cpu"}),
        "zero_optimization.offload_optimizer",
        "needs ZeRO stage 1, 2 or 3 (stage is 0)",
    ),
    (
        zero(offload_optimizer={"device": "gpu"}),
        "zero_optimization.offload_optimizer.device",
        "must be 'none', 'cpu' or 'nvme'",
    ),
    (
        zero(cpu_offload=True),
        "zero_optimization.offload_optimizer",
        "needs ZeRO stage 1, 2 or 3 (stage is 0)",
    ),
    (
        zero(cpu_offload=True, offload_optimizer={}),
        "zero_optimization.cpu_offload",
        "deprecated alias of offload_optimizer",
    ),
]


@pytest.mark.parametrize(
    "bad, path, problem", BAD_CONFIGS, ids=[f"{i}-{p}" for i, (_, p, _) in enumerate(BAD_CONFIGS)]
)
def test_bad_config(bad, path, problem):
    with pytest.raises(ConfigError, match=_at(path, re.escape(problem))) as info:
        load_config(bad)
    assert "\n" not in str(info.value)


def test_unknown_key_without_a_close_match_has_no_suggestion():
    with pytest.raises(ConfigError) as info:
        load_config({"frobnicate": {}})
    assert str(info.value) == "frobnicate: unknown key"


def test_several_errors_are_joined_on_one_line():
    bad = {"train_batch_size": 0, "fp16": {"hysteresis": 0, "enabled": "yes"}}
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    msg = str(info.value)
    assert msg.startswith("train_batch_size: must be greater than 0")
    assert "; fp16.enabled: must be a valid boolean" in msg
    assert "; fp16.hysteresis: must be greater than 0" in msg
    assert "\n" not in msg


def test_message_stays_on_one_line():
    with pytest.raises(ConfigError) as info:
        load_config({"optimizer": {"type": "Lam\nb"}})
    assert "\n" not in str(info.value)
    assert str(ConfigError("a\nb")) == "a b"
    assert issubclass(ConfigError, ValueError)


# --- loading -------------------------------------------------------------------------------


def test_bad_json_string():
    with pytest.raises(ConfigError, match=_at("config", "not valid JSON: ")):
        load_config('{"train_batch_size": 8,}')


def test_bad_json_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{'single': 'quotes'}")
    with pytest.raises(ConfigError, match=_at("config", "not valid JSON in .*bad.json: ")):
        load_config(path)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=_at("config", "file not found: " + re.escape(str(path)))):
        load_config(str(path))
    with pytest.raises(ConfigError, match=_at("config", "file not found: ")):
        load_config(Path(path))


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(ConfigError, match=_at("config", "cannot read ")):
        load_config(tmp_path)


def test_no_config():
    with pytest.raises(ConfigError, match=_at("config", "no config given; pass config=dict")):
        load_config(None)


@pytest.mark.parametrize("given", [5, 1.5, ["train_batch_size"], "[1, 2]", "  [ ]", b"{}"])
def test_wrong_top_level_type(given):
    with pytest.raises(ConfigError, match=_at("config", "must be a JSON object")):
        load_config(given)


def test_duplicate_json_keys():
    with pytest.raises(ConfigError, match=_at("config", "duplicate key 'seed' in JSON")):
        load_config('{"seed": 1, "seed": 2}')


@pytest.mark.parametrize(
    "weird",
    [
        {1: 2},
        {"optimizer": {"type": ["Adam"]}},
        {"optimizer": None, "scheduler": {"type": None}},
        {"zero_optimization": {"stage": None}},
        {"zero_optimization": None},
        {"scheduler": {"type": "WarmupLR", "params": "x"}},
        {"train_batch_size": float("inf")},
        {"train_batch_size": "AUTO"},
        {"tensorboard": {"enabled": True, "output_path": 3}},
    ],
)
def test_only_config_error_escapes(weird):
    with pytest.raises(ConfigError):
        load_config(weird)


# --- flops_profiler ------------------------------------------------------------------------


def test_flops_profiler_block_loads_with_deepspeeds_keys_and_rejects_a_wrong_one():
    defaults = load_config({}).flops_profiler
    assert defaults.model_dump() == {
        "enabled": False,
        "recompute_fwd_factor": 0.0,
        "profile_step": 1,
        "module_depth": -1,
        "top_modules": 1,
        "detailed": True,
        "output_file": None,
    }  # DeepSpeed's defaults (deepspeed/profiling/constants.py)
    given = {
        "enabled": True,
        "recompute_fwd_factor": 1.0,
        "profile_step": 5,
        "module_depth": 2,
        "top_modules": 3,
        "detailed": False,
        "output_file": "prof/step5.txt",
    }
    cfg = load_config({**DEEPSPEED_EXAMPLE, "flops_profiler": given})
    assert cfg.flops_profiler.model_dump() == given
    assert load_config(cfg.to_dict()) == cfg

    wrong = re.escape(f"{MEAN} 'top_modules'?)")
    with pytest.raises(ConfigError, match=_at("flops_profiler.top_module", wrong)):
        load_config({"flops_profiler": {"top_module": 3}})
    with pytest.raises(ConfigError, match=_at("flops_profiler.module_depth", "must be greater")):
        load_config({"flops_profiler": {"module_depth": -2}})
    with pytest.raises(ConfigError, match=_at("flops_profiler.enabled", "must be a valid bool")):
        load_config({"flops_profiler": {"enabled": "true"}})
