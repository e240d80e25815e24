"""The mutants of src/zerostack/activation_checkpointing/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "recomputation hands autograd the saved tensor itself (the graph leaks every step)",
        "activation_checkpointing/recompute.py",
        "            return len(out) - 1",
        "            return x",
        (
            "tests/test_activation_checkpointing.py::"
            "test_the_recomputed_graph_is_freed_after_backward",
        ),
    ),
    Mutant(
        "cuda: activation checkpointing replays the host generator only",
        "activation_checkpointing/recompute.py",
        "self.rng = _RNG(any(torch.is_tensor(a) and a.is_cuda for a in args))",
        "self.rng = _RNG(False)",
        (
            "tests/test_cuda_path.py::test_with_dropout_on_the_device_generator"
            "[activation-checkpointing-dropout]",
        ),
    ),
    Mutant(
        "the checkpoint-inputs context offloads every saved tensor, not the marked ones",
        "activation_checkpointing/offload_inputs.py",
        "        if not self.unmark(t) or t.device.type",
        "        if t.device.type",
        (
            "tests/test_offload_activations.py::"
            "test_hidden_states_leave_the_device_and_gradients_are_unchanged",
        ),
    ),
    Mutant(
        "the checkpoint-inputs context keeps none of the last inputs on the device",
        "activation_checkpointing/offload_inputs.py",
        "        while len(self.recent) > self.keep_last:",
        "        while len(self.recent) > 0:",
        (
            "tests/test_offload_activations.py::"
            "test_hidden_states_leave_the_device_and_gradients_are_unchanged",
        ),
    ),
    Mutant(
        "the layer marker stays installed after the context",
        "activation_checkpointing/offload_inputs.py",
        "                    _remove_marker()\n",
        "                    pass\n",
        (
            "tests/test_offload_activations.py::"
            "test_hidden_states_leave_the_device_and_gradients_are_unchanged",
        ),
    ),
]
