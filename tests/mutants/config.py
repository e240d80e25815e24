"""The mutants of src/zerostack/config/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "optimizer type Adagrad: amsgrad true accepted (and ignored)",
        "config/optim.py",
        '        if v:\n            _fail("Adagrad has no AMSGrad variant',
        '        if False:\n            _fail("Adagrad has no AMSGrad variant',
        ("tests/test_config.py::test_bad_config[38-optimizer.params.amsgrad]",),
    ),
    Mutant(
        "gradient_clipping defaults to 0 (DeepSpeed clips at 1.0)",
        "config/top.py",
        "    gradient_clipping: NonNegFloat = 1.0",
        "    gradient_clipping: NonNegFloat = 0.0",
        (
            "tests/test_deepspeed_defaults.py::"
            "test_defaults_equal_deepspeeds_but_the_named_differences",
        ),
    ),
    Mutant(
        "engine.config's dict leaves out the resolved batch sizes",
        "config/view.py",
        "            data.update(zip(_BATCH_KEYS, batch, strict=True))",
        "            pass",
        (
            "tests/test_engine_surface.py::"
            "test_engine_config_reads_as_deepspeeds_dict_and_as_the_typed_config",
        ),
    ),
    Mutant(
        "engine.config hands out its own nested dicts (a write sticks, silently)",
        "config/view.py",
        "return copy.deepcopy(self._dict[key])",
        "return self._dict[key]",
        (
            "tests/test_engine_surface.py::"
            "test_engine_config_reads_as_deepspeeds_dict_and_as_the_typed_config",
        ),
    ),
    Mutant(
        "qwZ: accepted below stage 3, where it would do nothing",
        "config/zero.py",
        "        if self.zero_quantized_weights and self.stage != 3:",
        "        if False:",
        ("tests/test_zeropp.py::test_zeropp_is_refused_outside_stage_3",),
    ),
    Mutant(
        "qgZ: accepted below stage 3, where it would do nothing",
        "config/zero.py",
        "        if self.zero_quantized_gradients and self.stage != 3:",
        "        if False:",
        ("tests/test_zeropp.py::test_zeropp_is_refused_outside_stage_3",),
    ),
    Mutant(
        "grad_accum_dtype other than the model's accepted at stage 0",
        "config/zero.py",
        "    if stage == 0 and accum != model:  # DeepSpeed",
        "    if False:  # DeepSpeed",
        ("tests/test_comm_dtype.py::test_bad_values_and_combinations_fail_in_one_line",),
    ),
    Mutant(
        "an unsupported DeepSpeed key loads silently",
        "config/top.py",
        "elif entry.status == UNSUPPORTED and entry.asks(value):",
        "elif False:",
        ("tests/test_config_keys.py::test_unsupported_messages",),
    ),
    Mutant(
        "an unsupported DeepSpeed key is refused at its default too",
        "config/top.py",
        "elif entry.status == UNSUPPORTED and entry.asks(value):",
        "elif entry.status == UNSUPPORTED:",
        ("tests/test_config_keys.py::test_an_unsupported_key_is_refused_naming_it_and_why",),
    ),
    Mutant(
        "no-effect keys: the warning on every rank",
        "config/keys.py",
        "if settings and rank == 0:",
        "if settings:",
        ("tests/test_config_keys.py::test_at_initialize_warning_level_and_memory_line",),
    ),
    Mutant(
        "no-effect keys: a nested key named at its default",
        "config/keys.py",
        "if found is not None and found[0] != found[1]:",
        "if found is not None:",
        ("tests/test_config_keys.py::test_at_initialize_warning_level_and_memory_line",),
    ),
    Mutant(
        "stage-3 default prefetch is DeepSpeed's 5e7 (a small model gathered whole)",
        "config/zero.py",
        "return self.stage3_prefetch_bucket_size if given else None",
        "return self.stage3_prefetch_bucket_size",
        ("tests/test_stage3_live.py",),
    ),
    Mutant(
        "offload pins nothing by default (each pageable copy stops the host on a GPU)",
        "config/zero.py",
        "    pin_memory: bool = True",
        "    pin_memory: bool = False",
        (
            "tests/test_cuda_path.py::"
            "test_offloading_queues_its_uploads_and_waits_only_for_the_gradients",
        ),
    ),
    Mutant(
        "pin_memory=false on a GPU is not warned about",
        "config/keys.py",
        '        if block is not None and block.device != "none" and not block.pin_memory:',
        "        if False:",
        ("tests/test_cuda_path.py::test_pageable_offload_stops_the_host_and_is_warned_about",),
    ),
    Mutant(
        "unknown keys are ignored where DeepSpeed refuses them too",
        "config/load.py",
        "isinstance(loc[-1], str) and block in DEEPSPEED_IGNORES_UNKNOWN",
        "isinstance(loc[-1], str)",
        ("tests/test_config_keys.py::test_as_deepspeed_still_refuses_where_deepspeed_refuses",),
    ),
    Mutant(
        "the unknown keys left out are not named",
        "config/keys.py",
        "    if cfg.ignored_keys and rank == 0:",
        "    if False:",
        (
            "tests/test_config_keys.py::"
            "test_deepspeed_initialize_warns_and_zerostack_initialize_refuses",
        ),
    ),
    Mutant(
        "partition_config: a fused weight's parts ignored (a contiguous slice of the stack)",
        "config/parallel.py",
        "        return self.shape[0] if self.shape is not None else 1",
        "        return 1",
        ("tests/test_autotp_specs.py::test_custom_specs_train_as_one_process",),
    ),
    Mutant(
        "partition_config: the last matching spec wins",
        "config/parallel.py",
        "        return next((s for s in self.layer_specs if s.matches(name, model_type)), None)",
        "        return next((s for s in self.layer_specs[::-1] if s.matches(name, model_type)), "
        "None)",
        ("tests/test_autotp_specs.py::test_the_first_matching_spec_wins",),
    ),
    Mutant(
        "partition_config: a spec's model_types ignored",
        "config/parallel.py",
        "        if self.model_types:\n            kinds",
        "        if False:\n            kinds",
        (
            "tests/test_autotp_specs.py::"
            "test_unmatched_layers_strict_mode_model_types_and_embeddings",
        ),
    ),
    Mutant(
        "facade: an unknown key inside a list entry refused, not left out",
        "config/load.py",
        '    block = ".".join(str(part) for part in loc[:-1] if not isinstance(part, int))',
        '    block = ".".join(str(part) for part in loc[:-1])',
        (
            "tests/test_autotp_specs.py::"
            "test_an_unknown_key_in_a_spec_is_left_out_under_the_facade_and_refused_natively",
        ),
    ),
]
