"""The mutants of src/zerostack/estimate/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "the automatic stage counts Adam's two states for Lion",
        "estimate/memory.py",
        '    "lion": 4,\n',
        "",
        ("tests/test_auto.py::test_the_optimizer_state_counted_is_the_configs[optimizer2-lion]",),
    ),
    Mutant(
        "estimate --sp: the activations of the whole sequence on every Ulysses rank",
        "estimate/report.py",
        "    if sp == 1:\n        return model",
        "    if True:\n        return model",
        ("tests/test_estimate.py::test_ulysses_holds_the_activations_of_its_sequence_shard",),
    ),
    Mutant(
        "estimate --ep: every rank holds all the experts",
        "estimate/report.py",
        "    own_experts = _ceil_div(int(experts), layout.ep * layout.pp)",
        "    own_experts = _ceil_div(int(experts), layout.pp)",
        ("tests/test_estimate.py::test_expert_parallel_layouts_through_the_command_line",),
    ),
    Mutant(
        "estimate at ep > 1: the shared state cut over dp only",
        "estimate/memory.py",
        "        shared = model_states(trained - experts, replace(own, dp=layout.dp * layout.ep))",
        "        shared = model_states(trained - experts, own)",
        ("tests/test_estimate.py::test_estimate_matches_live_engines",),
    ),
    Mutant(
        "estimate: stage 3 pieces not padded to 16 bytes",
        "estimate/memory.py",
        "        shard = sum(piece_numel(n, dp) for n in sizes)",
        "        shard = sum(-(-n // dp) for n in sizes)",
        ("tests/test_estimate.py::test_stage3_padding_is_estimated_as_the_engine_pads",),
    ),
    Mutant(
        "estimate: stage-2/3 gradient shard counted in the compute dtype, not fp32",
        "estimate/memory.py",
        "out.grads = c * trained if stage < 2 else 4 * shard",
        "out.grads = c * trained if stage < 2 else c * shard",
        ("tests/test_estimate.py::test_the_zero_papers_figure_1",),
    ),
    Mutant(
        "estimate: tensor-split activations divided by the sequence-parallel factor",
        "estimate/activations.py",
        "split = ((2 + 2 * kv) * d + mlp * d) * sbh / t",
        "split = ((2 + 2 * kv) * d + mlp * d) * sbh / sp",
        ("tests/test_estimate.py::test_korthikanti_table_2",),
    ),
    Mutant(
        "estimate: offloaded stage-2 gradient piece left on the device too",
        "estimate/memory.py",
        "            out.grads = 0  # stages 2-3 keep it only there",
        "            pass",
        ("tests/test_estimate.py::test_estimate_matches_live_engines",),
    ),
    Mutant(
        "estimate: stage-3 persistent parameters not counted whole",
        "estimate/memory.py",
        "        out.params += c * persistent",
        "        pass",
        ("tests/test_estimate.py::test_estimate_from_the_model_description_matches_every_rank",),
    ),
    Mutant(
        "estimate: the tied output layer left off the last pipeline stage",
        "estimate/activations.py",
        "out += norm + ([self.vocab * h // t] if pp > 1 else [])",
        "out += norm",
        ("tests/test_estimate.py::test_estimate_from_the_model_description_matches_every_rank",),
    ),
    Mutant(
        "estimate: a gated MLP counted with two matrices",
        "estimate/activations.py",
        "mats = 3 if self.gated else 2",
        "mats = 2",
        ("tests/test_estimate.py::test_llama_style_configs_count_their_published_parameters",),
    ),
    Mutant(
        "the estimate leaves out the bucket kept between steps",
        "estimate/memory.py",
        "        out.scratch = c * min(bucket, trained)",
        "        out.scratch = 0",
        ("tests/test_estimate.py::test_model_states_are_the_per_stage_formulas[2-1-fp32]",),
    ),
    Mutant(
        "estimate: an uneven pipeline's larger share on its last stages",
        "estimate/activations.py",
        "    return tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))",
        "    return tuple(reversed([b - a for a, b in zip(bounds, bounds[1:], strict=False)]))",
        (
            "tests/test_estimate.py::test_uneven_pipeline_stages_are_estimated_as_the_engine_cuts_them[3-2]",
            "tests/test_estimate.py::test_uneven_pipeline_stages_are_estimated_as_the_engine_cuts_them[5-3]",
        ),
    ),
]
