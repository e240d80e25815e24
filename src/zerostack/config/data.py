"""The ``data_efficiency`` block (DeepSpeed's keys and defaults): of DeepSpeed's data pipeline,
dynamic batching (variable batch size and learning rate) works; curriculum learning and
random-LTD are refused when enabled."""

from typing import Any, Literal

from pydantic import Field, model_validator

from .base import NonNegInt, PositiveInt, _fail, _Model


class DynamicBatchingConfig(_Model):
    """``data_efficiency.data_sampling.dynamic_batching``: samples of different lengths packed
    into micro-batches of at most ``max_tokens`` tokens, the learning rate scaled by each
    batch's size (:mod:`zerostack.data.variable_batch`, through DeepSpeed's
    ``get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed``)."""

    enabled: bool = False
    """Pack by length (the loader and scheduler come from DeepSpeed's function)."""
    max_tokens: PositiveInt | None = None
    """Largest sum of sample lengths in a micro-batch (needed when enabled)."""
    lr_scaling_method: Literal["linear", "sqrt", "none", "None"] = "linear"
    """How the learning rate follows the batch size: linear, sqrt, or none."""
    min_batch_size: PositiveInt = 1
    """Fewest samples in a micro-batch."""
    max_batch_size: PositiveInt | None = None
    """Most samples in a micro-batch (None: no limit)."""
    sequence_picking_order: Literal["dataloader", "seqlen", "random"] = "dataloader"
    """The order samples are packed in: the dataset's, by length, or shuffled with ``seed``."""
    metrics_path: str | None = None
    """Where the sample lengths are kept (``seqlen/seqlen_sample_to_metric``, an indexed
    dataset), read when the lengths are not passed."""
    verbose: bool = False
    """Log each batch's packing."""

    @model_validator(mode="after")
    def _tokens(self) -> "DynamicBatchingConfig":
        if self.enabled and self.max_tokens is None:
            _fail("must be given when dynamic batching is enabled", "max_tokens")
        return self


class DataSamplingConfig(_Model):
    """``data_efficiency.data_sampling``."""

    enabled: bool = False
    """DeepSpeed's data sampler switch (curriculum learning); dynamic batching has its own."""
    num_epochs: PositiveInt = 1000
    """Curriculum learning's epochs: no effect (curriculum learning is refused)."""
    num_workers: NonNegInt = 0
    """Data loader workers of the variable-batch loader."""
    pin_memory: bool = False
    """Pinned host memory for the variable-batch loader."""
    curriculum_learning: dict[str, Any] = Field(default_factory=lambda: {"enabled": False})
    """Refused when enabled: no curriculum learning."""
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig)
    """See :class:`DynamicBatchingConfig`."""

    @model_validator(mode="after")
    def _curriculum(self) -> "DataSamplingConfig":
        if self.curriculum_learning.get("enabled", False):
            _fail("not supported by zerostack (no curriculum learning)", "curriculum_learning")
        return self


class DataEfficiencyConfig(_Model):
    """The ``data_efficiency`` block."""

    enabled: bool = False
    """DeepSpeed's switch for the block (dynamic batching reads its own)."""
    seed: int = 1234
    """Seed of the random picking order."""
    data_sampling: DataSamplingConfig = Field(default_factory=DataSamplingConfig)
    """See :class:`DataSamplingConfig`."""
    data_routing: dict[str, Any] = Field(
        default_factory=lambda: {
            "enabled": False,
            "random_ltd": {"enabled": False, "layer_token_lr_schedule": {"enabled": False}},
        }
    )
    """Refused when enabled: no random-LTD."""

    @model_validator(mode="after")
    def _routing(self) -> "DataEfficiencyConfig":
        routing = self.data_routing
        if routing.get("enabled", False) or routing.get("random_ltd", {}).get("enabled", False):
            _fail("not supported by zerostack (no random-LTD data routing)", "data_routing")
        return self
