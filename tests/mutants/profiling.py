"""The mutants of src/zerostack/profiling/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "transformer flops: full recompute costs no second forward",
        "profiling/flops.py",
        "layers * layer * (passes + (1 if recompute else 0))",
        "layers * layer * passes",
        ("tests/test_plan.py::test_flops_are_narayanans_formula",),
    ),
    Mutant(
        "transformer flops drop the backward",
        "profiling/flops.py",
        "passes = 1 + (2 if backward else 0)",
        "passes = 1",
        ("tests/test_flops_profiler.py::test_narayanan_formula_for_the_1t_model",),
    ),
    Mutant(
        "flops profiler counts a tied parameter twice",
        "profiling/flops_profiler/profiler.py",
        "for p in module.parameters())",
        "for p in module.parameters(remove_duplicate=False))",
        ("tests/test_flops_profiler.py::test_shared_parameters_are_counted_once",),
    ),
    Mutant(
        "flops profiler: step flops without the backward",
        "profiling/flops_profiler/profiler.py",
        "round(fwd * (3 + self.recompute_fwd_factor))",
        "round(fwd * (1 + self.recompute_fwd_factor))",
        (
            "tests/test_flops_profiler.py::"
            "test_backward_and_recomputation_before_stop_are_not_counted",
        ),
    ),
    Mutant(
        "flops_profiler block: the profiled step is never printed",
        "profiling/flops_profiler/step.py",
        "        if self.active:\n            self._end()",
        "        if False:\n            self._end()",
        ("tests/test_flops_profiler.py::test_the_engine_profiles_the_configured_step",),
    ),
    Mutant(
        "the monitors never learn the profiled flops",
        "profiling/flops_profiler/step.py",
        "        report.flops = self.last_step_flops",
        "        report.flops = None",
        ("tests/test_monitor.py",),
    ),
    Mutant(
        "the throughput timer times the warm-up steps",
        "profiling/throughput.py",
        "        if self.global_step_count >= self.start_step:",
        "        if True:",
        (
            "tests/test_engine_surface.py::"
            "test_deepspeed_optimizer_backward_throughput_timer_and_ds_tensor",
        ),
    ),
]
