"""Activation checkpointing with the interface of ``deepspeed.checkpointing``.

A checkpointed function keeps only its inputs in forward; backward recomputes the rest when it
first needs it::

    from zerostack import activation_checkpointing as checkpointing  # or zerostack.checkpointing

    checkpointing.configure(mpu_=topology, deepspeed_config=config)  # optional
    y = checkpointing.checkpoint(block, x)

How the inputs are kept follows the config's ``activation_checkpointing`` block:

* ``partition_activations``: each tp rank keeps 1/tp of every floating-point input (flattened,
  zero-padded) and the recomputation all-gathers it over tp. Valid because the input of a
  Megatron layer is the same on every tp rank (not so under sequence parallelism).
* ``cpu_checkpointing``: the kept inputs live in host memory (:func:`host_empty`, pinned under
  CUDA) and go back to their device (:func:`to_device`) for the recomputation.
* ``contiguous_memory_optimization`` with ``number_checkpoints``: the kept inputs of one forward
  are slices of one buffer instead of many allocations (DeepSpeed's fragmentation guard).
* ``synchronize_checkpoint_boundary``: ``torch.cuda.synchronize()`` around each checkpoint.
* ``profile``: forward and recomputation seconds in :func:`timers`.

The checkpoint is non-reentrant. The forward builds the ordinary autograd graph, but every tensor
autograd would save is replaced by a handle (a ``saved_tensors_hooks`` pack); the first unpack
recomputes the function and hands out the recomputed tensors. Gradients flow through the one
graph, so each parameter's gradient is accumulated once per backward and ZeRO's
post-accumulate-grad hooks fire once, as without checkpointing (DeepSpeed's reentrant checkpoint
runs a nested backward per segment instead). The recomputation replays torch's CPU and CUDA
generators, zerostack's tp RNG tracker and the autocast state of the forward, so dropout draws
the same masks.

Where things are: ``configuration.py`` (:func:`configure`, the one state object, timers,
DeepSpeed's RNG names), ``placement.py`` (host memory, tp partitions, the contiguous buffer),
``recompute.py`` (:func:`checkpoint`: the saved-tensor hooks, kept inputs, replayed RNG).
``zerostack.checkpointing`` is this package under DeepSpeed's name (the same module object).

Hugging Face models: ``initialize`` with an ``activation_checkpointing`` block routes the layers
the model checkpoints (``model.gradient_checkpointing_enable()``) through :func:`checkpoint`
(:func:`adopt_model_checkpointing`), so ``cpu_checkpointing`` and the rest apply to them.
"""

from __future__ import annotations

from .configuration import (
    Settings,
    configure,
    get_cuda_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    reset,
    settings,
    timers,
    unconfigure,
)
from .placement import host_empty, partition_size, to_device
from .recompute import (
    CheckpointingError,
    adopt_model_checkpointing,
    checkpoint,
    model_checkpointed_layers,
)

__all__ = [
    "CheckpointingError",
    "Settings",
    "adopt_model_checkpointing",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "host_empty",
    "is_configured",
    "model_checkpointed_layers",
    "model_parallel_cuda_manual_seed",
    "partition_size",
    "reset",
    "settings",
    "timers",
    "to_device",
    "unconfigure",
]
