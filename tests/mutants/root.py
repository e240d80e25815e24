"""The mutants of the modules at the root of src/zerostack (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "a Hugging Face model's checkpointed layers keep torch's checkpoint (no CPU copies)",
        "compose.py",
        "        activation_checkpointing.adopt_model_checkpointing(model)  #",
        "        pass  #",
        (
            "tests/test_hf_long.py::"
            "test_tiled_mlp_tiled_loss_and_cpu_checkpoints_match_single_process[2-2-1]",
        ),
    ),
    Mutant(
        "cpu_checkpointing on a model that checkpoints nothing is accepted",
        "validate.py",
        "        and not model_checkpointed_layers(model)\n",
        "        and False\n",
        (
            "tests/test_hf_long.py::"
            "test_cpu_checkpointing_on_a_model_that_checkpoints_nothing_is_refused",
        ),
    ),
    Mutant(
        "the ring groups are the Ulysses neighbours (stride ring, not ulysses)",
        "topology.py",
        "ranks = [int(mesh[p, run * self.sp + g * u + j, e, t]) for g in range(self.ring)]",
        "ranks = [int(mesh[p, run * self.sp + g + j * self.ring, e, t]) for g in range(self.ring)]",
        ("tests/test_topology.py::test_ring_and_ulysses_axes_split_the_sp_ranks",),
    ),
    Mutant(
        "a rank's ring coordinate is its sp rank modulo ring",
        "topology.py",
        '            return self.rank("sp") // self.ulysses',
        '            return self.rank("sp") % self.ring',
        ("tests/test_topology.py::test_ring_and_ulysses_axes_split_the_sp_ranks",),
    ),
    Mutant(
        "ring_parallel_size that disagrees with the given topology is accepted",
        "compose.py",
        '    if ring != topo.ring and ("ring_parallel_size" in cfg.model_fields_set or ring > 1):',
        "    if False:",
        ("tests/test_ring_grid.py::test_bad_ring_grids_are_refused_naming_the_keys",),
    ),
    Mutant(
        "a refusal on one rank is not handed to the others (they wait in the engine)",
        "validate.py",
        '    refusals = [r for r in _posted(str(mine) if mine else "", grid) if r]',
        "    refusals = [str(mine)] if mine else []",
        ("tests/test_pipeline.py::test_a_refusal_on_one_stage_is_every_stages",),
    ),
    Mutant(
        "the dp_ep axis ranks this rank ep-major (its pieces in another rank's place)",
        "topology.py",
        '            return self.dp_rank * self.ep + self.rank("ep")',
        '            return self.rank("ep") * self.dp + self.dp_rank',
        (
            "tests/test_moe.py::test_expert_parallel_gpt_matches_single_process"
            "[dp2xep2-top1-drops-stage1]",
        ),
    ),
    Mutant(
        "a MoE model built under zero.Init accepted (its first forward fails)",
        "validate.py",
        "    if any(is_sharded(p) for p in params) and any(is_moe_param(p) for p in params):",
        "    if False:",
        ("tests/test_moe.py::test_a_moe_model_built_under_zero_init_is_refused",),
    ),
    Mutant(
        "hpZ beside expert parallelism accepted (its partitions were never built for it)",
        "validate.py",
        "    if topo.ep > 1 and cfg.zero_optimization.zero_hpz_partition_size > 1:",
        "    if False:",
        ("tests/test_moe.py::test_hpz_beside_expert_parallelism_is_refused",),
    ),
    Mutant(
        "with ep and Ulysses, the sp ranks of a batch read different batches",
        "topology.py",
        '        return self.dp_rank // self.sp * self.ep + self.rank("ep")',
        '        return self.dp_rank * self.ep + self.rank("ep")',
        ("tests/test_moe.py::test_expert_parallel_gpt_with_ulysses_matches_single_process[1]",),
    ),
    Mutant(
        "the runner leaves the process groups to interpreter exit",
        "as_deepspeed.py",
        "        _tear_down()\n        raise\n    _tear_down()\n",
        "        raise\n",
        (
            "tests/test_deepspeed_name.py::"
            "test_the_runner_tears_the_groups_down_when_the_script_ends_well",
        ),
    ),
    Mutant(
        "data loader draws its shuffle seed from the global RNG",
        "compose.py",
        "generator=torch.Generator().manual_seed(cfg.seed),",
        "generator=None,",
        ("tests/test_checkpoint.py::test_exact_resume_whole",),
    ),
    Mutant(
        "initialize skips the pipeline simulator's check",
        "validate.py",
        "check_schedule(pcfg.schedule, module.num_stages, gas, module.virtual_stages)",
        "pcfg.schedule",
        (
            "tests/test_pipeline_schedule.py::"
            "test_a_schedule_the_simulator_refuses_is_a_config_error_at_initialize",
        ),
    ),
    Mutant(
        "CLI drops the default micro-batch with --grad-accum",
        "cli.py",
        'elif "train_batch_size" not in cfg:',
        'elif not args.grad_accum and "train_batch_size" not in cfg:',
        ("tests/test_cli.py::test_batch_options_fill_in_the_default_micro_batch",),
    ),
    Mutant(
        "zerostack train: --zero-stage 3 trains at stage 2",
        "cli.py",
        'cfg.setdefault("zero_optimization", {})["stage"] = args.zero_stage',
        'cfg.setdefault("zero_optimization", {})["stage"] = min(args.zero_stage, 2)',
        ("tests/test_cli.py::test_every_grid_trains_and_its_loss_falls",),
    ),
    Mutant(
        "shutdown: the mesh keeps its groups past destroy_process_group",
        "topology.py",
        "        hold_groups(topo)\n",
        "",
        ("tests/test_topology.py::test_shutdown_ends_the_gloo_threads_while_the_engine_lives",),
    ),
    Mutant(
        "shutdown: torch.distributed.nn.functional's defaults keep the world group",
        "world.py",
        "    _release_default_arguments()\n    dist.destroy_process_group()",
        "    dist.destroy_process_group()",
        ("tests/test_topology.py::test_shutdown_ends_the_gloo_threads_while_the_engine_lives",),
    ),
    Mutant(
        "comms_logger block: the engine's collectives are not summarised",
        "compose.py",
        "    comms_logger.follow(comm_for(topo).log)\n",
        "",
        ("tests/test_ds_comm.py::test_comms_logger_block_summarises_the_engines_collectives",),
    ),
    Mutant(
        "log_level not applied",
        "compose.py",
        "    if cfg.log_level is not None:",
        "    if False:",
        ("tests/test_config_keys.py::test_at_initialize_warning_level_and_memory_line",),
    ),
    Mutant(
        "init_distributed: discovered ranks not applied (a world of one each)",
        "world.py",
        "            os.environ.update(found.env())",
        "            pass",
        ("tests/test_launch.py::test_open_mpi_variables_alone_form_one_world",),
    ),
    Mutant(
        "cuda: the NCCL group is not bound to LOCAL_RANK's device",
        "world.py",
        'bound = {"device_id": device}',
        "bound = {}",
        ("tests/test_cuda_path.py::test_nccl_init_binds_the_local_rank_device",),
    ),
    Mutant(
        "cuda: a group made elsewhere binds a device that is not visible",
        "world.py",
        "    index = local_device_index(int(local), torch.cuda.device_count())",
        "    index = int(local)",
        ("tests/test_cuda_path.py::test_a_group_made_elsewhere_gets_the_local_rank_device",),
    ),
    Mutant(
        "cuda: a user's CPUAdam is bound to device masters",
        "compose.py",
        "if isinstance(optimizer, CPUAdam) and on_device:",
        "if False:",
        (
            "tests/test_cuda_path.py::"
            "test_a_users_cpu_adam_without_offload_is_refused_on_the_device",
        ),
    ),
    Mutant(
        "cuda: an offloaded optimizer keeps torchrun's one thread",
        "compose.py",
        "share = max(1, (os.cpu_count() or 1) // local)",
        "share = 1",
        ("tests/test_cuda_path.py::test_an_offloaded_optimizer_gets_the_cores_on_a_gpu_node",),
    ),
    Mutant(
        "safe_update_full_grad_vectorized: the updated gradient not written back",
        "utils.py",
        "            safe_set_full_grad(p, update_func(grad, p))",
        "            update_func(grad, p)",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s0]",),
    ),
    Mutant(
        "api table: a name it says works renamed in zerostack",
        "utils.py",
        "def safe_get_local_grad(param",
        "def safe_get_local_gradient(param",
        (
            "tests/test_api_surface.py::"
            "test_names_that_work_or_differ_resolve_and_unsupported_ones_do_not",
        ),
    ),
    Mutant(
        "api table: zerostack grows a name the table says is not supported",
        "utils.py",
        "from .engine.full_params import engine_of\n",
        "from .engine.full_params import engine_of\n\nOnDevice = None\n",
        (
            "tests/test_api_surface.py::"
            "test_names_that_work_or_differ_resolve_and_unsupported_ones_do_not",
        ),
    ),
    Mutant(
        "a rank's sp coordinate is its data replica",
        "topology.py",
        'return self.mesh.get_local_rank("dp") % self.sp',
        'return self.mesh.get_local_rank("dp") // self.sp',
        ("tests/test_ulysses.py::test_gpt_matches_single_process[4-2-1-3-False]",),
    ),
    Mutant(
        "the sp ranks of a batch read different samples",
        "compose.py",
        "        num_replicas=topo.data_parallel_size,",
        "        num_replicas=topo.dp,",
        (
            "tests/test_ulysses.py::"
            "test_the_loader_hands_each_sp_rank_its_shard_of_the_same_samples",
        ),
    ),
    Mutant(
        "the engine's batch counts sp ranks as replicas",
        "validate.py",
        "cfg.resolve_batch(topo.data_parallel_size)",
        "cfg.resolve_batch(topo.dp)",
        (
            "tests/test_ulysses.py::"
            "test_the_loader_hands_each_sp_rank_its_shard_of_the_same_samples",
        ),
    ),
    Mutant(
        "sequence_parallel_size does not wire a plain model",
        "compose.py",
        "wire_ulysses = topo.sp > 1 and wires_sequence(model, topo, built)",
        "wire_ulysses = topo.sp > 1 and wires_sequence(model, topo, built) and False",
        ("tests/test_ulysses.py::test_gpt_matches_single_process[4-4-1-2-True]",),
    ),
    Mutant(
        "the ep ranks of a dp rank read the same batch",
        "topology.py",
        'return self.dp_rank // self.sp * self.ep + self.rank("ep")',
        "return self.dp_rank // self.sp * self.ep",
        (
            "tests/test_moe.py::test_expert_parallel_gpt_matches_single_process"
            "[ep2-top1-drops-stage0]",
        ),
    ),
    Mutant(
        "a forward-only engine still steps every parameter (gradients kept)",
        "compose.py",
        "    groups = [] if forward_only else _param_groups(model, optimizer, model_parameters)",
        "    groups = _param_groups(model, optimizer, model_parameters)",
        ("tests/test_initialize.py::test_no_optimizer_is_a_forward_only_engine",),
    ),
    Mutant(
        "the device is chosen by the backend's name (a gloo + NCCL group trains on the CPU)",
        "world.py",
        '    return "cuda" if devices.get("cuda", "gloo") != "gloo" else "cpu"',
        '    return "cuda" if backend == "nccl" else "cpu"',
        (
            "tests/test_topology.py::"
            "test_the_device_follows_what_the_group_does_on_cuda_not_its_name",
        ),
    ),
    Mutant(
        "the grid's device is read from get_backend() again",
        "topology.py",
        "        device_type = world_device_type()",
        '        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"',
        (
            "tests/test_topology.py::"
            "test_a_pre_initialised_gloo_and_nccl_group_builds_the_grid_on_the_gpu",
        ),
    ),
    Mutant(
        "LOCAL_RANK beyond the visible GPUs is used as the device index",
        "world.py",
        "    index = 0 if visible == 1 else local % visible",
        "    index = local",
        ("tests/test_topology.py::test_a_local_rank_beyond_the_visible_gpus_takes_one_it_sees",),
    ),
    Mutant(
        "NCCL's timeout is 30 minutes, not the watchdog's bound and a minute",
        "world.py",
        "    return timedelta(seconds=bound + NCCL_MARGIN)",
        "    return DEFAULT_TIMEOUT",
        (
            "tests/test_cuda_path.py::"
            "test_nccl_times_out_a_minute_after_the_watchdog_with_its_flight_recorder_on",
            "tests/test_cuda_path.py::test_initialize_gives_nccl_the_configs_watchdog_bound",
        ),
    ),
    Mutant(
        "NCCL's flight recorder is left off (a timeout names no collective)",
        "world.py",
        "            os.environ.setdefault(key, value)",
        "            pass",
        (
            "tests/test_cuda_path.py::"
            "test_nccl_times_out_a_minute_after_the_watchdog_with_its_flight_recorder_on",
        ),
    ),
    Mutant(
        "initialize gives NCCL the default bound, not the config's watchdog.timeout",
        "compose.py",
        "        init_distributed(timeout=default_timeout(watchdog=cfg.watchdog))",
        "        init_distributed()",
        ("tests/test_cuda_path.py::test_initialize_gives_nccl_the_configs_watchdog_bound",),
    ),
    Mutant(
        "zerostack.initialize ignores unknown keys as deepspeed.initialize does",
        "__init__.py",
        "from .compat.deepspeed import native_initialize as initialize",
        "from .compat.deepspeed import initialize",
        (
            "tests/test_config_keys.py::"
            "test_deepspeed_initialize_warns_and_zerostack_initialize_refuses",
        ),
    ),
    Mutant(
        "initialize ignores zero_optimization.leaf_module",
        "compose.py",
        "    apply_leaf_config(model, cfg.zero_optimization.leaf_module)",
        "    pass",
        (
            "tests/test_leaf_modules.py::"
            "test_a_leaf_moe_block_is_one_gather_and_trains_as_one_process[config]",
        ),
    ),
    Mutant(
        "initialize(args=...) ignores the deprecated --deepscale_config",
        "compose.py",
        ' or getattr(args, "deepscale_config", None)',
        "",
        (
            "tests/test_ds_runtime_helpers.py::"
            "test_add_config_arguments_and_initialize_reading_them",
        ),
    ),
    Mutant(
        "partition_config: the specs not handed to AutoTP (the table is used instead)",
        "compose.py",
        "                autotp_parallelize(model, topo, specs)",
        "                autotp_parallelize(model, topo)",
        ("tests/test_autotp_specs.py::test_custom_specs_train_as_one_process",),
    ),
    Mutant(
        "torch_autocast: fp32 weights at stages 1-3 not refused (one reduce dtype per bucket)",
        "validate.py",
        "    elif not cfg.bf16.enabled and stage > 0:",
        "    elif False:",
        ("tests/test_torch_autocast.py::test_combinations_not_served_are_refused",),
    ),
    Mutant(
        "torch_autocast: communication_data_type beside it not refused",
        "validate.py",
        "    elif cfg.communication_data_type is not None:",
        "    elif False:",
        ("tests/test_torch_autocast.py::test_combinations_not_served_are_refused",),
    ),
    Mutant(
        "Muon with offload_param on NVMe reaches the engine (not refused)",
        "validate.py",
        '        why = "offload_param on NVMe: pieces read from files are not put "\n',
        "        why = None\n",
        ("tests/test_muon.py::test_layouts_not_served_yet_are_refused_at_initialize",),
    ),
    Mutant(
        "bf16_optimizer_states offloaded: the CPU Adam's moments kept in fp32",
        "compose.py",
        "    fp32_states = not cfg.bf16.bf16_optimizer_states",
        "    fp32_states = True",
        (
            "tests/test_sixteen_bit_masters.py::test_losses_are_deepspeeds[bf16_states_zero2_offload]",
        ),
    ),
    Mutant(
        "16-bit masters at ZeRO stage 0 reach the engine (not refused)",
        "validate.py",
        '    elif stage not in (1, 2, 3):\n        why = f"{key} at zero_optimization.stage',
        '    elif False:\n        why = f"{key} at zero_optimization.stage',
        (
            "tests/test_sixteen_bit_masters.py::test_what_deepspeed_refuses_is_refused_naming_the_keys",
        ),
    ),
    Mutant(
        "zerostack train --bf16 replaces the config file's bf16 block",
        "cli.py",
        '        cfg.setdefault("bf16", {})["enabled"] = True',
        '        cfg["bf16"] = {"enabled": True}',
        ("tests/test_cli.py::test_bf16_on_the_command_line_keeps_the_files_other_bf16_keys",),
    ),
    Mutant(
        "the meta device left on after a dry run",
        "topology.py",
        "    finally:\n        _META[0] = False",
        "    finally:\n        pass",
        ("tests/test_dryrun.py::test_the_meta_device_is_the_dry_runs_alone",),
    ),
    Mutant(
        "dryrun: the flash stand-in keeps no log-sum-exp",
        "dryrun.py",
        "        ctx.save_for_backward(q, k, v, out, lse)",
        "        ctx.save_for_backward(q, k, v, out)",
        ("tests/test_dryrun.py::test_the_activations_the_forward_keeps_are_the_estimates",),
    ),
    Mutant(
        "dryrun: attention's output laid out (batch, heads, sequence), so GPT copies it",
        "dryrun.py",
        "        out = q.new_empty(b, s, heads, v.shape[-1]).transpose(1, 2)",
        "        out = q.new_empty(b, heads, s, v.shape[-1])",
        ("tests/test_dryrun.py::test_the_activations_the_forward_keeps_are_the_estimates",),
    ),
    Mutant(
        "dryrun: a weight saved as a (transposed) view counted as an activation",
        "dryrun.py",
        "        weight = isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)",
        "        weight = isinstance(t, nn.Parameter)",
        ("tests/test_dryrun.py::test_the_activations_the_forward_keeps_are_the_estimates",),
    ),
    Mutant(
        "dryrun: dropout as this machine's torch keeps it on meta (a noise tensor), not a GPU",
        "dryrun.py",
        "        if input.is_meta and training and 0 < p < 1 and not inplace:",
        "        if False:",
        ("tests/test_dryrun.py::test_the_activations_the_forward_keeps_are_the_estimates",),
    ),
]
