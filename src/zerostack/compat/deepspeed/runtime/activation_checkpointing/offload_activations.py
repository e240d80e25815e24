"""``deepspeed.runtime.activation_checkpointing.offload_activations``: the context DeepSpeed's
ALST tutorial wraps each training step in, keeping the inputs of the layers Transformers
checkpoints in host memory (:mod:`zerostack.activation_checkpointing.offload_inputs`)."""

from zerostack.activation_checkpointing.offload_inputs import (
    CheckpointInputsOffload as CheckpointHiddenStatesOffload,
)

get_checkpoint_hidden_states_offloading_ctx_manager = CheckpointHiddenStatesOffload
"""DeepSpeed's: one context to reuse for every step (forward and backward inside it); the class
takes DeepSpeed's keywords with DeepSpeed's defaults."""

__all__ = ["CheckpointHiddenStatesOffload", "get_checkpoint_hidden_states_offloading_ctx_manager"]
