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
        "            and not model_checkpointed_layers(model)):  # fmt: skip",
        "            and False):  # fmt: skip",
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
        "the norm skips the shared pieces off ep rank 0 (at stages 1-3 each rank holds its own)",
        "replicas.py",
        "            held = held | (self._ep_replicas - cut_over_ep)",
        "            held = held | self._ep_replicas",
        (
            "tests/test_moe.py::test_expert_parallel_gpt_matches_single_process"
            "[dp2xep2-top1-drops-stage1]",
        ),
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
        "the watchdog's stop leaves its wake sockets open (two descriptors an engine)",
        "watchdog.py",
        "            self._selector.close()\n            self._wake_r.close()\n",
        "            self._selector.close()\n",
        (
            "tests/test_watchdog.py::"
            "test_sigusr1_is_heard_above_descriptor_1023_and_stop_closes_what_it_opened",
        ),
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
        "the Trainer's loss divided twice at accumulation 2 (scale_wrt_gas ignored)",
        "engine.py",
        "gas = self.window.gas if scale_wrt_gas else 1",
        "gas = self.window.gas",
        ("tests/test_hf_trainer.py::test_trainer_losses_and_reload_equal_deepspeeds[zero3_gas2]",),
    ),
    Mutant(
        "engine.config's dict leaves out the resolved batch sizes",
        "config_view.py",
        "            data.update(zip(_BATCH_KEYS, batch, strict=True))",
        "            pass",
        (
            "tests/test_engine_surface.py::"
            "test_engine_config_reads_as_deepspeeds_dict_and_as_the_typed_config",
        ),
    ),
    Mutant(
        "engine.config hands out its own nested dicts (a write sticks, silently)",
        "config_view.py",
        "return copy.deepcopy(self._dict[key])",
        "return self._dict[key]",
        (
            "tests/test_engine_surface.py::"
            "test_engine_config_reads_as_deepspeeds_dict_and_as_the_typed_config",
        ),
    ),
    Mutant(
        "loss not divided by gradient_accumulation_steps",
        "engine.py",
        "gas = self.window.gas if scale_wrt_gas else 1",
        "gas = 1",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[dp2]",),
    ),
    Mutant(
        "backward's scale_wrt_gas=False ignored (the Trainer's loss divided twice)",
        "engine.py",
        "gas = self.window.gas if scale_wrt_gas else 1",
        "gas = self.window.gas",
        (
            "tests/test_engine_surface.py::"
            "test_backward_scale_wrt_gas_false_leaves_the_division_to_the_caller",
        ),
    ),
    Mutant(
        "tp replica counted on every tp rank in the gradient norm",
        "replicas.py",
        'held = self._tp_replicas if topo.tp > 1 and topo.rank("tp") != 0 else set()',
        "held = set()",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[tp2]",),
    ),
    Mutant(
        "NaN guard removed (bf16 and fp32 apply non-finite steps)",
        "update.py",
        "overflow = not math.isfinite(value)",
        'overflow = self.precision.name == "fp16" and not math.isfinite(value)',
        ("tests/test_nonfinite.py",),
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
        "watchdog: a silent peer is given ten times the bound",
        "heartbeats.py",
        "if quiet_for > self.timeout]",
        "if quiet_for > 10 * self.timeout]",
        (
            "tests/test_watchdog.py::test_a_silent_peer_is_named_with_its_last_position",
            "tests/test_watchdog.py::test_a_frozen_rank_ends_the_job_within_the_bound",
        ),
    ),
    Mutant(
        "watchdog: a peer that missed its beats does not hold back the rival verdict",
        "heartbeats.py",
        "now - pending.started > self.timeout and not quiet:",
        "now - pending.started > self.timeout:",
        (
            "tests/test_watchdog.py::"
            "test_a_peer_that_froze_as_this_rank_began_waiting_is_named_stopped",
        ),
    ),
    Mutant(
        "watchdog: its exit skips the removal of the rank's swap files",
        "watchdog.py",
        "exit: Callable[[int], None] = hard_exit,",
        "exit: Callable[[int], None] = os._exit,",
        ("tests/test_disk_faults.py::test_the_watchdogs_exit_removes_the_ranks_swap_files",),
    ),
    Mutant(
        "watchdog: an error raised as the job ends prints its traceback as if it were the cause",
        "watchdog.py",
        "        if self._ending.is_set():\n            # raised",
        "        if False:\n            # raised",
        (
            "tests/test_watchdog.py::"
            "test_an_error_raised_as_the_job_ends_is_not_printed_as_its_cause",
        ),
    ),
    Mutant(
        "watchdog: a posted verdict is not read by the other ranks",
        "heartbeats.py",
        "        if self.store.check([key]):\n            return self.store.get(key).decode()\n",
        "",
        (
            "tests/test_watchdog.py::test_a_posted_verdict_ends_every_rank",
            "tests/test_watchdog.py::test_a_frozen_rank_ends_the_job_within_the_bound",
        ),
    ),
    Mutant(
        "watchdog: stop waits out the interval",
        "watchdog.py",
        '            self._wake_w.send(b"\\0")',
        "            pass",
        ("tests/test_watchdog.py::test_stop_returns_at_once",),
    ),
    Mutant(
        "watchdog: an exception is not posted as the verdict",
        "watchdog.py",
        "        sys.excepthook = self._excepthook\n",
        "",
        ("tests/test_watchdog.py::test_a_rank_that_raises_is_named_by_every_rank",),
    ),
    Mutant(
        "watchdog: the verdict printed into whatever sys.stderr is at the time",
        "watchdog.py",
        "        print(text, file=self._out, flush=True)",
        "        print(text, file=sys.stderr, flush=True)",
        (
            "tests/test_watchdog.py::"
            "test_the_verdict_and_the_traceback_reach_the_log_when_a_rank_raises",
        ),
    ),
    Mutant(
        "watchdog: the rank ends while its traceback is being printed",
        "watchdog.py",
        "            if self._tracing.is_set():",
        "            if False:",
        (
            "tests/test_watchdog.py::"
            "test_the_verdict_and_the_traceback_reach_the_log_when_a_rank_raises",
        ),
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
        "safe_get_full_grad: the summed gradient not averaged over dp",
        "full_params.py",
        "grad = zero.window_grad(p).mul(post)",
        "grad = zero.window_grad(p)",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s1]",),
    ),
    Mutant(
        "safe_set_full_fp32_param: the compute-dtype parameter keeps its old value",
        "full_params.py",
        "            zero.write_param(p, flat)",
        "            pass",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s3_cpu]",),
    ),
    Mutant(
        "communication_data_type ignored: gradients reduced in the compute dtype",
        "precision.py",
        "return self.comm_dtype or self.compute_dtype",
        "return self.compute_dtype",
        ("tests/test_comm_dtype.py::test_fp32_reduction_sends_fp32_and_sums_exactly",),
    ),
    Mutant(
        "comms_logger block: the engine's collectives are not summarised",
        "compose.py",
        "    comms_logger.follow(comm_for(topo).log)\n",
        "",
        ("tests/test_ds_comm.py::test_comms_logger_block_summarises_the_engines_collectives",),
    ),
    Mutant(
        "fp16.auto_cast ignored: no input is cast",
        "runner.py",
        "    if not auto_cast:\n        return inputs",
        "    if True:\n        return inputs",
        ("tests/test_input_cast.py::test_inputs_are_cast_as_deepspeed_casts_them",),
    ),
    Mutant(
        "auto_cast casts keyword arguments too",
        "engine.py",
        "out = self.module(*cast_inputs(args, self.config.fp16.auto_cast), **kwargs)",
        "out = self.module(*cast_inputs(args, self.config.fp16.auto_cast), **cast_inputs(kwargs, "
        "self.config.fp16.auto_cast))",
        ("tests/test_input_cast.py::test_inputs_are_cast_as_deepspeed_casts_them",),
    ),
    Mutant(
        "no-effect keys: the warning on every rank",
        "config_keys.py",
        "if settings and rank == 0:",
        "if settings:",
        ("tests/test_config_keys.py::test_at_initialize_warning_level_and_memory_line",),
    ),
    Mutant(
        "no-effect keys: a nested key named at its default",
        "config_keys.py",
        "if found is not None and found[0] != found[1]:",
        "if found is not None:",
        ("tests/test_config_keys.py::test_at_initialize_warning_level_and_memory_line",),
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
        "cuda: wall_clock_breakdown times the launch, not the work",
        "engine.py",
        "self.clock = device_clock(device, config.wall_clock_breakdown)",
        "self.clock = device_clock(device, False)",
        ("tests/test_cuda_path.py::test_gpu_seconds_wait_for_the_device_only_when_asked_for",),
    ),
    Mutant(
        "cuda: the comms logger times the launch, not the collective",
        "engine.py",
        "device, config.wall_clock_breakdown or config.comms_logger.enabled",
        "device, config.wall_clock_breakdown",
        ("tests/test_cuda_path.py::test_gpu_seconds_wait_for_the_device_only_when_asked_for",),
    ),
    Mutant(
        "cuda: an offloaded optimizer keeps torchrun's one thread",
        "compose.py",
        "share = max(1, (os.cpu_count() or 1) // local)",
        "share = 1",
        ("tests/test_cuda_path.py::test_an_offloaded_optimizer_gets_the_cores_on_a_gpu_node",),
    ),
    Mutant(
        "automatic save before the micro-step is counted",
        "engine.py",
        "        self.micro_steps += 1  # before the count: an automatic save keeps whole "
        "windows\n"
        "        if boundary:\n"
        "            self.after_step.count()",
        "        if boundary:\n            self.after_step.count()\n        self.micro_steps += 1",
        (
            "tests/test_auto_resume.py::test_a_killed_rank_restarts_and_resumes_exactly"
            "[stage2-forward]",
        ),
    ),
    Mutant(
        "safe_set_full_grad: the mean stored as is, not summed over dp and scaled",
        "full_params.py",
        "return mean / self.engine.zero.grad_post(self.engine.loss_scaler.loss_scale)",
        "return mean",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s2]",),
    ),
    Mutant(
        "safe_set_local_fp32_param: the other ranks' pieces not gathered",
        "full_params.py",
        "flat = gather_full([st.like(piece)], self.engine.comm)[0]",
        "flat = piece.repeat(st.world)[: st.numel]",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s3]",),
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
        "from .full_params import engine_of\n",
        "from .full_params import engine_of\n\nOnDevice = None\n",
        (
            "tests/test_api_surface.py::"
            "test_names_that_work_or_differ_resolve_and_unsupported_ones_do_not",
        ),
    ),
    Mutant(
        "the watchdog leaves a stopped peer on its host to the launcher",
        "watchdog.py",
        "            self._end_stopped_peers()\n",
        "",
        (
            "tests/test_watchdog.py::test_a_frozen_rank_ends_the_job_within_the_bound"
            "[step-2-all_reduce]",
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
        "the norm counts the shared parameters on every ep rank",
        "replicas.py",
        "            held = held | (self._ep_replicas - cut_over_ep)",
        "            held = held",
        (
            "tests/test_moe.py::test_expert_parallel_gpt_matches_single_process"
            "[ep2-top1-drops-stage0]",
        ),
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
        "expert gradients reduced over all data-parallel ranks, like the shared ones",
        "replicas.py",
        "            {p for p in module.parameters() if not is_moe_param(p)} if topology.ep > 1",
        "            set(module.parameters()) if topology.ep > 1",
        (
            "tests/test_moe.py::test_expert_parallel_gpt_matches_single_process"
            "[ep2-top1-drops-stage0]",
        ),
    ),
    Mutant(
        "found_inf never set: a non-finite step updates the weights on the device",
        "update.py",
        "opt.found_inf = torch.isfinite(norm).logical_not().to(torch.float32)",
        "opt.found_inf = torch.zeros((), device=norm.device)",
        ("tests/test_nonfinite.py",),
    ),
    Mutant(
        "the host reads the norm before the step is queued (the GPU idles meanwhile)",
        "update.py",
        "        self._norm_reader.start(norm)\n",
        "        self._norm_reader.start(norm)\n        self._norm_reader.value()\n",
        ("tests/test_cuda_path.py::test_a_step_on_the_device_waits_only_for_its_norm",),
    ),
    Mutant(
        "the norm reaches the host through a blocking copy (drains the stream)",
        "clock.py",
        "self.host.copy_(t.detach(), non_blocking=self.event is not None)",
        "self.host.copy_(t.detach())",
        ("tests/test_cuda_path.py::test_a_step_on_the_device_waits_only_for_its_norm",),
    ),
    Mutant(
        "a fused optimizer still waits for the norm before its step",
        "update.py",
        "self._skips_on_device = fused and self._masters_on_device",
        "self._skips_on_device = False",
        ("tests/test_cuda_path.py::test_a_step_on_the_device_waits_only_for_its_norm",),
    ),
    Mutant(
        "the clipping factor is not capped at 1 (a small norm scales gradients up)",
        "update.py",
        "return (clip / (norm + 1e-6)).clamp(max=1.0) * post",
        "return (clip / (norm + 1e-6)) * post",
        ("tests/test_data_parallel.py::test_clipping_with_sgd",),
    ),
    Mutant(
        "the clipping factor leaves out the mean over dp",
        "update.py",
        "return (clip / (norm + 1e-6)).clamp(max=1.0) * post",
        "return (clip / (norm + 1e-6)).clamp(max=1.0)",
        ("tests/test_data_parallel.py::test_clipping_with_sgd",),
    ),
    Mutant(
        "the norm's host copy is read before its event (a value the GPU may not have written)",
        "clock.py",
        "            self.event.synchronize()\n",
        "            pass\n",
        ("tests/test_cuda_path.py::test_a_step_on_the_device_waits_only_for_its_norm",),
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
        "an offloaded norm goes up to the device from pageable memory",
        "update.py",
        "            sq = self._sq_host.copy_(sq).to(run.device, non_blocking=True)",
        "            sq = sq.to(run.device, non_blocking=True)",
        (
            "tests/test_cuda_path.py::"
            "test_offloading_queues_its_uploads_and_waits_only_for_the_gradients",
        ),
    ),
    Mutant(
        "pinning is never asked for, whatever the flag says",
        "pinned.py",
        '    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin and can_pin())',
        '    return torch.empty(shape, dtype=dtype, device="cpu")',
        (
            "tests/test_cuda_path.py::"
            "test_offloading_queues_its_uploads_and_waits_only_for_the_gradients",
        ),
    ),
    Mutant(
        "pin_memory=false on a GPU is not warned about",
        "config_keys.py",
        '        if block is not None and block.device != "none" and not block.pin_memory:',
        "        if False:",
        ("tests/test_cuda_path.py::test_pageable_offload_stops_the_host_and_is_warned_about",),
    ),
    Mutant(
        "the pinned bytes the host allocator holds are not reported",
        "footprint.py",
        '            out["pinned"] = pinned',
        "            pass",
        (
            "tests/test_cuda_path.py::"
            "test_the_cuda_allocator_figures_are_reported_beside_the_census",
        ),
    ),
    Mutant(
        "reading a gradient unscales it in place (the shard itself at dp 1)",
        "full_params.py",
        "        grad = zero.window_grad(p).mul(post)  # not in place: it may be the shard itself",
        "        grad = zero.window_grad(p).mul_(post)  # not in place: it may be the shard itself",
        ("tests/test_engine_surface.py::test_reading_a_gradient_leaves_it_as_it_was",),
    ),
    Mutant(
        "safe_get_full_fp32_param at ep > 1: a shared parameter's pieces summed over dp only",
        "full_params.py",
        "        axis = zero.state_axis(p)",
        '        axis = "dp" if zero.grads_sharded else None',
        (
            "tests/test_moe.py::"
            "test_shared_gradients_are_reduced_over_dp_and_ep_at_once_in_buckets[1]",
        ),
    ),
    Mutant(
        "a user's step callback that wants the loss gets none",
        "after_step.py",
        'self.losses.collect |= bool(getattr(callback, "wants_loss", False))',
        "pass",
        ("tests/test_engine_surface.py::test_a_step_callback_gets_each_steps_report",),
    ),
    Mutant(
        "the step report calls a skipped step applied",
        "after_step.py",
        "applied=self.update.applied,",
        "applied=True,",
        ("tests/test_engine_surface.py::test_a_step_callback_gets_each_steps_report",),
    ),
    Mutant(
        "a pipeline engine runs a micro-batch's forward",
        "engine.py",
        "        self._refuse_under_a_pipeline()\n        t0 = self.clock.now()\n        with",
        "        t0 = self.clock.now()\n        with",
        ("tests/test_pipeline.py::test_pipeline_engine_errors_and_eval",),
    ),
    Mutant(
        "tied copies counted on every stage in the gradient norm",
        "engine.py",
        "return self.replicas.elsewhere(self.zero.cut_over_ep) | self.runner.replicated()",
        "return self.replicas.elsewhere(self.zero.cut_over_ep)",
        ("tests/test_pipeline.py::test_gpt_pipeline_matches_single_process",),
    ),
    Mutant(
        "the optimizer's step counters are counted as its state",
        "footprint.py",
        "                if torch.is_tensor(t) and t.dim() > 0:",
        "                if torch.is_tensor(t):",
        ("tests/test_cuda_path.py::test_device_and_host_bytes_are_reported_apart[1-False]",),
    ),
    Mutant(
        "a list of different layers is taken for blocks",
        "compiling.py",
        "if count[type(c)] >= 2 and any(",
        "if count[type(c)] >= 1 and any(",
        ("tests/test_compile.py::test_blocks_are_a_lists_children_of_one_class",),
    ),
    Mutant(
        "engine.compile compiles nothing",
        "compiling.py",
        "        block.compile(backend=counted, **kwargs)",
        "        pass",
        ("tests/test_compile.py::test_compiled_blocks_train_as_eager_bit_for_bit[0-fp32]",),
    ),
    Mutant(
        "the compile report counts no graph",
        "compiling.py",
        "        report.graphs += 1",
        "        pass",
        ("tests/test_compile.py::test_compiled_blocks_train_as_eager_bit_for_bit[0-fp32]",),
    ),
    Mutant(
        "engine.compile compiles a compiled engine again",
        "compiling.py",
        "    if engine.compile_report is not None:",
        "    if False:",
        ("tests/test_compile.py::test_what_compile_refuses_is_named",),
    ),
    Mutant(
        "the unknown keys left out are not named",
        "config_keys.py",
        "    if cfg.ignored_keys and rank == 0:",
        "    if False:",
        (
            "tests/test_config_keys.py::"
            "test_deepspeed_initialize_warns_and_zerostack_initialize_refuses",
        ),
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
        "the loss scale grown after each window counting the first clean step (DeepSpeed 0.18's)",
        "precision.py",
        "            if stable > 0 and stable % self.scale_window == 0:",
        "            if (stable + 1) % self.scale_window == 0:",
        ("tests/test_precision.py::test_scaler_hysteresis_halving_floor_and_growth",),
    ),
    Mutant(
        "an overflow at the minimum loss scale let through",
        "precision.py",
        "                if self.cur_scale == self.min_scale:",
        "                if False:",
        ("tests/test_precision.py::test_scaler_overflow_at_the_floor_ends_the_run",),
    ),
    Mutant(
        "partition_config: the specs not handed to AutoTP (the table is used instead)",
        "compose.py",
        "                autotp_parallelize(model, topo, specs)",
        "                autotp_parallelize(model, topo)",
        ("tests/test_autotp_specs.py::test_custom_specs_train_as_one_process",),
    ),
    Mutant(
        "torch_autocast: forward never under autocast",
        "precision.py",
        "    if not cfg.torch_autocast.enabled:\n        return contextlib.nullcontext()",
        "    if True:\n        return contextlib.nullcontext()",
        ("tests/test_torch_autocast.py::test_losses_equal_deepspeeds",),
    ),
    Mutant(
        "torch_autocast: the configured dtype ignored (fp16)",
        "precision.py",
        "    return DTYPES[block.dtype] if block.dtype else",
        "    return torch.float16 if block.dtype else",
        ("tests/test_torch_autocast.py::test_losses_equal_deepspeeds",),
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
]
