"""The DeepSpeed API table's engine sections: ``DeepSpeedEngine`` and ``PipelineEngine``
methods and attributes (see :mod:`zerostack.compat.deepspeed._api`)."""

from __future__ import annotations

from .rows import _CFG, ENGINE, PIPE_ENGINE, Api, _different, _no, _works

ENGINES: dict[str, dict[str, Api]] = {
    "engine": {
        **{
            f"{ENGINE}.{name}": _works()
            for name in """
                forward save_16bit_model _zero3_consolidated_16bit_state_dict
                zero_gather_16bit_weights_on_model_save module_state_dict
                set_gradient_accumulation_boundary is_gradient_accumulation_boundary get_lr
                get_global_grad_norm zero_optimization zero_optimization_stage
                zero_optimization_partition_gradients zero_optimization_partition_weights
                fp16_enabled bfloat16_enabled dynamic_loss_scale _get_optimizer_loss_scale
                gradient_accumulation_steps train_micro_batch_size_per_gpu train_batch_size
                get_batch_info global_steps global_samples micro_steps skipped_steps global_rank
                local_rank world_size dp_world_size device module lr_scheduler
                training_dataloader was_step_applied destroy train eval zero_grad
                _consolidated_16bit_state_dict data_parallel_group get_data_parallel_rank
                get_tensor_parallel_rank get_model_parallel_rank mp_world_size get_mom
                gradient_clipping steps_per_print wall_clock_breakdown zero_offload_optimizer
                zero_offload_param optimizer_name
            """.split()
        },
        f"{ENGINE}.backward": _works(
            "retain_graph; scale_wrt_gas=False when the caller has divided the loss already"
        ),
        f"{ENGINE}.step": _different("no `lr_kwargs=`: the scheduler steps without arguments"),
        f"{ENGINE}.save_checkpoint": _works(
            "tag, client_state, save_latest, exclude_frozen_parameters; returns the tag's path"
        ),
        f"{ENGINE}.load_checkpoint": _works(
            "load_module_strict, load_optimizer_states, load_lr_scheduler_states, custom_load_fn"
        ),
        f"{ENGINE}.no_sync": _works("refused at stages 2-3, as DeepSpeed"),
        f"{ENGINE}.loss_scale": _works("the current scale; called, DeepSpeed's configured one"),
        f"{ENGINE}.optimizer": _different(
            "the torch optimizer stepping the fp32 masters (DeepSpeed's is a ZeRO wrapper), with "
            "DeepSpeed's `overflow`, `cur_scale`, `check_overflow()`, `backward(loss)` (not "
            "divided by the accumulation steps) and, at stage 3, `parameter_offload` and "
            "`quantize_nontrainable_params()` set on it"
        ),
        f"{ENGINE}.tput_timer": _works(
            "DeepSpeed's ThroughputTimer: started at forward, stopped at step, 2 steps untimed, "
            "`update_epoch_count`, `avg_samples_per_sec`; its line at info level"
        ),
        f"{ENGINE}.random_ltd_scheduler": _works(
            "random-LTD's kept-token schedule (DeepSpeed's state keys), advanced at each "
            "training forward, saved with checkpoints; None when random_ltd is off"
        ),
        f"{ENGINE}.random_ltd_initialize": _works(
            "sets up the layers convert_to_random_ltd wrapped, by DeepSpeed's layer-id rule"
        ),
        f"{ENGINE}.random_ltd_enabled": _works(),
        f"{ENGINE}.set_data_post_process_func": _works(
            "the training loader keeps it; DeepSpeed applies it only under curriculum learning "
            "(refused here), so it applies nothing, as DeepSpeed without curriculum learning"
        ),
        f"{ENGINE}.random_ltd_config": _works(),
        f"{ENGINE}.config": _works(
            "a read-only dict (defaults and batch sizes filled in); attributes are the typed config"
        ),
        f"{ENGINE}.memory_breakdown": _different(
            "bytes held per kind (params, grads, master, optimizer, scratch), not the config flag"
        ),
        f"{ENGINE}.compile": _different(
            "DeepSpeed's arguments; compiles each block (a ModuleList's children of one class), "
            "else the whole model; `compile_report` says which; no `schedule`, compiled autograd"
        ),
        f"{ENGINE}.is_compiled": _works("True once `engine.compile()` ran"),
        f"{ENGINE}.monitor": _different("writes each step's metrics; no `write_events`"),
        f"{ENGINE}.timers": _different("seconds per phase (forward, backward, step), a dict"),
        f"{ENGINE}.set_train_batch_size": _no("the batch is fixed at `initialize`"),
        f"{ENGINE}.set_train_micro_batch_size": _no("the batch is fixed at `initialize`"),
        f"{ENGINE}.empty_partition_cache": _works(
            "stage 3: releases what stage3_max_reuse_distance kept and the prefetched gathers"
        ),
        f"{ENGINE}.save_fp16_model": _no("use `save_16bit_model`"),
        f"{ENGINE}.load_module_state_dict": _no(
            "use `load_checkpoint` or `module.load_state_dict`"
        ),
        f"{ENGINE}.get_type": _no("read `engine.optimizer.param_groups`"),
        f"{ENGINE}.communication_data_type": _no(_CFG),
        f"{ENGINE}.mpu": _no("`engine.topology` holds the process groups"),
        f"{ENGINE}.get_sequence_parallel_group": _works("None when sequence_parallel_size is 1"),
        f"{ENGINE}.basic_optimizer": _no("`engine.optimizer` is the torch optimizer"),
        f"{ENGINE}.client_optimizer": _no("`engine.optimizer` is the torch optimizer"),
        f"{ENGINE}.client_lr_scheduler": _no("`engine.lr_scheduler`"),
        f"{ENGINE}.deepspeed_io": _no("`initialize(training_data=...)` builds the loader"),
        f"{ENGINE}.offload_states": _works(
            "include, device (cpu), pin_memory, non_blocking; stages 0-3; views kept, bytes moved"
        ),
        f"{ENGINE}.reload_states": _works("training continues bit for bit"),
        f"{ENGINE}.load_universal_checkpoint": _works(
            "checkpoint.load_universal: load_checkpoint takes latest_universal's tag"
        ),
        f"{ENGINE}.allreduce_gradients": _no(
            "the boundary's backward reduces the gradients; `step()` waits for it"
        ),
    },
    "pipeline engine": {
        f"{PIPE_ENGINE}.train_batch": _works("also on a plain (non-pipeline) engine"),
        f"{PIPE_ENGINE}.eval_batch": _different(
            "`eval_batch(data_iter)` returns the mean loss: no return_logits, compute_loss"
        ),
        f"{PIPE_ENGINE}.is_first_stage": _works(),
        f"{PIPE_ENGINE}.is_last_stage": _works(),
        f"{PIPE_ENGINE}.set_dataloader": _works(),
        f"{PIPE_ENGINE}.set_dataiterator": _no("pass the iterator to `train_batch(data_iter)`"),
        f"{PIPE_ENGINE}.set_batch_fn": _no("transform batches in the loader"),
        f"{PIPE_ENGINE}.get_pipeline_parallel_rank": _no('`engine.topology.rank("pp")`'),
        f"{PIPE_ENGINE}.reset_activation_shape": _works(
            "the next batch learns the boundary shapes again (one micro-batch's forward)"
        ),
    },
}
