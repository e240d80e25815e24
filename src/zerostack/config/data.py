"""The ``data_efficiency`` block (DeepSpeed's keys and defaults): of DeepSpeed's data pipeline,
dynamic batching (variable batch size and learning rate) and random-LTD (random layer-wise
token dropping) work; curriculum learning is refused when enabled."""

from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

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


class LTDStepsConfig(_Model):
    """``random_ltd.random_ltd_schedule.schedule_config``."""

    require_steps: PositiveInt
    """Steps from ``min_value`` to ``max_value`` kept tokens."""
    seq_per_step: PositiveInt
    """The kept length is rounded down to a multiple of this."""
    root_degree: PositiveInt | None = None
    """DeepSpeed's ``fixed_root`` degree: no effect (``fixed_linear`` is degree 1)."""


class LTDScheduleConfig(_Model):
    """``random_ltd.random_ltd_schedule``: tokens kept by each dropping layer, over steps."""

    min_value: PositiveInt
    """Tokens kept at step 0."""
    max_value: PositiveInt
    """Tokens kept at the end: the sequence length (then no token is dropped)."""
    schedule_type: Literal["fixed_linear"]
    """DeepSpeed's only schedule: linear in the step."""
    schedule_config: LTDStepsConfig
    """See :class:`LTDStepsConfig`."""

    @model_validator(mode="after")
    def _order(self) -> "LTDScheduleConfig":
        if self.min_value > self.max_value:
            _fail(f"{self.min_value} is above max_value {self.max_value}", "min_value")
        return self


class LTDLearningRateConfig(_Model):
    """``random_ltd.layer_token_lr_schedule``: refused when enabled (DeepSpeed: not yet)."""

    enabled: bool = False
    """DeepSpeed raises NotImplementedError on it; refused."""
    total_layer_tokens: PositiveInt | None = None
    """No effect (the schedule is refused)."""
    warmup_type: str | None = None
    """No effect (the schedule is refused)."""
    warmup_layer_tokens: NonNegInt | None = None
    """No effect (the schedule is refused)."""

    @model_validator(mode="after")
    def _refused(self) -> "LTDLearningRateConfig":
        if self.enabled:
            _fail("not supported (DeepSpeed 0.19.8 raises NotImplementedError on it)", "enabled")
        return self


class RandomLTDConfig(_Model):
    """``data_efficiency.data_routing.random_ltd`` when enabled (:mod:`zerostack.data.
    token_drop`): every key DeepSpeed reads is required, as it reads each without a default."""

    enabled: Literal[True]
    """Drop tokens in the layers ``convert_to_random_ltd`` wraps."""
    total_layer_num: PositiveInt
    """The model's layers (for the layer-tokens count)."""
    random_ltd_layer_num: PositiveInt
    """How many layers drop tokens: as many as ``random_ltd_layer_id`` names."""
    random_ltd_layer_id: list[NonNegInt]
    """The dropping layers, matched by DeepSpeed's rule (a wrapper whose name holds the id)."""
    model_mask_name: str | None
    """The keyword the layers get their attention mask by (None: no mask)."""
    model_type: Literal["encoder", "decoder"]
    """A decoder's mask is cut to the kept length; an encoder's gathered at the kept tokens."""
    hidden_state_order: Literal["batch_seq_dim", "seq_batch_dim"]
    """The layers' hidden states: ``[batch, seq, h]`` or ``[seq, batch, h]``."""
    random_ltd_schedule: LTDScheduleConfig
    """See :class:`LTDScheduleConfig`."""
    layer_token_lr_schedule: LTDLearningRateConfig = Field(default_factory=LTDLearningRateConfig)
    """See :class:`LTDLearningRateConfig`."""

    @model_validator(mode="after")
    def _layers(self) -> "RandomLTDConfig":
        if len(self.random_ltd_layer_id) != self.random_ltd_layer_num:
            _fail(
                f"names {len(self.random_ltd_layer_id)} layers, random_ltd_layer_num "
                f"{self.random_ltd_layer_num}",
                "random_ltd_layer_id",
            )
        if self.random_ltd_layer_num > self.total_layer_num:
            _fail(f"above total_layer_num {self.total_layer_num}", "random_ltd_layer_num")
        return self


class DataEfficiencyConfig(_Model):
    """The ``data_efficiency`` block."""

    enabled: bool = False
    """DeepSpeed's switch for the block (dynamic batching and random-LTD read their own)."""
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
    """``enabled`` (DeepSpeed's switch, read by nothing) and ``random_ltd``: see
    :class:`RandomLTDConfig` (checked when enabled)."""

    @model_validator(mode="after")
    def _routing(self) -> "DataEfficiencyConfig":
        ltd = self.data_routing.get("random_ltd", {})
        if ltd.get("enabled", False):
            try:
                RandomLTDConfig.model_validate(ltd)
            except ValidationError as e:
                err = e.errors()[0]
                loc = [str(x) for x in err["loc"]]
                inner = (err.get("ctx") or {}).get("paths") or ("",)  # a check's own key
                where = ".".join([*loc, inner[0]] if inner[0] else loc)
                _fail(err["msg"], f"data_routing.random_ltd.{where}")
        return self

    def random_ltd(self) -> dict | None:
        """The ``random_ltd`` block when enabled, with DeepSpeed's defaults filled (None when
        disabled)."""
        ltd = self.data_routing.get("random_ltd", {})
        if not ltd.get("enabled", False):
            return None
        return RandomLTDConfig.model_validate(ltd).model_dump()
