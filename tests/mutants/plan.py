"""The mutants of src/zerostack/plan/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "the automatic stage counts no momentum buffer for SGD with momentum",
        "plan/auto.py",
        '        opt = "momentum"  # SGD keeps a momentum buffer only with momentum\n',
        "        pass\n",
        (
            "tests/test_auto.py::test_the_optimizer_state_counted_is_the_configs[optimizer1-momentum]",
        ),
    ),
    Mutant(
        "plan: the pipeline bubble left out of the step time",
        "plan/cost.py",
        "bubble = compute * pipeline(c.pp, c.gas, c.chunks)[0]",
        "bubble = 0.0",
        ("tests/test_plan.py::test_the_published_1t_layout",),
    ),
    Mutant(
        "plan: tensor parallelism allowed across nodes",
        "plan/search.py",
        "        if tp > hw.gpus_per_node:",
        "        if False:",
        ("tests/test_plan.py::test_the_planner_on_the_published_case",),
    ),
    Mutant(
        "auto stage: the highest stage that fits, not the lowest",
        "plan/auto.py",
        "stage = fits[0]",
        "stage = fits[-1]",
        ("tests/test_auto.py::test_the_lowest_stage_that_fits",),
    ),
    Mutant(
        "plan: the column layers' backward re-gather left out of the tp cost",
        "plan/cost.py",
        'big = layers * (10 + (4 if recompute == "full" else 0)) + 5',
        'big = layers * (8 + (4 if recompute == "full" else 0)) + 4',
        ("tests/test_tensor_parallel.py::test_comm_per_layer",),
    ),
    Mutant(
        "plan: the gradient norm's all-reduce left out of stages 1-3",
        "plan/cost.py",
        "norm = _ring(4, c.dp, bw, lat, passes=2) if c.stage else 0.0",
        "norm = 0.0",
        ("tests/test_plan.py::test_the_dp_collectives_are_what_the_engine_issues",),
    ),
    Mutant(
        "plan: stage 2 reduces once per step, not per micro-batch",
        "plan/cost.py",
        "dp_s = c.gas * _ring(grads, c.dp, bw, lat) + _ring(grads, c.dp, bw, lat)",
        "dp_s = _ring(grads, c.dp, bw, lat) + _ring(grads, c.dp, bw, lat)",
        ("tests/test_plan.py::test_the_dp_collectives_are_what_the_engine_issues",),
    ),
    Mutant(
        "plan: an uneven pipeline priced as if its layers divided evenly",
        "plan/cost.py",
        "    busiest = max(m.stage_layers(c.pp))",
        "    busiest = m.layers / c.pp",
        ("tests/test_plan.py::test_the_busiest_pipeline_stage_paces_an_uneven_split",),
    ),
    Mutant(
        "plan: backward moves the forward's elementwise bytes once, not twice",
        "plan/cost.py",
        '    forwards = 3 + (1 if c.recompute == "full" else 0)\n',
        '    forwards = 2 + (1 if c.recompute == "full" else 0)\n',
        ("tests/test_plan.py::test_the_step_outside_the_matmuls_is_counted_per_kernel",),
    ),
    Mutant(
        "plan: the norms and residuals split over tp without sequence parallelism",
        "plan/cost.py",
        "    whole = h / (t if k.sequence_parallel else 1)",
        "    whole = h / t",
        ("tests/test_plan.py::test_the_step_outside_the_matmuls_is_counted_per_kernel",),
    ),
    Mutant(
        "plan: flash attention priced over the whole square, not its causal half",
        "plan/cost.py",
        "        attention = core * CAUSAL / (rate * hw.attention_efficiency)",
        "        attention = core / (rate * hw.attention_efficiency)",
        ("tests/test_plan.py::test_the_step_outside_the_matmuls_is_counted_per_kernel",),
    ),
    Mutant(
        "plan: stage 3 under recompute gathers each layer twice, not three times",
        "plan/cost.py",
        '        passes = 2 + (c.recompute == "full" and c.software.regather)',
        "        passes = 2",
        ("tests/test_plan.py::test_software_that_cannot_overlap_or_regathers_pays_for_it",),
    ),
    Mutant(
        "plan: a reduction after backward priced as overlapping it",
        "plan/cost.py",
        "    overlap = backward / c.gas if c.software.overlap_grad_reduce else 0.0",
        "    overlap = backward / c.gas",
        ("tests/test_plan.py::test_software_that_cannot_overlap_or_regathers_pays_for_it",),
    ),
    Mutant(
        "plan: the links at their line rate, not NCCL's bus bandwidth",
        "plan/cost.py",
        "    return hw.inter_bw * hw.link_efficiency, hw.inter_latency",
        "    return hw.inter_bw, hw.inter_latency",
        ("tests/test_plan.py::test_software_that_cannot_overlap_or_regathers_pays_for_it",),
    ),
    Mutant(
        "plan: the A100's InfiniBand in gigabits, not gigabytes, per second",
        "plan/hardware.py",
        "        inter_bw=25 * GB,\n        host_bw=25 * GB,",
        "        inter_bw=25 * GB / 8,\n        host_bw=25 * GB,",
        ("tests/test_plan.py::test_published_runs_are_whole_layouts_with_their_sources",),
    ),
]
