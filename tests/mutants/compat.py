"""The mutants of src/zerostack/compat/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "deepspeed.utils.groups answers sp 1 after an sp engine is built",
        "compat/deepspeed/utils/groups.py",
        "    return _sp().sp if _sp() is not None else 1",
        "    return 1",
        (
            "tests/test_hf_ring.py::test_alst_with_ring_matches_single_process_training_at_zero_3"
            "[2-2-False]",
        ),
    ),
    Mutant(
        "the deepspeed distribution is not found (the libraries think DeepSpeed is absent)",
        "compat/serve.py",
        '        if wanted is None or wanted.lower().replace("-", "_") == self.name:',
        "        if wanted is None:",
        (
            "tests/test_deepspeed_name.py::"
            "test_the_runner_serves_deepspeed_to_the_libraries_and_nothing_else",
        ),
    ),
    Mutant(
        "deepspeed.zero is a second copy, not zerostack.zero (aliases ignored)",
        "compat/serve.py",
        "                return self.aliases[prefix] + fullname[len(prefix) :]",
        "                break",
        (
            "tests/test_deepspeed_name.py::"
            "test_the_runner_serves_deepspeed_to_the_libraries_and_nothing_else",
        ),
    ),
    Mutant(
        "a real DeepSpeed in the environment is shadowed silently",
        "compat/serve.py",
        "    if real is not None:\n        raise ServeError(",
        "    if False:\n        raise ServeError(",
        ("tests/test_deepspeed_name.py::test_a_real_deepspeed_is_never_shadowed",),
    ),
    Mutant(
        "install() after transformers is imported is not refused",
        "compat/serve.py",
        "    if early:\n",
        "    if False:\n",
        ("tests/test_deepspeed_name.py::test_install_after_the_libraries_is_refused",),
    ),
    Mutant(
        "FusedAdam(adam_w_mode=False) decays decoupled (AdamW), not L2",
        "compat/deepspeed/ops/adam.py",
        "decoupled_weight_decay=adam_w_mode,",
        "decoupled_weight_decay=True,",
        ("tests/test_deepspeed_name.py::test_fused_adam_is_torch_adam_with_deepspeeds_arguments",),
    ),
    Mutant(
        "clone_tensors_for_torch_save keeps views of the whole storage",
        "compat/deepspeed/checkpoint/utils.py",
        "return item.detach().clone().to(device)",
        "return item.detach().to(device)",
        ("tests/test_deepspeed_name.py::test_small_modules",),
    ),
    Mutant(
        "tp_model_init accepts a config without the tp size",
        "compat/deepspeed/__init__.py",
        "    if size != tp_size:",
        "    if False:",
        ("tests/test_deepspeed_name.py::test_small_modules",),
    ),
    Mutant(
        "api table: an engine method zerostack lacks marked works",
        "compat/deepspeed/_api/engine.py",
        'f"{ENGINE}.set_train_batch_size": _no(',
        'f"{ENGINE}.set_train_batch_size": _works(',
        ("tests/test_api_surface.py::test_engine_methods_and_attributes_on_a_real_engine",),
    ),
    Mutant(
        "api table: an entry edited without regenerating the reference page",
        "compat/deepspeed/_api/modules.py",
        '_no("no kernel injection")',
        '_no("no kernels injected")',
        ("tests/test_api_surface.py::test_the_reference_table_is_the_generated_one",),
    ),
    Mutant(
        "empty_partition_cache releases nothing at stage 3",
        "compat/deepspeed/runtime/engine.py",
        "        if isinstance(self.zero, Pieces):\n            self.zero.release_gathered()",
        "        if isinstance(self.zero, Pieces):\n            pass",
        ("tests/test_stage3_live.py::test_gather_budget_follows_deepspeeds_keys",),
    ),
    Mutant(
        "initialize returns the native engine, without DeepSpeed's accessors",
        "compat/deepspeed/__init__.py",
        '    kwargs.setdefault("engine_type", DeepSpeedEngine)\n',
        "",
        ("tests/test_engine_surface.py::test_deepspeeds_own_accessors_live_on_its_engine_alone",),
    ),
    Mutant(
        "TRL's add_hooks puts no hook back (stage 3 trains on released parameters)",
        "compat/deepspeed/runtime/zero/parameter_offload.py",
        "        _alive(self._coordinator).hooks.attach()",
        "        pass",
        ("tests/test_trl.py::test_hooks_taken_off_and_put_back_with_trls_functions",),
    ),
    Mutant(
        "deepspeed.initialize refuses the unknown keys DeepSpeed ignores (TRL's ZeRO-3 keys)",
        "compat/deepspeed/__init__.py",
        '    kwargs.setdefault("unknown_keys", "as_deepspeed")',
        '    kwargs.setdefault("unknown_keys", "refuse")',
        (
            "tests/test_config_keys.py::"
            "test_deepspeed_initialize_warns_and_zerostack_initialize_refuses",
            "tests/test_trl.py::test_trl_logs_equal_deepspeeds[grpo_zero3]",
        ),
    ),
    Mutant(
        "the optimizer's overflow reports every step as skipped",
        "compat/deepspeed/runtime/engine.py",
        "        self.optimizer.overflow = not report.applied",
        "        self.optimizer.overflow = True",
        ("tests/test_ds_runtime_helpers.py::test_engine_accessors_answer_as_deepspeeds",),
    ),
    Mutant(
        "_consolidated_16bit_state_dict hands the weights to every rank",
        "compat/deepspeed/runtime/engine.py",
        "        out = consolidated_16bit(self.run, exclude_frozen_parameters)\n"
        "        return out if self.global_rank == 0 else None\n"
        "\n"
        "    def _zero3",
        "        out = consolidated_16bit(self.run, exclude_frozen_parameters)\n"
        "        return out\n"
        "\n"
        "    def _zero3",
        ("tests/test_ds_runtime_helpers.py::test_engine_accessors_answer_as_deepspeeds",),
    ),
    Mutant(
        "RepeatingLoader stops when the loader ends",
        "compat/deepspeed/runtime/dataloader.py",
        "            self.data_iter = iter(self.loader)\n            return next(self.data_iter)",
        "            raise",
        (
            "tests/test_ds_runtime_helpers.py::"
            "test_repeating_loader_starts_again_when_the_loader_ends",
        ),
    ),
    Mutant(
        "move_to_device leaves what the criterion accepts where it was",
        "compat/deepspeed/runtime/utils.py",
        "        item.data = item.to(device).data\n",
        "        pass\n",
        (
            "tests/test_ds_runtime_helpers.py::"
            "test_move_to_device_moves_in_place_what_the_criterion_accepts",
        ),
    ),
    Mutant(
        "step runs while the states are in host memory",
        "compat/deepspeed/runtime/engine.py",
        '        self.states.require_resident("step")\n',
        "",
        (
            "tests/test_offload_states.py::"
            "test_offloaded_states_leave_the_device_and_training_continues_bit_for_bit",
        ),
    ),
    Mutant(
        "the optimizer's cur_scale stays the initial loss scale",
        "compat/deepspeed/runtime/engine.py",
        "        self.optimizer.cur_scale = float(self.state.loss_scaler.loss_scale)",
        "        pass",
        ("tests/test_ds_runtime_helpers.py::test_the_optimizers_cur_scale_is_the_loss_scale_now",),
    ),
    Mutant(
        "the engine does not hand what it lacks to its module",
        "compat/deepspeed/runtime/engine.py",
        '            if module is None or name.startswith("__"):',
        "            if True:",
        ("tests/test_ds_runtime_helpers.py::test_what_the_engine_lacks_is_its_modules",),
    ),
    Mutant(
        "DeepSpeedConfig resolves the batch for one rank whatever the mpu says",
        "compat/deepspeed/runtime/config.py",
        "        batch = cfg.resolve_batch(dp)",
        "        batch = cfg.resolve_batch(1)",
        (
            "tests/test_ds_runtime_helpers.py::"
            "test_deepspeed_config_resolves_the_batch_as_initialize_does",
        ),
    ),
    Mutant(
        "Lightning's converter finds no model-states file at ZeRO-3",
        "compat/deepspeed/utils/zero_to_fp32.py",
        '        name = "zero_pp_rank_0_" + name',
        "        pass",
        (
            "tests/test_lightning.py::"
            "test_lightnings_converter_reads_a_deepspeed_stage_3_checkpoint_made_under_the_runner",
        ),
    ),
    Mutant(
        "DeepSpeed's optimizer.backward divides by the accumulation steps as engine.backward",
        "compat/deepspeed/runtime/engine.py",
        "me().backward(loss, retain_graph=retain_graph, scale_wrt_gas=False)",
        "me().backward(loss, retain_graph=retain_graph, scale_wrt_gas=True)",
        (
            "tests/test_engine_surface.py::"
            "test_deepspeed_optimizer_backward_throughput_timer_and_ds_tensor",
        ),
    ),
    Mutant(
        "init_inference leaves the model whole at tp 2",
        "compat/deepspeed/inference/engine.py",
        "            autotp.parallelize(self.module, self.topology)",
        "            pass",
        (
            "tests/test_init_inference.py::"
            "test_two_tp_ranks_give_the_plain_models_logits_and_tokens[llama-tp]",
        ),
    ),
    Mutant(
        "init_inference's deprecated mp_size ignored",
        "compat/deepspeed/inference/engine.py",
        '        tp["tp_size"] = out["mp_size"]  # deprecated',
        "        pass  # deprecated",
        (
            "tests/test_init_inference.py::"
            "test_two_tp_ranks_give_the_plain_models_logits_and_tokens[gpt2-mp_size]",
        ),
    ),
    Mutant(
        "init_inference keeps the module's own dtype",
        "compat/deepspeed/inference/engine.py",
        '        self.module.to(cfg["dtype"])',
        "        pass",
        ("tests/test_init_inference.py::test_one_rank_is_the_plain_model_in_the_dtype_asked",),
    ),
    Mutant(
        "GatherReplacedLayerParams gathers nothing",
        "compat/deepspeed/module_inject/layers.py",
        "whole_tp(split, topology) if topology else contextlib.nullcontext()",
        "contextlib.nullcontext()",
        ("tests/test_tp_whole.py::test_split_parameters_are_whole_inside_and_sliced_after",),
    ),
    Mutant(
        "hybrid_engine: generate gathers module by module at every token",
        "compat/deepspeed/runtime/hybrid_engine.py",
        "    module.generate = generate_gathered",
        "    pass",
        (
            "tests/test_hybrid_engine.py::"
            "test_generate_gathers_the_model_once_and_gives_the_plain_models_tokens",
        ),
    ),
    Mutant(
        "check_overflow sees this rank's gradients alone",
        "compat/deepspeed/runtime/engine.py",
        '            e.comm.all_reduce(bad, axis="world", op=torch.distributed.ReduceOp.MAX)',
        "            pass",
        ("tests/test_engine_surface.py::test_check_overflow_sees_any_ranks_non_finite_gradient",),
    ),
    Mutant(
        "dynamic batching: the lengths in metrics_path never read",
        "compat/deepspeed/runtime/data_pipeline/data_sampling/variable_batch_size_and_lr.py",
        "    if metrics_path is not None and MMapIndexedDataset.exists(prefix):",
        "    if False:",
        (
            "tests/test_variable_batch.py::"
            "test_lengths_measured_with_batch_seqlens_fn_then_read_from_the_metrics_files",
        ),
    ),
    Mutant(
        "recursive_setattr sets the name on the model, not on its parent module",
        "compat/deepspeed/utils/module_utils.py",
        "    setattr(recursive_getattr(model, parent) if parent else model, last, module)",
        "    setattr(model, last, module)",
        (
            "tests/test_ds_runtime_helpers.py::"
            "test_recursive_getattr_and_setattr_reach_a_submodule_by_its_dotted_name",
        ),
    ),
    Mutant(
        "random-LTD: the schedule not advanced at a training forward",
        "compat/deepspeed/runtime/engine.py",
        "            self.random_ltd_scheduler.update_seq(self.global_steps)",
        "            pass",
        ("tests/test_token_drop.py::test_training_equals_deepspeeds",),
    ),
    Mutant(
        "random-LTD: the wrappers left in module_state_dict's names",
        "compat/deepspeed/runtime/engine.py",
        "        return token_drop.remove_random_ltd_state_dict(sd) if self.random_ltd_enabled() "
        "else sd",
        "        return sd",
        ("tests/test_token_drop.py::test_training_equals_deepspeeds",),
    ),
]
