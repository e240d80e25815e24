"""The mutants of src/zerostack/core/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "the scratch pool hands a buffer back in the shape it was given (a matrix for a row)",
        "core/scratch.py",
        "            t = t.view(-1)  # taken back flat, whatever shape it was given in (a matrix)",
        "            pass",
        ("tests/test_scratch.py::test_a_buffer_given_back_as_a_matrix_is_taken_flat",),
    ),
    Mutant(
        "loss scaler not restored on load",
        "core/train_state.py",
        'self.loss_scaler.load_state_dict(state["loss_scaler"])',
        "pass",
        ("tests/test_checkpoint.py::test_exact_resume_whole",),
    ),
    Mutant(
        "sampler position not restored on load",
        "core/train_state.py",
        'sampler.load_state_dict(state["data_sampler"])',
        "pass",
        ("tests/test_checkpoint.py::test_exact_resume_whole",),
    ),
    Mutant(
        "pipeline data iterator not reset on load",
        "core/train_state.py",
        "            self.data_iter = None\n",
        "",
        ("tests/test_checkpoint.py::test_exact_resume_whole",),
    ),
    Mutant(
        "scratch: large CPU buffers from malloc's heap",
        "core/scratch.py",
        'return torch.device(device).type == "cpu" and numel * dtype.itemsize >= MIN_BYTES',
        "return False",
        (
            "tests/test_scratch.py::"
            "test_a_large_buffer_has_a_mapping_of_its_own_that_goes_when_freed",
        ),
    ),
    Mutant(
        "scratch: a mapping never unmapped (a leak)",
        "core/scratch.py",
        "    return torch.frombuffer(buf, dtype=dtype, count=numel)",
        '    globals().setdefault("_kept", []).append(buf)\n'
        "    return torch.frombuffer(buf, dtype=dtype, count=numel)",
        (
            "tests/test_scratch.py::"
            "test_a_large_buffer_has_a_mapping_of_its_own_that_goes_when_freed",
        ),
    ),
    Mutant(
        "hard_exit runs no removal",
        "core/exit.py",
        "        try:\n            cleanup()\n",
        "        try:\n            pass\n",
        ("tests/test_disk_faults.py::test_the_watchdogs_exit_removes_the_ranks_swap_files",),
    ),
    Mutant(
        "monitor: steps_per_print unseen without a logging set-up",
        "core/progress.py",
        "        print(text, flush=True)",
        "        log.info(text)",
        ("tests/test_monitor.py::test_steps_per_print_is_seen_on_stdout_once",),
    ),
    Mutant(
        "scratch: no huge pages asked for",
        "core/scratch.py",
        "        buf.madvise(_HUGE)",
        "        pass",
        ("tests/test_scratch.py::test_a_large_buffer_asks_for_huge_pages",),
    ),
    Mutant(
        "scratch pool: nothing kept",
        "core/scratch.py",
        "        self.keep = keep",
        "        self.keep = 0",
        ("tests/test_memory.py::test_live_storage_census_matches_the_zero_formulas[2]",),
    ),
    Mutant(
        "a load leaves the step counters as they were",
        "core/train_state.py",
        '            setattr(self, k, state["counters"][k])',
        "            pass",
        ("tests/test_checkpoint.py::test_exact_resume_whole",),
    ),
    Mutant(
        "set_gradient_accumulation_boundary is ignored",
        "core/accumulation.py",
        "        if self.override is not None:\n            return self.override\n",
        "",
        (
            "tests/test_engine_surface.py::"
            "test_no_sync_and_manual_boundary_accumulate_like_one_batch",
        ),
    ),
    Mutant(
        "no_sync is allowed at ZeRO stage 2",
        "core/accumulation.py",
        "        if self.stage >= 2:",
        "        if self.stage > 2:",
        (
            "tests/test_engine_surface.py::"
            "test_no_sync_and_manual_boundary_accumulate_like_one_batch",
        ),
    ),
    Mutant(
        "no_sync nests",
        "core/accumulation.py",
        "        if self.inside_no_sync:",
        "        if False:",
        (
            "tests/test_engine_surface.py::"
            "test_no_sync_and_manual_boundary_accumulate_like_one_batch",
        ),
    ),
    Mutant(
        "the pool's trim keeps every buffer",
        "core/scratch.py",
        "            if kept + t.nbytes <= max_bytes:",
        "            if True:",
        ("tests/test_memory.py::test_live_storage_census_matches_the_zero_formulas[2]",),
    ),
    Mutant(
        "the pool's trim keeps the smallest buffers first",
        "core/scratch.py",
        "key=lambda t: -t.nbytes):",
        "key=lambda t: t.nbytes):",
        ("tests/test_memory.py::test_live_storage_census_matches_the_zero_formulas[2]",),
    ),
    Mutant(
        "fp16's loss scaler state in DeepSpeed's folder dropped at load (the scale starts over)",
        "core/train_state.py",
        'self.loss_scaler.load_state_dict(state["loss_scaler"])',
        "pass",
        (
            "tests/test_deepspeed_checkpoints.py::"
            "test_a_deepspeed_folder_resumes_with_deepspeeds_next_losses[zero2_fp16]",
        ),
    ),
    Mutant(
        "random-LTD: the schedule not loaded back from a checkpoint",
        "core/train_state.py",
        '            self.random_ltd.load_state_dict(state["random_ltd"])',
        "            pass",
        (
            "tests/test_token_drop.py::"
            "test_sharded_stages_drop_the_same_tokens_and_the_schedule_is_checkpointed",
        ),
    ),
]
