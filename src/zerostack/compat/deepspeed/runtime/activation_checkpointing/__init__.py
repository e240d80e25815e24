"""``deepspeed.runtime.activation_checkpointing``: ``checkpointing`` (zerostack's activation
checkpointing under DeepSpeed's name) and ``offload_activations`` (the ALST tutorial's context
keeping checkpointed layers' inputs in host memory)."""

from zerostack import activation_checkpointing as checkpointing

from . import offload_activations

__all__ = ["checkpointing", "offload_activations"]
