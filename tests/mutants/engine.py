"""The mutants of src/zerostack/engine/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "the norm skips the shared pieces off ep rank 0 (at stages 1-3 each rank holds its own)",
        "engine/replicas.py",
        "            held = held | (self._ep_replicas - cut_over_ep)",
        "            held = held | self._ep_replicas",
        (
            "tests/test_moe.py::test_expert_parallel_gpt_matches_single_process"
            "[dp2xep2-top1-drops-stage1]",
        ),
    ),
    Mutant(
        "the Trainer's loss divided twice at accumulation 2 (scale_wrt_gas ignored)",
        "engine/__init__.py",
        "gas = self.window.gas if scale_wrt_gas else 1",
        "gas = self.window.gas",
        ("tests/test_hf_trainer.py::test_trainer_losses_and_reload_equal_deepspeeds[zero3_gas2]",),
    ),
    Mutant(
        "loss not divided by gradient_accumulation_steps",
        "engine/__init__.py",
        "gas = self.window.gas if scale_wrt_gas else 1",
        "gas = 1",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[dp2]",),
    ),
    Mutant(
        "backward's scale_wrt_gas=False ignored (the Trainer's loss divided twice)",
        "engine/__init__.py",
        "gas = self.window.gas if scale_wrt_gas else 1",
        "gas = self.window.gas",
        (
            "tests/test_engine_surface.py::"
            "test_backward_scale_wrt_gas_false_leaves_the_division_to_the_caller",
        ),
    ),
    Mutant(
        "tp replica counted on every tp rank in the gradient norm",
        "engine/replicas.py",
        'held = self._tp_replicas if topo.tp > 1 and topo.rank("tp") != 0 else set()',
        "held = set()",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[tp2]",),
    ),
    Mutant(
        "NaN guard removed (bf16 and fp32 apply non-finite steps)",
        "engine/update.py",
        "overflow = not math.isfinite(value)",
        'overflow = self.precision.name == "fp16" and not math.isfinite(value)',
        ("tests/test_nonfinite.py",),
    ),
    Mutant(
        "loss scaler not restored on load",
        "engine/train_state.py",
        'self.loss_scaler.load_state_dict(state["loss_scaler"])',
        "pass",
        ("tests/test_checkpoint.py::test_exact_resume_whole",),
    ),
    Mutant(
        "sampler position not restored on load",
        "engine/train_state.py",
        'sampler.load_state_dict(state["data_sampler"])',
        "pass",
        ("tests/test_checkpoint.py::test_exact_resume_whole",),
    ),
    Mutant(
        "pipeline data iterator not reset on load",
        "engine/train_state.py",
        "            self.data_iter = None\n",
        "",
        ("tests/test_checkpoint.py::test_exact_resume_whole",),
    ),
    Mutant(
        "safe_get_full_grad: the summed gradient not averaged over dp",
        "engine/full_params.py",
        "grad = zero.window_grad(p).mul(post)",
        "grad = zero.window_grad(p)",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s1]",),
    ),
    Mutant(
        "safe_set_full_fp32_param: the compute-dtype parameter keeps its old value",
        "engine/full_params.py",
        "            zero.write_param(p, flat)",
        "            pass",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s3_cpu]",),
    ),
    Mutant(
        "fp16.auto_cast ignored: no input is cast",
        "engine/micro_batches.py",
        "    if not auto_cast:\n        return inputs",
        "    if True:\n        return inputs",
        ("tests/test_input_cast.py::test_inputs_are_cast_as_deepspeed_casts_them",),
    ),
    Mutant(
        "auto_cast casts keyword arguments too",
        "engine/__init__.py",
        "out = self.module(*cast_inputs(args, self.config.fp16.auto_cast), **kwargs)",
        "out = self.module(*cast_inputs(args, self.config.fp16.auto_cast), **cast_inputs(kwargs, "
        "self.config.fp16.auto_cast))",
        ("tests/test_input_cast.py::test_inputs_are_cast_as_deepspeed_casts_them",),
    ),
    Mutant(
        "cuda: wall_clock_breakdown times the launch, not the work",
        "engine/__init__.py",
        "self.clock = device_clock(device, config.wall_clock_breakdown)",
        "self.clock = device_clock(device, False)",
        ("tests/test_cuda_path.py::test_gpu_seconds_wait_for_the_device_only_when_asked_for",),
    ),
    Mutant(
        "cuda: the comms logger times the launch, not the collective",
        "engine/__init__.py",
        "device, config.wall_clock_breakdown or config.comms_logger.enabled",
        "device, config.wall_clock_breakdown",
        ("tests/test_cuda_path.py::test_gpu_seconds_wait_for_the_device_only_when_asked_for",),
    ),
    Mutant(
        "automatic save before the micro-step is counted",
        "engine/__init__.py",
        "        self.micro_steps += 1  # before the count: an automatic save keeps whole "
        "windows\n"
        "        if boundary:\n"
        "            self.after_step.count(self.outcome)",
        "        if boundary:\n"
        "            self.after_step.count(self.outcome)\n"
        "        self.micro_steps += 1",
        (
            "tests/test_auto_resume.py::test_a_killed_rank_restarts_and_resumes_exactly"
            "[stage2-forward]",
        ),
    ),
    Mutant(
        "safe_set_full_grad: the mean stored as is, not summed over dp and scaled",
        "engine/full_params.py",
        "return mean / self.engine.zero.grad_post(self.engine.loss_scaler.loss_scale)",
        "return mean",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s2]",),
    ),
    Mutant(
        "safe_set_local_fp32_param: the other ranks' pieces not gathered",
        "engine/full_params.py",
        "flat = gather_full([st.like(piece)], self.engine.comm)[0]",
        "flat = piece.repeat(st.world)[: st.numel]",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s3]",),
    ),
    Mutant(
        "the norm counts the shared parameters on every ep rank",
        "engine/replicas.py",
        "            held = held | (self._ep_replicas - cut_over_ep)",
        "            held = held",
        (
            "tests/test_moe.py::test_expert_parallel_gpt_matches_single_process"
            "[ep2-top1-drops-stage0]",
        ),
    ),
    Mutant(
        "expert gradients reduced over all data-parallel ranks, like the shared ones",
        "engine/replicas.py",
        "            {p for p in module.parameters() if not is_moe_param(p)} if topology.ep > 1",
        "            set(module.parameters()) if topology.ep > 1",
        (
            "tests/test_moe.py::test_expert_parallel_gpt_matches_single_process"
            "[ep2-top1-drops-stage0]",
        ),
    ),
    Mutant(
        "found_inf never set: a non-finite step updates the weights on the device",
        "engine/update.py",
        "opt.found_inf = torch.isfinite(norm).logical_not().to(torch.float32)",
        "opt.found_inf = torch.zeros((), device=norm.device)",
        ("tests/test_nonfinite.py",),
    ),
    Mutant(
        "the host reads the norm before the step is queued (the GPU idles meanwhile)",
        "engine/update.py",
        "        self._norm_reader.start(norm)\n",
        "        self._norm_reader.start(norm)\n        self._norm_reader.value()\n",
        ("tests/test_cuda_path.py::test_a_step_on_the_device_waits_only_for_its_norm",),
    ),
    Mutant(
        "a fused optimizer still waits for the norm before its step",
        "engine/update.py",
        "self._skips_on_device = fused and self._masters_on_device",
        "self._skips_on_device = False",
        ("tests/test_cuda_path.py::test_a_step_on_the_device_waits_only_for_its_norm",),
    ),
    Mutant(
        "the clipping factor is not capped at 1 (a small norm scales gradients up)",
        "engine/update.py",
        "return (clip / (norm + 1e-6)).clamp(max=1.0) * post",
        "return (clip / (norm + 1e-6)) * post",
        ("tests/test_data_parallel.py::test_clipping_with_sgd",),
    ),
    Mutant(
        "the clipping factor leaves out the mean over dp",
        "engine/update.py",
        "return (clip / (norm + 1e-6)).clamp(max=1.0) * post",
        "return (clip / (norm + 1e-6)).clamp(max=1.0)",
        ("tests/test_data_parallel.py::test_clipping_with_sgd",),
    ),
    Mutant(
        "an offloaded norm goes up to the device from pageable memory",
        "engine/update.py",
        "            sq = self._sq_host.copy_(sq).to(run.device, non_blocking=True)",
        "            sq = sq.to(run.device, non_blocking=True)",
        (
            "tests/test_cuda_path.py::"
            "test_offloading_queues_its_uploads_and_waits_only_for_the_gradients",
        ),
    ),
    Mutant(
        "the pinned bytes the host allocator holds are not reported",
        "engine/footprint.py",
        '            out["pinned"] = pinned',
        "            pass",
        (
            "tests/test_cuda_path.py::"
            "test_the_cuda_allocator_figures_are_reported_beside_the_census",
        ),
    ),
    Mutant(
        "reading a gradient unscales it in place (the shard itself at dp 1)",
        "engine/full_params.py",
        "        grad = zero.window_grad(p).mul(post)  # not in place: it may be the shard itself",
        "        grad = zero.window_grad(p).mul_(post)  # not in place: it may be the shard itself",
        ("tests/test_engine_surface.py::test_reading_a_gradient_leaves_it_as_it_was",),
    ),
    Mutant(
        "safe_get_full_fp32_param at ep > 1: a shared parameter's pieces summed over dp only",
        "engine/full_params.py",
        "        axis = zero.state_axis(p)",
        '        axis = "dp" if zero.grads_sharded else None',
        (
            "tests/test_moe.py::"
            "test_shared_gradients_are_reduced_over_dp_and_ep_at_once_in_buckets[1]",
        ),
    ),
    Mutant(
        "a user's step callback that wants the loss gets none",
        "engine/after_step.py",
        'self.losses.collect |= bool(getattr(callback, "wants_loss", False))',
        "pass",
        ("tests/test_engine_surface.py::test_a_step_callback_gets_each_steps_report",),
    ),
    Mutant(
        "the step report calls a skipped step applied",
        "engine/after_step.py",
        "applied=outcome.applied,",
        "applied=True,",
        ("tests/test_engine_surface.py::test_a_step_callback_gets_each_steps_report",),
    ),
    Mutant(
        "a pipeline engine runs a micro-batch's forward",
        "engine/__init__.py",
        "        self._refuse_under_a_pipeline()\n        t0 = self.clock.now()\n        with",
        "        t0 = self.clock.now()\n        with",
        ("tests/test_pipeline.py::test_pipeline_engine_errors_and_eval",),
    ),
    Mutant(
        "tied copies counted on every stage in the gradient norm",
        "engine/__init__.py",
        "return self.replicas.elsewhere(self.zero.cut_over_ep) | self.runner.replicated()",
        "return self.replicas.elsewhere(self.zero.cut_over_ep)",
        ("tests/test_pipeline.py::test_gpt_pipeline_matches_single_process",),
    ),
    Mutant(
        "a load leaves the step counters as they were",
        "engine/train_state.py",
        '            setattr(self, k, state["counters"][k])',
        "            pass",
        ("tests/test_checkpoint.py::test_exact_resume_whole",),
    ),
    Mutant(
        "set_gradient_accumulation_boundary is ignored",
        "engine/accumulation.py",
        "        if self.override is not None:\n            return self.override\n",
        "",
        (
            "tests/test_engine_surface.py::"
            "test_no_sync_and_manual_boundary_accumulate_like_one_batch",
        ),
    ),
    Mutant(
        "no_sync is allowed at ZeRO stage 2",
        "engine/accumulation.py",
        "        if self.stage >= 2:",
        "        if self.stage > 2:",
        (
            "tests/test_engine_surface.py::"
            "test_no_sync_and_manual_boundary_accumulate_like_one_batch",
        ),
    ),
    Mutant(
        "no_sync nests",
        "engine/accumulation.py",
        "        if self.inside_no_sync:",
        "        if False:",
        (
            "tests/test_engine_surface.py::"
            "test_no_sync_and_manual_boundary_accumulate_like_one_batch",
        ),
    ),
    Mutant(
        "the optimizer's step counters are counted as its state",
        "engine/footprint.py",
        "                if torch.is_tensor(t) and t.dim() > 0:",
        "                if torch.is_tensor(t):",
        ("tests/test_cuda_path.py::test_device_and_host_bytes_are_reported_apart[1-False]",),
    ),
    Mutant(
        "a list of different layers is taken for blocks",
        "engine/compiling.py",
        "if count[type(c)] >= 2 and any(",
        "if count[type(c)] >= 1 and any(",
        ("tests/test_compile.py::test_blocks_are_a_lists_children_of_one_class",),
    ),
    Mutant(
        "engine.compile compiles nothing",
        "engine/compiling.py",
        "        block.compile(backend=counted, **kwargs)",
        "        pass",
        ("tests/test_compile.py::test_compiled_blocks_train_as_eager_bit_for_bit[0-fp32]",),
    ),
    Mutant(
        "the compile report counts no graph",
        "engine/compiling.py",
        "        report.graphs += 1",
        "        pass",
        ("tests/test_compile.py::test_compiled_blocks_train_as_eager_bit_for_bit[0-fp32]",),
    ),
    Mutant(
        "engine.compile compiles a compiled engine again",
        "engine/compiling.py",
        "    if engine.compile_report is not None:",
        "    if False:",
        ("tests/test_compile.py::test_what_compile_refuses_is_named",),
    ),
    Mutant(
        "fp16's loss scaler state in DeepSpeed's folder dropped at load (the scale starts over)",
        "engine/train_state.py",
        'self.loss_scaler.load_state_dict(state["loss_scaler"])',
        "pass",
        (
            "tests/test_deepspeed_checkpoints.py::"
            "test_a_deepspeed_folder_resumes_with_deepspeeds_next_losses[zero2_fp16]",
        ),
    ),
    Mutant(
        "random-LTD: the schedule not loaded back from a checkpoint",
        "engine/train_state.py",
        '            self.random_ltd.load_state_dict(state["random_ltd"])',
        "            pass",
        (
            "tests/test_token_drop.py::"
            "test_sharded_stages_drop_the_same_tokens_and_the_schedule_is_checkpointed",
        ),
    ),
    Mutant(
        "a micro-step inside a window says the last update applied",
        "engine/update.py",
        "        return StepOutcome(self.grad_norm, applied=False)",
        "        return StepOutcome(self.grad_norm, applied=True)",
        (
            "tests/test_engine_surface.py::"
            "test_no_sync_and_manual_boundary_accumulate_like_one_batch",
        ),
    ),
    Mutant(
        "the update's outcome calls a skipped step applied",
        "engine/update.py",
        "        return StepOutcome(value, applied=not overflow)",
        "        return StepOutcome(value, applied=True)",
        ("tests/test_engine_surface.py::test_a_step_callback_gets_each_steps_report",),
    ),
    Mutant(
        "initialize starts no watchdog",
        "engine/__init__.py",
        "        self.watchdog = start_watchdog(self.comm.log, config.watchdog, self.topology)",
        "        self.watchdog = None",
        ("tests/test_watchdog.py::test_a_rank_that_raises_is_named_by_every_rank",),
    ),
    Mutant(
        "one part of the engine imports a sibling part (the engine composes them)",
        "engine/replicas.py",
        "from ..moe.utils import is_moe_param\n",
        "from ..moe.utils import is_moe_param\nfrom .update import StepOutcome  # noqa: F401\n",
        ("tests/test_architecture.py::test_the_layers_contract_is_kept",),
    ),
]
