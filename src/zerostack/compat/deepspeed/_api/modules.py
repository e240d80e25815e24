"""The DeepSpeed API table's module sections: ``deepspeed.*`` as scripts, Transformers and
Accelerate call it (see :mod:`zerostack.compat.deepspeed._api`)."""

from __future__ import annotations

from .rows import _IMPORT_PIPE, _LOGGER, _NO_OPS, Api, _different, _no, _served, _works

MODULES: dict[str, dict[str, Api]] = {
    "deepspeed": {
        "deepspeed.initialize": _works(
            "model, optimizer, model_parameters, training_data, lr_scheduler, config or "
            "config_params, args.deepspeed_config; returns (engine, optimizer, loader, scheduler); "
            "no optimizer at all: a forward-only engine, as DeepSpeed's"
        ),
        "deepspeed.init_distributed": _works(
            "DeepSpeed's keywords, by name (the positional order differs); gloo on CPU, NCCL on GPU"
        ),
        "deepspeed.zero": _works(),
        "deepspeed.comm": _works(),
        "deepspeed.checkpointing": _works(),
        "deepspeed.utils": _works(),
        "deepspeed.pipe": _different(_IMPORT_PIPE),
        "deepspeed.PipelineModule": _different(
            "DeepSpeed's arguments but `dynamic_shape`", "zerostack.pipeline.PipelineModule"
        ),
        "deepspeed.DeepSpeedEngine": _different(
            "the engine `initialize` returns (a `zerostack.Engine`); its methods below",
            "zerostack.compat.deepspeed.DeepSpeedEngine",
        ),
        "deepspeed.runtime.engine.DeepSpeedEngine": _served(
            "zerostack.Engine with DeepSpeed's own accessors"
        ),
        "deepspeed.PipelineEngine": _different(
            "the engine `initialize` returns for a PipelineModule",
            "zerostack.pipeline.PipelineEngine",
        ),
        "deepspeed.DeepSpeedConfig": _served(
            "`DeepSpeedConfig(config, mpu=None)`: checked as `initialize` checks it, batch sizes "
            "resolved; DeepSpeed's attribute names (`.typed`: zerostack.ZeroStackConfig)"
        ),
        "deepspeed.runtime.config.DeepSpeedConfig": _served("`deepspeed.DeepSpeedConfig`"),
        "deepspeed.runtime.config.LAMB_OPTIMIZER": _served("DeepSpeed's optimizer-name constants"),
        "deepspeed.version": _served("`deepspeed.__version__`"),
        "deepspeed.monitor.monitor.MonitorMaster": _served(
            "`MonitorMaster(ds_config.monitor_config)`: the config's monitors, on global rank 0"
        ),
        "deepspeed.utils.groups.initialize": _served(
            "deprecated in DeepSpeed: does nothing (the MoE layers' ep_size makes the groups)"
        ),
        "deepspeed.runtime.utils.set_random_seed": _served("random, NumPy and torch, as DeepSpeed"),
        "deepspeed.DeepSpeedConfigError": _different(
            "one line naming the key and why", "zerostack.ConfigError"
        ),
        "deepspeed.__version__": _served(
            "`0.19.8+zerostack.<version>`: the API level, a local label (`zerostack.__version__` "
            "is zerostack's own)"
        ),
        "deepspeed.add_config_arguments": _served(
            "DeepSpeed's flags (`--deepspeed`, `--deepspeed_config`, the deprecated "
            "`--deepscale*`); `initialize(args=...)` reads the config's path"
        ),
        "deepspeed.get_accelerator": _served("the device calls the libraries make, over torch"),
        "deepspeed.ops": _served("DeepSpeedCPUAdam and FusedAdam; " + _NO_OPS),
        "deepspeed.ops.deepspeed4science.DS4Sci_EvoformerAttention": _served(
            "torch's scaled_dot_product_attention with the biases as its mask: DeepSpeed's "
            "shapes, checks and bias gradients; fp32 too on a CPU"
        ),
        "deepspeed.ops.op_builder.AsyncIOBuilder": _served(
            "`load().aio_handle(...)`: DeepSpeed's handle and return values over pread/pwrite "
            "threads (no O_DIRECT); errors raised naming the file"
        ),
        "deepspeed.ops.op_builder.GDSBuilder": _served(
            "`gds_handle` through host memory when CUDA is there (no cuFile); without it "
            "`load()` raises DeepSpeed's error"
        ),
        "deepspeed.moe": _works(),
        "deepspeed.logger": _served(_LOGGER),
        "deepspeed.log_dist": _served("on the ranks listed, to zerostack's logger"),
        "deepspeed.OnDevice": _no("build under `zero.Init`, or with torch's `with torch.device()`"),
        "deepspeed.DeepSpeedOptimizer": _no("optimizers are plain torch optimizers"),
        "deepspeed.DeepSpeedDataLoader": _no(
            "`initialize(training_data=...)` returns a torch DataLoader (DistributedSampler)"
        ),
        "deepspeed.init_inference": _served(
            "dtype (default fp16), tensor_parallel / mp_size split by zerostack's AutoTP table, "
            "injection_policy checked against it, max_out_tokens; no fused kernels or CUDA "
            "graphs (a warning), int8 and checkpoint= refused"
        ),
        "deepspeed.InferenceEngine": _served(
            "the module's forward and generate (no beam search, as DeepSpeed); what it lacks, "
            "its module's"
        ),
        "deepspeed.tp_model_init": _served(
            "checks the config's `tensor_parallel.autotp_size`; `initialize` splits the model"
        ),
        "deepspeed.DeepSpeedTransformerLayer": _served(
            "torch code with the kernel's math (tanh GELU, fp32 softmax, pre-/post-LN), "
            "DeepSpeed's parameters, initialisation and initial_weights; no fused kernels"
        ),
        "deepspeed.DeepSpeedTransformerConfig": _served(
            "DeepSpeed's fields, from_dict, from_json_file"
        ),
        "deepspeed.module_inject.layers.GatherReplacedLayerParams": _served(
            "AutoTP-split parameters whole inside (all-gathered over tp), sliced again after: "
            "OpenRLHF's weight sync"
        ),
        "deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr."
        "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed": _served(
            "DeepSpeed's packing, loader and scaled learning rates (equal to its own); lengths "
            "given, read from metrics_path or measured with batch_seqlens_fn"
        ),
        "deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset.MMapIndexedDataset": (
            _served("DeepSpeed's .idx/.bin format, items as read-only memory-mapped views")
        ),
        "deepspeed.runtime.data_pipeline.data_sampling.data_analyzer.DataAnalyzer": _served(
            "DeepSpeed's map and reduce files, byte for byte; a dict batch counts its samples "
            "(DeepSpeed: its keys) and torch dtypes match numpy's; threads run in turn"
        ),
        "deepspeed.runtime.data_pipeline.data_routing.helper.convert_to_random_ltd": _served(
            "random-LTD: the layers wrapped and set up; they keep DeepSpeed's sampled tokens "
            "(torch's gather/scatter for its CUDA kernels), the mask cut or gathered"
        ),
        "deepspeed.runtime.data_pipeline.data_routing.helper.save_without_random_ltd": _served(
            "the module's state dict under its names without the wrappers"
        ),
        "deepspeed.utils.module_utils.recursive_getattr": _served("a submodule by dotted name"),
        "deepspeed.utils.module_utils.recursive_setattr": _served("replace one by dotted name"),
        "deepspeed.compression.helper": _served(
            "deprecated in DeepSpeed: the two module_utils helpers, with its FutureWarning"
        ),
        "deepspeed.replace_transformer_layer": _no("no kernel injection"),
    },
    "deepspeed.zero": {
        "deepspeed.zero.Init": _works(
            "module, remote_device, config_dict_or_path, enabled; other keywords are ignored"
        ),
        "deepspeed.zero.GatheredParameters": _works("modifier_rank writes back; fwd_module"),
        "deepspeed.zero.ZeroParamStatus": _different(
            "not re-exported by zerostack.zero", "zerostack.zero.stage3.params.ZeroParamStatus"
        ),
        "deepspeed.zero.register_external_parameter": _works(
            "before or after initialize; a parameter read as `module.weight` in another "
            "module's forward is gathered there without it"
        ),
        "deepspeed.zero.TiledLinear": _no("no tiled layers: stage 3 gathers one module at a time"),
        "deepspeed.zero.TiledLinearReturnBias": _no("no tiled layers"),
        "deepspeed.zero.unwrap_model_for_generation": _no(
            "gather for generation with `zero.GatheredParameters(model.parameters())`"
        ),
        "deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live": (
            _different(
                "DeepSpeed's table and signature, zerostack's layout",
                "zerostack.estimate.deepspeed.estimate_zero2_model_states_mem_needs_all_live",
            )
        ),
        "deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_cold": (
            _different(
                "DeepSpeed's table and signature, zerostack's layout",
                "zerostack.estimate.deepspeed.estimate_zero2_model_states_mem_needs_all_cold",
            )
        ),
        "deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live": _different(
            "DeepSpeed's table and signature, zerostack's layout",
            "zerostack.estimate.deepspeed.estimate_zero3_model_states_mem_needs_all_live",
        ),
        "deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_cold": _different(
            "DeepSpeed's table and signature, zerostack's layout",
            "zerostack.estimate.deepspeed.estimate_zero3_model_states_mem_needs_all_cold",
        ),
        "deepspeed.runtime.zero.partition_parameters": _served(
            "what Transformers swaps; an identity: zero.Init does not patch tensor constructors"
        ),
        "deepspeed.runtime.zero.partition_parameters.register_external_parameter": _served(
            "`deepspeed.zero.register_external_parameter`"
        ),
        "deepspeed.runtime.zero.partition_parameters.unregister_external_parameter": _served(
            "before initialize (after it, the module's unit keeps gathering the parameter)"
        ),
        "deepspeed.runtime.zero.partition_parameters.ZeroParamStatus": _served(
            "a stage-3 parameter's `ds_status` (AVAILABLE while gathered, NOT_AVAILABLE)"
        ),
        "deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload": _served(
            "`engine.optimizer.parameter_offload` at stage 3: `module`, `forward_hooks` (their "
            "handles; `[]` takes the rest off), `backward_hooks` (empty: backward's gathers "
            "hang on the forward's outputs), `param_coordinator.is_invalid_trace()` / "
            "`_invalidate_trace()`, `_register_deepspeed_module(module)` (every hook back); "
            "parameters' `ds_active_sub_modules` and modules' `ds_external_parameters()`"
        ),
    },
    "deepspeed.comm": {
        **{
            f"deepspeed.comm.{name}": _works()
            for name in """
                init_distributed is_initialized is_available get_rank get_world_size
                get_local_rank get_global_rank get_world_group get_all_ranks_from_group
                new_group destroy_process_group barrier monitored_barrier all_reduce
                all_reduce_coalesced inference_all_reduce reduce reduce_scatter
                reduce_scatter_tensor reduce_scatter_fn all_gather all_gather_into_tensor
                all_gather_coalesced allgather_fn all_gather_object all_to_all all_to_all_single
                broadcast broadcast_object_list gather scatter send recv isend irecv
                batch_isend_irecv P2POp ReduceOp configure log_summary reset_log
                get_comm_operation_count get_logged_comm_ops has_all_gather_into_tensor
                has_reduce_scatter_tensor has_coalescing_manager has_all_reduce_coalesced
                initialize_mesh_device
            """.split()
        },
        "deepspeed.comm.ProcessGroup": _no("torch's class: `torch.distributed.ProcessGroup`"),
        "deepspeed.comm.set_backend": _no("the backend is torch.distributed's, set at init"),
    },
    "deepspeed.utils": {
        "deepspeed.utils.safe_get_full_fp32_param": _works(),
        "deepspeed.utils.safe_set_full_fp32_param": _different(
            "also sets the compute-dtype weights, so the next forward uses the value"
        ),
        "deepspeed.utils.safe_get_full_optimizer_state": _works(),
        "deepspeed.utils.safe_set_full_optimizer_state": _works(),
        "deepspeed.utils.safe_get_full_grad": _different(
            "the dp mean, unscaled, at every stage (DeepSpeed: this rank's, loss-scaled, at 0-1)"
        ),
        "deepspeed.utils.safe_set_full_grad": _different(
            "in safe_get_full_grad's terms: the gradient the step applies, at every stage"
        ),
        "deepspeed.utils.safe_update_full_grad_vectorized": _works("one parameter at a time"),
        "deepspeed.utils.safe_get_local_fp32_param": _works(),
        "deepspeed.utils.safe_set_local_fp32_param": _different(
            "a collective over dp: the compute-dtype weights take the value too"
        ),
        "deepspeed.utils.safe_get_local_optimizer_state": _works(),
        "deepspeed.utils.safe_set_local_optimizer_state": _works(),
        "deepspeed.utils.safe_get_local_grad": _works("mean and unscaled, as safe_get_full_grad"),
        "deepspeed.utils.safe_set_local_grad": _works("mean and unscaled, as safe_get_full_grad"),
        "deepspeed.utils.logger": _served(_LOGGER),
        "deepspeed.utils.log_dist": _served("on the ranks listed, to zerostack's logger"),
        "deepspeed.utils.groups": _served(
            "the sequence(-data)-parallel getters answer from the last engine "
            "`deepspeed.initialize` built (DeepSpeed's: from its mpu); the rest is not there"
        ),
        "deepspeed.utils.OnDevice": _no("build under `zero.Init`, or with `with torch.device()`"),
        **{
            f"deepspeed.utils.{name}": _served(
                "DeepSpeed's flag (`module._z3_leaf`); stage 3 gathers a leaf and all under it "
                "as one unit (zerostack.zero.stage3.leaves)"
            )
            for name in (
                "set_z3_leaf_modules",
                "unset_z3_leaf_modules",
                "get_z3_leaf_modules",
                "z3_leaf_module",
                "z3_leaf_parameter",
                "set_z3_leaf_module",
                "set_z3_leaf_modules_by_name",
                "set_z3_leaf_modules_by_suffix",
            )
        },
        "deepspeed.utils.RepeatingLoader": _served("DeepSpeed's (also runtime.dataloader's)"),
        "deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint": _served(
            "any layout's checkpoint, every tensor checksummed (zerostack.checkpoint."
            "full_state_dict)"
        ),
        "deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict": _served(
            "DeepSpeed's files and shards; written whole, then renamed"
        ),
        "deepspeed.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint": _served(
            "DeepSpeed's: the model on the CPU, loaded non-strict"
        ),
    },
    "deepspeed.checkpointing": {
        "deepspeed.checkpointing.checkpoint": _works(
            "partition, CPU and contiguous checkpoints from `configure` or the config"
        ),
        "deepspeed.checkpointing.configure": _works(),
        "deepspeed.checkpointing.is_configured": _works(),
        "deepspeed.checkpointing.reset": _works(),
        "deepspeed.checkpointing.model_parallel_cuda_manual_seed": _works(),
        "deepspeed.checkpointing.get_cuda_rng_tracker": _works(),
        "deepspeed.checkpointing.non_reentrant_checkpoint": _no("use `checkpoint`"),
        "deepspeed.checkpointing.set_num_layers": _no("no per-layer activation profiling"),
        "deepspeed.checkpointing.CheckpointFunction": _no("use `checkpoint`"),
        "deepspeed.checkpointing.CudaRNGStatesTracker": _no("use `get_cuda_rng_tracker()`"),
    },
    "deepspeed.pipe": {
        "deepspeed.pipe.PipelineModule": _different(_IMPORT_PIPE + "; no `dynamic_shape`"),
        "deepspeed.pipe.LayerSpec": _different(_IMPORT_PIPE),
        "deepspeed.pipe.TiedLayerSpec": _different(_IMPORT_PIPE),
        "deepspeed.pipe.DualPipeVModule": _no("no DualPipeV schedule"),
        "deepspeed.runtime.pipe.topology.ProcessTopology": _no(
            "the grid is `zerostack.Topology` (one DeviceMesh: pp, dp, tp)"
        ),
    },
    "optimizers and schedules": {
        "deepspeed.ops.adam.DeepSpeedCPUAdam": _different(
            "DeepSpeed's arguments; used for Adam/AdamW with offload_optimizer",
            "zerostack.optim.CPUAdam",
        ),
        "deepspeed.ops.adam.FusedAdam": _served(
            "torch's Adam with DeepSpeed's arguments (decoupled decay when adam_w_mode)"
        ),
        "deepspeed.ops.lamb.FusedLamb": _served(
            "zerostack.optim.Lamb (torch code) with DeepSpeed's arguments; the trust ratio per "
            "parameter at every ZeRO stage (DeepSpeed's ZeRO: per flat partition)"
        ),
        "deepspeed.ops.lion.DeepSpeedCPULion": _served(
            "zerostack.optim.Lion (torch code) with DeepSpeed's arguments; equal to DeepSpeed's "
            "kernel within 1e-6"
        ),
        "deepspeed.ops.lion.FusedLion": _served("zerostack.optim.Lion with DeepSpeed's arguments"),
        "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad": _served(
            "torch's Adagrad with DeepSpeed's arguments (`amsgrad=True` refused)"
        ),
        "deepspeed.runtime.lr_schedules.WarmupLR": _different(
            "DeepSpeed's schedule and arguments", "zerostack.optim.lr_schedules.WarmupLR"
        ),
        "deepspeed.runtime.lr_schedules.WarmupDecayLR": _different(
            "DeepSpeed's schedule and arguments", "zerostack.optim.lr_schedules.WarmupDecayLR"
        ),
        "deepspeed.runtime.lr_schedules.WarmupCosineLR": _different(
            "DeepSpeed's schedule and arguments", "zerostack.optim.lr_schedules.WarmupCosineLR"
        ),
        "deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES": _served(
            "the names of the five schedules, in DeepSpeed's order"
        ),
        "deepspeed.runtime.lr_schedules.OneCycle": _different(
            "DeepSpeed's arguments and lrs and betas step by step; scheduler.type OneCycle",
            "zerostack.optim.lr_schedules.OneCycle",
        ),
        "deepspeed.runtime.lr_schedules.LRRangeTest": _different(
            "DeepSpeed's arguments and lrs step by step; scheduler.type LRRangeTest",
            "zerostack.optim.lr_schedules.LRRangeTest",
        ),
    },
    "other modules": {
        "deepspeed.profiling.flops_profiler.get_model_profile": _works(),
        "deepspeed.profiling.flops_profiler.FlopsProfiler": _works(),
        "deepspeed.accelerator.get_accelerator": _served(
            "the device calls the libraries make, over torch"
        ),
        "deepspeed.checkpoint.utils.clone_tensors_for_torch_save": _served(
            "detached copies on the device given"
        ),
        "deepspeed.runtime.base_optimizer.DeepSpeedOptimizer": _served(
            "a class nothing is an instance of: optimizers are torch's"
        ),
        "deepspeed.runtime.utils.move_to_device": _served(
            "DeepSpeed's; a leaf that is not a tensor is returned as it is (DeepSpeed raises)"
        ),
        "deepspeed.runtime.utils.see_memory_usage": _served(
            "DeepSpeed's lines on rank 0 with force=True; the host's figure from /proc/meminfo"
        ),
        "deepspeed.runtime.dataloader.RepeatingLoader": _served("DeepSpeed's"),
        "deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum": _served(
            "the kinds `engine.offload_states(include=...)` moves; DeepSpeed's values"
        ),
        "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum": _served(
            "`none`, `cpu`, `nvme` (offload_states takes `cpu`)"
        ),
        "deepspeed.runtime.activation_checkpointing.offload_activations."
        "get_checkpoint_hidden_states_offloading_ctx_manager": _different(
            "the hidden states of layers under torch's non-reentrant checkpoint go to host "
            "memory, the last `keep_last_count` kept; copies on the current stream, so "
            "`use_streams`, `max_fwd_stash_count`, `max_cpu_buffer_pool_count` change nothing",
            "zerostack.activation_checkpointing.offload_inputs.offload_checkpoint_inputs",
        ),
        "deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME": _served(
            "DS_ENV_FILE or `.deepspeed_env`, which `zerostack launch` reads, then `.zerostack_env`"
        ),
        "deepspeed.moe.layer.MoE": _different(
            "ep_size > 1 at ZeRO stages 0-2 (not 3); no tutel, no expert tensor parallelism"
        ),
        "deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer": _works(),
        "deepspeed.sequence.layer.DistributedAttention": _works(),
        "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF": _different(
            "register_with_transformers with DeepSpeed's arguments; sdpa or flash attention "
            "(eager and flex_attention refused); returns the mpu `initialize(mpu=)` takes",
            "zerostack.sequence.hf_ulysses.UlyssesSPAttentionHF",
        ),
        "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPDataLoaderAdapter": _different(
            "DeepSpeed's arguments and shards (shift_labels, -100 at the end)",
            "zerostack.sequence.hf_data.UlyssesSPDataLoaderAdapter",
        ),
    },
}
