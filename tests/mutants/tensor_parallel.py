"""The mutants of src/zerostack/tensor_parallel/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "sequence parallelism: the column layer saves its gathered input",
        "tensor_parallel/mappings.py",
        "        return torch.nn.functional.linear(_all_gather(x, SEQ_DIM, ctx.axis), weight, b",
        "        x = _all_gather(x, SEQ_DIM, ctx.axis)\n"
        "        ctx.save_for_backward(x, weight)\n"
        "        return torch.nn.functional.linear(x, weight, b",
        (
            "tests/test_tensor_parallel.py::"
            "test_sequence_parallel_layer_keeps_one_tp_th_of_its_activations",
        ),
    ),
    Mutant(
        "autotp splits GPT-2's fused q, k, v as one block",
        "tensor_parallel/autotp.py",
        'chunks={"attn.c_attn": 3},',
        'chunks={"attn.c_attn": 1},',
        ("tests/test_hf.py::test_hf_model_matches_single_process_training[gpt2]",),
    ),
    Mutant(
        "autotp row-parallel outputs not all-reduced",
        "tensor_parallel/autotp.py",
        "y = reduce_from_tp(self._matmul(x, None), comm)",
        "y = self._matmul(x, None)",
        ("tests/test_hf.py::test_hf_model_matches_single_process_training[llama]",),
    ),
    Mutant(
        "autotp size check skipped",
        "tensor_parallel/autotp.py",
        "        if size % tp:",
        "        if False:",
        ("tests/test_hf.py::test_autotp_refuses_what_it_cannot_split",),
    ),
    Mutant(
        "the sequence-parallel linear runs backward outside the forward's autocast",
        "tensor_parallel/mappings.py",
        "        with autocast_as(ctx.autocast):  # as forward ran (a user's torch.autocast)",
        "        if True:",
        ("tests/test_autocast.py::test_autocast_with_tensor_and_sequence_parallelism",),
    ),
    Mutant(
        "tensor-parallel parameters left whole after GatherReplacedLayerParams",
        "tensor_parallel/whole.py",
        "            p.data = split_tensor(p.data, parts=tp, rank=rank, dim=dim, chunks=chunks)",
        "            pass",
        ("tests/test_tp_whole.py::test_split_parameters_are_whole_inside_and_sliced_after",),
    ),
    Mutant(
        "partition_config: the holders' head counts not divided by tp",
        "tensor_parallel/autotp.py",
        "                setattr(module, attr, value // tp)",
        "                pass",
        ("tests/test_autotp_specs.py::test_custom_specs_train_as_one_process",),
    ),
    Mutant(
        "partition_config: strict_mode lets an unmatched layer through",
        "tensor_parallel/autotp.py",
        "        if spec is None and specs.strict_mode:",
        "        if False:",
        (
            "tests/test_autotp_specs.py::"
            "test_unmatched_layers_strict_mode_model_types_and_embeddings",
        ),
    ),
    Mutant(
        "autotp: each column layer all-reduces its input's gradient on its own",
        "tensor_parallel/autotp.py",
        "            return self._matmul(_enter(x, comm), self.bias)",
        "            return self._matmul(copy_to_tp(x, comm), self.bias)",
        (
            "tests/test_tensor_parallel.py::"
            "test_column_layers_reading_one_input_all_reduce_its_gradient_once",
            "tests/test_dryrun.py::test_one_step_at_1024_ranks_issues_the_cost_models_tp_all_reduces",
        ),
    ),
    Mutant(
        "autotp: an entry made without grad reused with grad on",
        "tensor_parallel/autotp.py",
        "    key, state = id(x), (x._version, comm, torch.is_grad_enabled())",
        "    key, state = id(x), (x._version, comm)",
        (
            "tests/test_tensor_parallel.py::"
            "test_column_layers_reading_one_input_all_reduce_its_gradient_once",
        ),
    ),
]
