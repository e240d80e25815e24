"""``deepspeed.runtime.activation_checkpointing.offload_activations``: the context DeepSpeed's
ALST tutorial wraps each training step in, keeping the inputs of the layers Transformers
checkpoints in host memory (:mod:`zerostack.activation_checkpointing.offload_inputs`)."""

from zerostack.activation_checkpointing.offload_inputs import (
    CheckpointInputsOffload as CheckpointHiddenStatesOffload,
)
from zerostack.activation_checkpointing.offload_inputs import offload_checkpoint_inputs


def get_checkpoint_hidden_states_offloading_ctx_manager(
    use_pin_memory: bool = True,
    use_streams: bool = True,
    min_offload_bytes: int = 1024,
    max_fwd_stash_count: int = 2,
    max_cpu_buffer_pool_count: int = 64,
    keep_last_count: int = 1,
) -> CheckpointHiddenStatesOffload:
    """DeepSpeed's: one context to reuse for every step (forward and backward inside it)."""
    return offload_checkpoint_inputs(
        use_pin_memory=use_pin_memory,
        use_streams=use_streams,
        min_offload_bytes=min_offload_bytes,
        max_fwd_stash_count=max_fwd_stash_count,
        max_cpu_buffer_pool_count=max_cpu_buffer_pool_count,
        keep_last_count=keep_last_count,
    )


__all__ = ["CheckpointHiddenStatesOffload", "get_checkpoint_hidden_states_offloading_ctx_manager"]
