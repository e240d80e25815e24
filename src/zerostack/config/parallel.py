"""The ``tensor_parallel``, ``pipeline`` and ``activation_checkpointing`` blocks."""

import re
from typing import Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from .base import NonNegInt, PositiveInt, _fail, _Model


class LayerSpec(_Model):
    """One of ``partition_config.layer_specs`` (DeepSpeed's ``TPLayerSpec``): the linear layers
    whose ``<module name>.weight`` a pattern matches (``re.match``, the first spec that matches
    wins) are split by output features (``column``), by input features (``row``), or left
    whole (``skip``)."""

    patterns: list[str] = Field(min_length=1)
    """Regular expressions over ``<module name>.weight``."""
    partition_type: Literal["column", "row", "skip"] = "column"
    """How the matched layers are split (DeepSpeed's ``PartitionType``, any case)."""
    shape: list[int | list[int]] | None = None
    """A fused weight's parts along the split dimension: ``[n, -1]`` (n equal parts, each split
    over the tp ranks; q, k and v of a fused projection). Unequal parts are refused."""
    partition_dim: NonNegInt | None = None
    """The split dimension: 0 for column, 1 for row (another is refused)."""
    model_types: list[str] | None = None
    """Only for models whose ``config.model_type`` is one of these (any case)."""
    gather_output: bool = False
    """Refused when true: a column layer's output stays split."""
    grad_allreduce: bool = False
    """Refused when true: a skipped layer's gradients are not summed over tp."""

    @field_validator("partition_type", mode="before")
    @classmethod
    def _lower(cls, v):
        return v.lower() if isinstance(v, str) else v

    @model_validator(mode="after")
    def _served(self) -> "LayerSpec":
        for p in self.patterns:
            try:
                re.compile(p)
            except re.error as e:
                _fail(f"{p!r} is no regular expression ({e})", "patterns")
        dim = 0 if self.partition_type == "column" else 1
        if self.partition_dim is not None and self.partition_dim != dim:
            _fail(
                f"{self.partition_dim}: zerostack splits a {self.partition_type} layer along "
                f"dimension {dim} only",
                "partition_dim",
            )
        if self.shape is not None and (
            self.partition_type != "column"
            or len(self.shape) != 2
            or self.shape[1] != -1
            or not isinstance(self.shape[0], int)
            or self.shape[0] < 1
        ):
            _fail(
                f"{self.shape}: zerostack splits [n, -1] (n equal parts) of a column layer; "
                "unequal parts and reshapes are not supported",
                "shape",
            )
        for key in ("gather_output", "grad_allreduce"):
            if getattr(self, key):
                _fail("not supported by zerostack's tensor-parallel layers", key)
        return self

    @property
    def chunks(self) -> int:
        return self.shape[0] if self.shape is not None else 1

    def matches(self, name: str, model_type: str | None) -> bool:
        """Whether ``name`` (``<module>.weight``) of a ``model_type`` model is this spec's."""
        if self.model_types:
            kinds = {t.lower() for t in self.model_types}
            if model_type is None or model_type.lower() not in kinds:
                return False
        return any(re.match(p, name) for p in self.patterns)


class PartitionConfig(_Model):
    """``tensor_parallel.partition_config`` (DeepSpeed's configurable AutoTP): the layers to
    split, by pattern, in place of zerostack's per-architecture table; a linear layer no spec
    matches stays whole."""

    layer_specs: list[LayerSpec] = Field(default_factory=list)
    """See :class:`LayerSpec`."""
    use_default_specs: bool = True
    """DeepSpeed merges the specs into a ``preset_model``'s; without one (zerostack has none)
    the specs alone decide, as in DeepSpeed: no effect."""
    strict_mode: bool = False
    """Refuse a linear layer that no spec matches."""
    tp_size: PositiveInt = 1
    """No effect: ``autotp_size`` decides (DeepSpeed overwrites it too)."""
    embedding_partition_dim: int = 1
    """No effect: embeddings stay whole (as DeepSpeed's training AutoTP keeps them)."""
    lm_head_patterns: list[str] = Field(default_factory=lambda: ["lm_head", "embed_out"])
    """No effect: read by DeepSpeed's vocabulary-parallel LM head, which zerostack lacks."""

    def spec_for(self, name: str, model_type: str | None) -> LayerSpec | None:
        """The first spec matching ``name`` (``<module>.weight``), or None."""
        return next((s for s in self.layer_specs if s.matches(name, model_type)), None)


class TensorParallelConfig(_Model):
    """The ``tensor_parallel`` block (DeepSpeed's AutoTP training key)."""

    autotp_size: NonNegInt = 0
    """Tensor-parallel ranks per model replica; 0 means not set (the topology's or the model's
    size is used). A plain model is split at ``initialize`` through its ``parallelize(topology)``
    method (the reference GPT has one)."""
    partition_config: PartitionConfig | None = None
    """Which linear layers to split, by name pattern (DeepSpeed's custom AutoTP specs), for a
    model of any architecture; None: zerostack's table for Hugging Face models (see
    :class:`PartitionConfig`)."""


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
