"""The ``tensor_parallel``, ``pipeline`` and ``activation_checkpointing`` blocks."""

from typing import Literal

from pydantic import (
    model_validator,
)

from .base import NonNegInt, PositiveInt, _fail, _Model


class TensorParallelConfig(_Model):
    """The ``tensor_parallel`` block (DeepSpeed's AutoTP training key)."""

    autotp_size: NonNegInt = 0
    """Tensor-parallel ranks per model replica; 0 means not set (the topology's or the model's
    size is used). A plain model is split at ``initialize`` through its ``parallelize(topology)``
    method (the reference GPT has one)."""


class PipelineConfig(_Model):
    """The ``pipeline`` block. The ``PipelineModule`` is built before ``initialize`` from its own
    arguments; keys set here must agree with it (``zerostack train`` builds it from them)."""

    stages: PositiveInt | Literal["auto"] = "auto"
    """Pipeline stages ("auto": the PipelineModule's num_stages)."""
    partition: str = "parameters"
    """How layers are cut into stages: uniform, parameters, type:<regex>."""
    seed_layers: bool = False
    """Seed the RNG with base_seed + layer index before building each layer."""
    activation_checkpoint_interval: NonNegInt = 0
    """Checkpoint every this many layers of a stage (0: off)."""
    schedule: Literal["1f1b", "gpipe", "interleaved"] = "1f1b"
    """Micro-batch schedule. Not a DeepSpeed key (DeepSpeed has 1F1B only)."""
    virtual_stages: PositiveInt = 1
    """Model chunks per rank for the interleaved schedule. Not a DeepSpeed key."""

    @model_validator(mode="after")
    def _chunks(self) -> "PipelineConfig":
        if self.schedule == "interleaved" and self.virtual_stages < 2:
            _fail("the interleaved schedule needs virtual_stages >= 2", "virtual_stages")
        if self.schedule != "interleaved" and self.virtual_stages != 1:
            _fail(
                f"virtual_stages > 1 needs schedule 'interleaved' (not {self.schedule!r})",
                "virtual_stages",
            )
        return self


class ActivationCheckpointingConfig(_Model):
    """The ``activation_checkpointing`` block (DeepSpeed's keys), read by
    ``zerostack.checkpointing.configure``."""

    partition_activations: bool = False
    """Keep each checkpointed input split across the tensor-parallel ranks (gathered for the
    recomputation)."""
    cpu_checkpointing: bool = False
    """Keep checkpointed inputs in host memory until the recomputation."""
    contiguous_memory_optimization: bool = False
    """Copy checkpointed inputs into one preallocated buffer (DeepSpeed's fragmentation guard)."""
    number_checkpoints: PositiveInt | None = None
    """Checkpoints per forward (sizes the contiguous buffer)."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronise the device at each checkpoint boundary (for timing)."""
    profile: bool = False
    """Time the forward and recomputation of checkpointed functions."""
