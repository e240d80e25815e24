"""The mutants of src/zerostack/monitor/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "steps_per_print inf prints at every step",
        "monitor/progress.py",
        "if self.rank != 0 or self.every is None or report.step % self.every:",
        "if self.rank != 0 or (self.every is not None and report.step % self.every):",
        (
            "tests/test_engine_surface.py::"
            "test_backward_scale_wrt_gas_false_leaves_the_division_to_the_caller",
        ),
    ),
    Mutant(
        "monitor: the train loss not averaged over the accumulation window",
        "monitor/training.py",
        "mean = self._sum / self._count",
        "mean = self._sum",
        ("tests/test_monitor.py::test_tensorboard_and_csv_hold_what_the_loop_saw",),
    ),
    Mutant(
        "monitor: events at x = optimizer steps, not DeepSpeed's global_samples",
        "monitor/training.py",
        "x = report.samples",
        "x = report.step",
        ("tests/test_monitor.py::test_tensorboard_and_csv_hold_what_the_loop_saw",),
    ),
    Mutant(
        "memory_breakdown: no memory line",
        "monitor/progress.py",
        "        if self.memory:\n",
        "        if False:\n",
        ("tests/test_config_keys.py::test_at_initialize_warning_level_and_memory_line",),
    ),
    Mutant(
        "cuda: the monitors leave the allocator's figures out",
        "monitor/training.py",
        "for kind, nbytes in report.device_memory().items():",
        "for kind, nbytes in {}.items():",
        (
            "tests/test_cuda_path.py::"
            "test_the_cuda_allocator_figures_are_reported_beside_the_census",
        ),
    ),
    Mutant(
        "the monitors count the next step's collectives",
        "monitor/training.py",
        "self._comm_bytes(report.step - 1)",
        "self._comm_bytes(report.step)",
        ("tests/test_monitor.py",),
    ),
]
