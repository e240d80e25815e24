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
        "communication_data_type ignored: gradients reduced in the compute dtype",
        "core/precision.py",
        "return self.comm_dtype or self.compute_dtype",
        "return self.compute_dtype",
        ("tests/test_comm_dtype.py::test_fp32_reduction_sends_fp32_and_sums_exactly",),
    ),
    Mutant(
        "the norm reaches the host through a blocking copy (drains the stream)",
        "core/clock.py",
        "self.host.copy_(t.detach(), non_blocking=self.event is not None)",
        "self.host.copy_(t.detach())",
        ("tests/test_cuda_path.py::test_a_step_on_the_device_waits_only_for_its_norm",),
    ),
    Mutant(
        "the norm's host copy is read before its event (a value the GPU may not have written)",
        "core/clock.py",
        "            self.event.synchronize()\n",
        "            pass\n",
        ("tests/test_cuda_path.py::test_a_step_on_the_device_waits_only_for_its_norm",),
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
        "pinning is never asked for, whatever the flag says",
        "core/pinned.py",
        '    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin and can_pin())',
        '    return torch.empty(shape, dtype=dtype, device="cpu")',
        (
            "tests/test_cuda_path.py::"
            "test_offloading_queues_its_uploads_and_waits_only_for_the_gradients",
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
        "the loss scale grown after each window counting the first clean step (DeepSpeed 0.18's)",
        "core/precision.py",
        "            if stable > 0 and stable % self.scale_window == 0:",
        "            if (stable + 1) % self.scale_window == 0:",
        ("tests/test_precision.py::test_scaler_hysteresis_halving_floor_and_growth",),
    ),
    Mutant(
        "an overflow at the minimum loss scale let through",
        "core/precision.py",
        "                if self.cur_scale == self.min_scale:",
        "                if False:",
        ("tests/test_precision.py::test_scaler_overflow_at_the_floor_ends_the_run",),
    ),
    Mutant(
        "torch_autocast: forward never under autocast",
        "core/precision.py",
        "    if not cfg.torch_autocast.enabled:\n        return contextlib.nullcontext()",
        "    if True:\n        return contextlib.nullcontext()",
        ("tests/test_torch_autocast.py::test_losses_equal_deepspeeds",),
    ),
    Mutant(
        "torch_autocast: the configured dtype ignored (fp16)",
        "core/precision.py",
        "    return DTYPES[block.dtype] if block.dtype else",
        "    return torch.float16 if block.dtype else",
        ("tests/test_torch_autocast.py::test_losses_equal_deepspeeds",),
    ),
    Mutant(
        "core's run reaches for the clock (core's modules stand alone)",
        "core/run.py",
        "from torch import nn\n",
        "from torch import nn\n\nfrom .clock import device_clock  # noqa: F401\n",
        ("tests/test_architecture.py::test_the_layers_contract_is_kept",),
    ),
    Mutant(
        "16-bit masters: the config's keys ignored (a separate fp32 master kept)",
        "core/precision.py",
        "        master = compute if sixteen else torch.float32\n",
        "        master = torch.float32\n",
        ("tests/test_memory.py::test_live_storage_census_matches_the_zero_formulas[2]",),
    ),
    Mutant(
        "16-bit masters: stage 2-3 gradient pieces kept in fp32 beside them",
        "core/precision.py",
        "        if self.master_dtype != torch.float32:  # 16-bit",
        "        if False:  # 16-bit",
        ("tests/test_memory.py::test_live_storage_census_matches_the_zero_formulas[2]",),
    ),
    Mutant(
        "storage identity by data pointer: every meta tensor looks shared",
        "core/storage.py",
        "    return a.untyped_storage()._cdata == b.untyped_storage()._cdata",
        "    return a.data_ptr() == b.data_ptr()",
        ("tests/test_dryrun.py::test_the_engine_at_1024_ranks_holds_what_the_estimate_says",),
    ),
]
