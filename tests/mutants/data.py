"""The mutants of src/zerostack/data/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "resumed sampler starts its epoch over",
        "data/sampler.py",
        "        self._resume = True",
        "        self._resume = False",
        (
            "tests/test_auto_resume.py::test_a_killed_rank_restarts_and_resumes_exactly"
            "[stage2-forward]",
        ),
    ),
    Mutant(
        "sampler position saved per rank, not over all ranks",
        "data/sampler.py",
        '"consumed_samples": self.position * self.num_replicas,',
        '"consumed_samples": self.position,',
        (
            "tests/test_auto_resume.py::test_a_relaunch_on_fewer_ranks_resumes_on_the_new_layout",
            "tests/test_auto_resume.py::"
            "test_an_elastic_job_that_loses_a_node_resumes_on_the_one_left",
        ),
    ),
    Mutant(
        "indexed dataset: merged documents keep the other file's item numbers",
        "data/indexed_dataset.py",
        "(doc_idx[1:] + offset).tolist()",
        "doc_idx[1:].tolist()",
        ("tests/test_indexed_dataset.py::test_builds_deepspeeds_bytes",),
    ),
    Mutant(
        "indexed dataset: get's offset counted in bytes, not items",
        "data/indexed_dataset.py",
        "int(self._pointers[i]) + offset * self._itemsize",
        "int(self._pointers[i]) + offset",
        ("tests/test_indexed_dataset.py::test_reads_deepspeeds_files_as_deepspeed",),
    ),
    Mutant(
        "indexed dataset builder writes in place",
        "data/indexed_dataset.py",
        "self._tmp = _temporary_beside(self._out)",
        "self._tmp = self._out",
        ("tests/test_indexed_dataset.py::test_failed_build_leaves_no_file_and_keeps_the_old_one",),
    ),
    Mutant(
        "dynamic batching: the seed of the random picking order ignored",
        "data/variable_batch.py",
        "random.Random(seed).shuffle(pairs)",
        "random.Random(0).shuffle(pairs)",
        ("tests/test_variable_batch.py::test_batch_by_seqlens_equals_deepspeeds",),
    ),
    Mutant(
        "dynamic batching: step(0) does not go back to the unscaled rates",
        "data/variable_batch.py",
        "unscaled = self.base_lrs if epoch == 0 else self.get_last_lr()",
        "unscaled = self.get_last_lr()",
        ("tests/test_variable_batch.py::test_scheduler_equals_deepspeeds",),
    ),
    Mutant(
        "dynamic batching: micro-batches of a batch cut in runs, not interleaved",
        "data/variable_batch.py",
        "microbatches += [pairs[start + b : end : group] for b in range(group)]",
        "microbatches += [pairs[start + b * (end - start) // group : start + (b + 1) * (end - "
        "start) // group] for b in range(group)]",
        ("tests/test_variable_batch.py::test_batch_by_seqlens_equals_deepspeeds",),
    ),
    Mutant(
        "random-LTD: the kept tokens drawn unsorted (their order in the sequence lost)",
        "data/token_drop.py",
        "    indices = draw.reshape(layers, batch, reserved).sort(dim=-1).values.to(torch.int32)",
        "    indices = draw.reshape(layers, batch, reserved).to(torch.int32)",
        (
            "tests/test_token_drop.py::test_training_equals_deepspeeds",
            "tests/test_token_drop.py::test_sampling_is_sorted_distinct_and_masks_follow",
        ),
    ),
    Mutant(
        "random-LTD: seq-first hidden states indexed as if batch-first",
        "data/token_drop.py",
        "    idx = indices.long() if batch_first else indices.long().t()",
        "    idx = indices.long()",
        ("tests/test_token_drop.py::test_gather_and_scatter_equal_per_sample_indexing",),
    ),
    Mutant(
        "random-LTD: an encoder's mask cut like a decoder's instead of gathered",
        "data/token_drop.py",
        "    if not encoder:\n        return indices, (mask",
        "    if True:\n        return indices, (mask",
        (
            "tests/test_token_drop.py::test_training_equals_deepspeeds",
            "tests/test_token_drop.py::test_sampling_is_sorted_distinct_and_masks_follow",
        ),
    ),
    Mutant(
        "random-LTD: every wrapped layer reads the first layer's draw",
        "data/token_drop.py",
        "        mine = indices[self.random_ltd_layer_id]",
        "        mine = indices[0]",
        (
            "tests/test_token_drop.py::test_training_equals_deepspeeds",
            "tests/test_token_drop.py::test_hugging_face_gpt2_blocks_with_positional_mask",
        ),
    ),
    Mutant(
        "random-LTD: layer-tokens counted at every micro-step, not once per step",
        "data/token_drop.py",
        "        if global_steps != self.state[STEP]:",
        "        if True:",
        ("tests/test_token_drop.py::test_schedule_equals_deepspeeds",),
    ),
    Mutant(
        "random-LTD: a positional mask not bound to its name (left full length)",
        "data/token_drop.py",
        "        if not args:\n            return dict(kwargs)",
        "        if True:\n            return dict(kwargs)",
        ("tests/test_token_drop.py::test_a_mask_passed_by_position_is_found_by_name",),
    ),
    Mutant(
        "DataAnalyzer: a value's samples never flushed to its csv during the map",
        "data/analyzer.py",
        "FLUSH = 100  #",
        "FLUSH = 10**9  #",
        ("tests/test_data_analyzer.py::test_files_equal_deepspeeds_byte_for_byte",),
    ),
    Mutant(
        "DataAnalyzer: a batch counted as len(batch) (a dict's keys), DeepSpeed's fault",
        "data/analyzer.py",
        "            done += len(positions)",
        "            done += len(data)",
        ("tests/test_data_analyzer.py::test_dict_batches_and_torch_dtypes",),
    ),
    Mutant(
        "DataAnalyzer: merged values kept in int64, not the smallest dtype that holds them",
        "data/analyzer.py",
        "        value_dtype = find_fit_int_dtype(values[0], values[-1])",
        "        value_dtype = np.int64",
        ("tests/test_data_analyzer.py::test_files_equal_deepspeeds_byte_for_byte",),
    ),
    Mutant(
        "DataAnalyzer: a metric's dtype not checked",
        "data/analyzer.py",
        "            if not _same_dtype(values, dtype):",
        "            if False:",
        ("tests/test_data_analyzer.py::test_dict_batches_and_torch_dtypes",),
    ),
]
