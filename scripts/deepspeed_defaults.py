r"""Record DeepSpeed's default for every config key that zerostack's typed config also has.

Run under DeepSpeed's virtualenv (zerostack is not imported); without --write it prints the JSON::

    DS_ACCELERATOR=cpu .peers/bin/python scripts/deepspeed_defaults.py \
        --write tests/golden/deepspeed_defaults.json

Each of ZEROSTACK_KEYS (the leaf key paths of zerostack.config.ZeroStackConfig) gets {"value",
"source": "<file in the deepspeed package>:<name>"}, or {"deepspeed": "absent"}. Values come from
DeepSpeed's objects: pydantic sub-config fields, the *_DEFAULT constants get_scalar_param reads
(checked against DeepSpeedConfig({"train_batch_size": 1}), world size 1 without a process group),
and the signatures of the optimizer and scheduler classes DeepSpeed builds from "params".
"""

import argparse
import contextlib
import enum
import inspect
import json
import math
import os
import pathlib
import sys

COMMAND = (
    "DS_ACCELERATOR=cpu .peers/bin/python scripts/deepspeed_defaults.py"
    " --write tests/golden/deepspeed_defaults.json"
)
_ABSENT = object()
# Leaf key paths of zerostack.config.ZeroStackConfig (nested models walked), sorted.
ZEROSTACK_KEYS = """
activation_checkpointing.contiguous_memory_optimization activation_checkpointing.cpu_checkpointing
activation_checkpointing.number_checkpoints activation_checkpointing.partition_activations
activation_checkpointing.profile activation_checkpointing.synchronize_checkpoint_boundary
bf16.bf16_master_weights_and_grads bf16.bf16_optimizer_states fp16.fp16_master_weights_and_grads
bf16.enabled bf16.immediate_grad_update checkpoint.async_save checkpoint.auto_resume
checkpoint.deepspeed_files
checkpoint.keep_last checkpoint.load_universal checkpoint.parallel_write.pipeline_stage
checkpoint.pickled_client_state checkpoint.save_dir checkpoint.save_interval
checkpoint.tag_validation
checkpoint.use_node_local_storage checkpoint.writer comms_logger.debug comms_logger.enabled
comms_logger.prof_all comms_logger.prof_ops comms_logger.verbose communication_data_type
data_efficiency.data_routing data_efficiency.data_sampling.curriculum_learning
data_efficiency.data_sampling.dynamic_batching.enabled
data_efficiency.data_sampling.dynamic_batching.lr_scaling_method
data_efficiency.data_sampling.dynamic_batching.max_batch_size
data_efficiency.data_sampling.dynamic_batching.max_tokens
data_efficiency.data_sampling.dynamic_batching.metrics_path
data_efficiency.data_sampling.dynamic_batching.min_batch_size
data_efficiency.data_sampling.dynamic_batching.sequence_picking_order
data_efficiency.data_sampling.dynamic_batching.verbose data_efficiency.data_sampling.enabled
data_efficiency.data_sampling.num_epochs data_efficiency.data_sampling.num_workers
data_efficiency.data_sampling.pin_memory data_efficiency.enabled data_efficiency.seed
hybrid_engine.enable_cuda_graph hybrid_engine.enabled hybrid_engine.inference_tp_size
hybrid_engine.max_out_tokens hybrid_engine.pin_parameters hybrid_engine.release_inference_cache
hybrid_engine.tp_gather_partition_size
csv_monitor.enabled csv_monitor.job_name csv_monitor.output_path data_types.grad_accum_dtype
dataloader_drop_last flops_profiler.detailed flops_profiler.enabled flops_profiler.module_depth
flops_profiler.output_file flops_profiler.profile_step flops_profiler.recompute_fwd_factor
flops_profiler.top_modules fp16.auto_cast fp16.consecutive_hysteresis fp16.enabled fp16.hysteresis
fp16.initial_scale_power fp16.loss_scale fp16.loss_scale_window fp16.min_loss_scale
gradient_accumulation_steps gradient_clipping gradient_predivide_factor log_level loss_spike.factor
loss_spike.max_rollbacks loss_spike.patience loss_spike.window memory_breakdown on_nonfinite_grads
optimizer.params.adam_w_mode optimizer.params.amsgrad optimizer.params.betas
optimizer.params.dampening optimizer.params.eps optimizer.params.foreach
optimizer.params.fp32_optimizer_states optimizer.params.initial_accumulator_value
optimizer.params.lr optimizer.params.lr_decay optimizer.params.maximize optimizer.params.momentum
optimizer.params.adam_lr optimizer.params.muon_lr optimizer.params.ns_method
optimizer.params.bias_correction optimizer.params.eps_inside_sqrt optimizer.params.max_coeff
optimizer.params.min_coeff
optimizer.params.per_head_muon
optimizer.params.nesterov optimizer.params.set_grad_none optimizer.params.torch_adam
optimizer.params.weight_decay optimizer.type
pipeline.activation_checkpoint_interval pipeline.partition pipeline.schedule pipeline.seed_layers
pipeline.stages pipeline.virtual_stages prescale_gradients ring_parallel_size
scheduler.params.cos_min_ratio scheduler.params.last_batch_iteration
scheduler.params.cycle_first_stair_count scheduler.params.cycle_first_step_size
scheduler.params.cycle_max_lr scheduler.params.cycle_max_mom scheduler.params.cycle_min_lr
scheduler.params.cycle_min_mom scheduler.params.cycle_momentum
scheduler.params.cycle_second_stair_count scheduler.params.cycle_second_step_size
scheduler.params.decay_lr_rate scheduler.params.decay_mom_rate scheduler.params.decay_step_size
scheduler.params.lr_range_test_min_lr scheduler.params.lr_range_test_staircase
scheduler.params.lr_range_test_step_rate scheduler.params.lr_range_test_step_size
scheduler.params.total_num_steps
scheduler.params.warmup_max_lr scheduler.params.warmup_min_lr scheduler.params.warmup_min_ratio
scheduler.params.warmup_num_steps scheduler.params.warmup_type scheduler.type seed
sequence_parallel_size steps_per_print tensor_parallel.autotp_size
tensor_parallel.partition_config.embedding_partition_dim
tensor_parallel.partition_config.layer_specs
tensor_parallel.partition_config.lm_head_patterns tensor_parallel.partition_config.strict_mode
tensor_parallel.partition_config.tp_size tensor_parallel.partition_config.use_default_specs
tensorboard.enabled torch_autocast.dtype torch_autocast.enabled
torch_autocast.lower_precision_safe_modules
tensorboard.job_name tensorboard.output_path train_batch_size train_micro_batch_size_per_gpu
wall_clock_breakdown wandb.enabled wandb.group wandb.project wandb.team watchdog.enabled
watchdog.history watchdog.interval watchdog.timeout zero_allow_untested_optimizer
zero_optimization.allgather_bucket_size zero_optimization.allgather_partitions
zero_optimization.contiguous_gradients zero_optimization.elastic_checkpoint
zero_optimization.ignore_unused_parameters zero_optimization.leaf_module.classes
zero_optimization.leaf_module.name_suffixes zero_optimization.leaf_module.names
zero_optimization.load_from_fp32_weights
zero_optimization.offload_optimizer.buffer_count zero_optimization.offload_optimizer.buffer_size
zero_optimization.offload_optimizer.device zero_optimization.offload_optimizer.fast_init
zero_optimization.offload_optimizer.max_in_cpu zero_optimization.offload_optimizer.nvme_path
zero_optimization.offload_optimizer.pin_memory zero_optimization.offload_optimizer.ratio
zero_optimization.offload_param.buffer_count zero_optimization.offload_param.buffer_size
zero_optimization.offload_param.device zero_optimization.offload_param.fast_init
zero_optimization.offload_param.max_in_cpu zero_optimization.offload_param.nvme_path
zero_optimization.offload_param.pin_memory zero_optimization.offload_param.ratio
zero_optimization.overlap_comm zero_optimization.reduce_bucket_size
zero_optimization.reduce_scatter zero_optimization.round_robin_gradients zero_optimization.stage
zero_optimization.stage3_gather_16bit_weights_on_model_save
zero_optimization.stage3_max_live_parameters zero_optimization.stage3_max_reuse_distance
zero_optimization.stage3_param_persistence_threshold zero_optimization.stage3_prefetch_bucket_size
zero_optimization.sub_group_size zero_optimization.zero_hpz_partition_size
zero_optimization.zero_quantized_gradients zero_optimization.zero_quantized_gradients_bits
zero_optimization.zero_quantized_weights
zero_optimization.memory_efficient_linear
zero_optimization.zero_quantized_nontrainable_weights
""".split()


def jsonable(v):
    v = v.value if isinstance(v, enum.Enum) else v
    if isinstance(v, tuple | list):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):  # a block DeepSpeed reads as a dict (data_efficiency's)
        return {k: jsonable(x) for k, x in v.items()}
    if isinstance(v, float) and math.isinf(v):
        return str(v)
    if v is None or isinstance(v, bool | float | str):
        return v
    return int(v)  # an int (DeepSpeed's pp_int prints as "50,000,000"), or fail


def where(obj):
    """The file defining ``obj``, relative to the deepspeed package (or site-packages)."""
    root = os.path.dirname(os.path.dirname(sys.modules["deepspeed"].__file__))
    return os.path.relpath(inspect.getfile(obj), root).removeprefix("deepspeed" + os.sep)


def from_constants(modules, key):
    """``NAME_DEFAULT`` for the constant ``NAME == key``, as get_scalar_param reads it."""
    for mod in modules:
        names = [n for n in dir(mod) if getattr(mod, n) == key and hasattr(mod, n + "_DEFAULT")]
        assert len(names) <= 1, (key, names)
        if names:
            return getattr(mod, names[0] + "_DEFAULT"), f"{where(mod)}:{names[0]}_DEFAULT"
    return None


def from_model(model, parts):
    """Declared default of a (nested) pydantic field, by alias or name."""
    from pydantic import BaseModel

    for i, part in enumerate(parts):
        name = next((n for n, f in model.model_fields.items() if f.alias == part), part)
        field = model.model_fields.get(name)
        if field is None:
            return None
        if i < len(parts) - 1:
            kinds = [field.annotation, *getattr(field.annotation, "__args__", ())]
            model = next(k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel))
            continue
        value, source = field.get_default(call_default_factory=True), f"{model.__name__}.{name}"
        made = model().model_dump(by_alias=True)[part]
        if jsonable(made) != jsonable(value):  # a validator fills it in
            source += f" (validated {model.__name__}() has {made!r})"
        return value, f"{where(model)}:{source}"


def from_signatures(classes, arg):
    """Default of ``arg`` in the first of ``classes`` whose __init__ takes it (the others'
    noted where they differ); None for a required argument."""
    params = [(c, inspect.signature(c.__init__).parameters) for c in classes]
    found = [(c, p[arg].default) for c, p in params if arg in p]
    if not found:
        return None
    (cls, value), *others = [(c, None if v is inspect.Parameter.empty else v) for c, v in found]
    notes = [f"{c.__name__}: {v!r}" for c, v in others if v != value]
    notes += ["required, no default"] * (found[0][1] is inspect.Parameter.empty)
    notes = f" ({'; '.join(notes)})" if notes else ""
    return value, f"{where(cls)}:{cls.__name__}.__init__.{arg}{notes}"


def deepspeed_defaults():
    import torch
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.monitor.config import DeepSpeedMonitorConfig
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import FusedAdam
    from deepspeed.ops.lamb import FusedLamb
    from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
    from deepspeed.profiling import constants as flops_constants
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime import constants, engine, lr_schedules
    from deepspeed.runtime.activation_checkpointing import config as act_config
    from deepspeed.runtime.model_checkpointing import constants as ckpt_constants
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    dsc = ds_config.DeepSpeedConfig({"train_batch_size": 1})
    assert dsc.world_size == 1, dsc.world_size
    batch = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    models = {"zero_optimization": DeepSpeedZeroConfig, "tensor_parallel": TPTrainingConfig}
    models.update(fp16=DeepSpeedFP16Config, bf16=DeepSpeedBF16Config)
    models.update(comms_logger=CommsLoggerConfig, hybrid_engine=ds_config.HybridEngineConfig)
    # Blocks read with get_scalar_param: (modules of constants, the object holding the values).
    scalars = {"": ([constants], dsc), "data_types": ([constants], None)}
    scalars["activation_checkpointing"] = [act_config], dsc.activation_checkpointing_config
    scalars["flops_profiler"] = [flops_constants], dsc.flops_profiler_config
    scalars["checkpoint"] = scalars["checkpoint.parallel_write"] = [constants, ckpt_constants], None
    schedulers = [lr_schedules.WarmupLR, lr_schedules.WarmupDecayLR, lr_schedules.WarmupCosineLR,
                  lr_schedules.OneCycle, lr_schedules.LRRangeTest]  # fmt: skip
    from deepspeed.module_inject.autotp_config import AutoTPConfig

    pipeline = ds_config.get_pipeline_config({})
    torch_adam = "pop(TORCH_ADAM_PARAM, False)"  # a literal in the engine's code
    assert torch_adam in inspect.getsource(engine.DeepSpeedEngine.get_optimizer_configuration)
    get_config = f"{where(engine)}:DeepSpeedEngine.get_optimizer_configuration ({torch_adam})"
    cst, cfg, adam_w_mode = where(constants), where(ds_config), ds_config.ADAM_W_MODE_DEFAULT
    special = {
        "optimizer.type": (constants.OPTIMIZER_TYPE_DEFAULT, f"{cst}:OPTIMIZER_TYPE_DEFAULT"),
        "scheduler.type": (constants.SCHEDULER_TYPE_DEFAULT, f"{cst}:SCHEDULER_TYPE_DEFAULT"),
        "optimizer.params.adam_w_mode": (adam_w_mode, f"{cfg}:ADAM_W_MODE_DEFAULT"),
        "optimizer.params.torch_adam": (False, get_config),
        # Read by getter functions of the config module from the block, when given
        "torch_autocast.enabled": (dsc.torch_autocast_enabled, f"{cfg}:get_torch_autocast_enabled"),
        "torch_autocast.dtype": (dsc.torch_autocast_dtype, f"{cfg}:get_torch_autocast_dtype"),
        "torch_autocast.lower_precision_safe_modules": (
            dsc.torch_autocast_lower_precision_safe_modules,
            f"{cfg}:get_lower_precision_safe_modules",
        ),
        # Read only when given (DeepSpeedConfig.__init__ then divides the world size by it).
        "sequence_parallel_size": (1, f"{cfg}:DeepSpeedConfig.__init__ (absent: 1)"),
    }
    from deepspeed.runtime.data_pipeline import config as de_config

    data_efficiency = de_config.get_data_efficiency_config({})
    out = {}
    for path in ZEROSTACK_KEYS:
        (block, _, leaf), (head, *rest) = path.rpartition("."), path.split(".")
        found = special.get(path)
        if found is None and head == "data_efficiency":
            node = data_efficiency
            for part in rest:
                node = node.get(part, _ABSENT) if isinstance(node, dict) else _ABSENT
            if node is not _ABSENT:
                found = node, f"{where(de_config)}:get_data_efficiency_config"
        elif found is None and path.startswith("tensor_parallel.partition_config."):
            # a dict AutoTP reads with AutoTPConfig.from_dict: the dataclass's defaults
            field = AutoTPConfig.__dataclass_fields__[leaf]
            made = field.default_factory() if callable(field.default_factory) else field.default
            found = made, f"{where(AutoTPConfig)}:AutoTPConfig.{leaf}"
        elif found is None and head in models:
            found = from_model(models[head], rest)
        elif found is None and head in ("tensorboard", "csv_monitor", "wandb"):
            found = from_model(DeepSpeedMonitorConfig, [head, *rest])
        elif found is None and head == "pipeline" and leaf in pipeline:
            found = pipeline[leaf], f"{cfg}:get_pipeline_config.default_pipeline"
        elif found is None and block == "optimizer.params":  # Adam/W, SGD, Lion, Adagrad, Lamb
            optimizers = [FusedAdam, torch.optim.SGD, FusedLion, DeepSpeedCPULion,
                          torch.optim.Adagrad, DeepSpeedCPUAdagrad, FusedLamb]  # fmt: skip
            found = from_signatures(optimizers, leaf)
        elif found is None and block == "scheduler.params":
            found = from_signatures(schedulers, leaf)
        elif found is None and block in scalars:
            modules, obj = scalars[block]
            found = from_constants(modules, leaf)
            if found and obj is not None and path not in batch:  # the object agrees
                assert getattr(obj, leaf) == found[0], (path, getattr(obj, leaf), found)
        value = {"value": jsonable(found[0]), "source": found[1]} if found else None
        out[path] = value or {"deepspeed": "absent"}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="PATH", help="write the JSON here, not to stdout")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout
        import deepspeed

        defaults = deepspeed_defaults()
    doc = {"deepspeed_version": deepspeed.__version__, "command": COMMAND, "defaults": defaults}
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    pathlib.Path(args.write).write_text(text) if args.write else sys.stdout.write(text)


if __name__ == "__main__":
    main()
