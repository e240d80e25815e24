"""The whole config: :class:`ZeroStackConfig`, its cross-block rules and the batch arithmetic."""

import math
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BeforeValidator,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from .autocast import TorchAutocastConfig
from .base import (
    BatchSize,
    ConfigError,
    EveryOrNever,
    NonNegFloat,
    NonNegInt,
    PositiveFloat,
    PositiveInt,
    _fail,
    _Model,
    _show,
)
from .data import DataEfficiencyConfig
from .keys import DEEPSPEED_KEYS, UNSUPPORTED, unsupported_error
from .optim import OptimizerConfig, SchedulerConfig
from .parallel import ActivationCheckpointingConfig, PipelineConfig, TensorParallelConfig
from .runs import (
    _KIND_NAMES,
    CheckpointConfig,
    CommsLoggerConfig,
    FlopsProfilerConfig,
    HybridEngineConfig,
    LossSpikeConfig,
    MonitorConfig,
    WandbConfig,
    WatchdogConfig,
    _is_kind,
)
from .zero import (
    BF16Config,
    DataTypesConfig,
    DtypeName,
    FP16Config,
    ZeroConfig,
    grad_accum_refusal,
)


class ZeroStackConfig(_Model):
    """The whole config. Build it with :func:`load_config`, which turns pydantic's errors
    into :class:`ConfigError` (constructing it directly raises pydantic's ValidationError)."""

    train_batch_size: BatchSize = None
    """Global batch size: micro batch * gradient accumulation * data-parallel size ("auto" =
    not given)."""
    train_micro_batch_size_per_gpu: BatchSize = None
    """Batch size of one forward/backward on one rank ("auto" = not given)."""
    gradient_accumulation_steps: BatchSize = None
    """Micro batches per optimizer step ("auto" = not given)."""
    planned_batch: frozenset[str] = Field(default=frozenset(), exclude=True)
    """Not a config key: which of train_micro_batch_size_per_gpu and gradient_accumulation_steps
    were "auto", for :mod:`zerostack.plan.auto` to choose at ``initialize`` (with
    train_batch_size given and a model it can describe; else "auto" means not given)."""

    @model_validator(mode="before")
    @classmethod
    def _note_auto_batch(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if "planned_batch" in data:
                _fail("not a config key (set by the loader)", "planned_batch")
            keys = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
            auto = frozenset(k for k in keys if data.get(k) == "auto")
            if auto:
                data = {**data, "planned_batch": auto}
        return data

    steps_per_print: EveryOrNever = 10
    """Print a progress line on rank 0 every this many optimizer steps (to the "zerostack"
    logger when logging shows INFO, else to stdout) and flush the monitors; ``inf`` (as
    Accelerate sets it) never prints, and the monitors flush when they close."""
    gradient_clipping: NonNegFloat = 1.0
    """Clip the global gradient norm to this value; 0 means no clipping. 1.0 by default, as
    DeepSpeed."""
    seed: NonNegInt = 0
    """Seed of the order in which the engine's data loader (``initialize(training_data=...)``)
    shuffles the dataset each epoch; 0, as DeepSpeed's DistributedSampler. It seeds nothing else
    (weights and dropout are the user's ``torch.manual_seed``). Not a DeepSpeed key."""
    on_nonfinite_grads: Literal["skip", "error"] = "skip"
    """A NaN or inf global gradient norm in bf16 or fp32 training: skip the step on every rank
    (counted in skipped_steps, logged) or raise FloatingPointError. Not a DeepSpeed key. In fp16
    the step is always skipped: it is the dynamic loss scaler's overflow."""
    wall_clock_breakdown: bool = False
    """Time forward, backward and step and log the timings."""
    dataloader_drop_last: bool = False
    """Drop the last incomplete batch in the engine's data loader."""
    prescale_gradients: bool = False
    """Divide gradients by the data-parallel size before the all-reduce instead of after."""
    gradient_predivide_factor: PositiveFloat = 1.0
    """Divide gradients by this before the all-reduce and by dp_size / factor after."""
    zero_allow_untested_optimizer: bool = False
    """Accepted for DeepSpeed compatibility; no effect: any torch optimizer runs under ZeRO."""
    memory_breakdown: bool = False
    """Print this rank's bytes held (``engine.memory_breakdown()``: parameters, gradients, fp32
    masters, optimizer state) after each ``steps_per_print`` progress line."""
    log_level: Annotated[
        Literal["debug", "info", "warning", "error", "critical"] | None,
        BeforeValidator(lambda v: v.lower() if isinstance(v, str) else v),
    ] = None
    """Level set on the "zerostack" logger at ``initialize`` (case-insensitive, as DeepSpeed
    sets its own logger's); None leaves it as it is."""
    deepspeed_only: dict[str, Any] = Field(default_factory=dict, exclude=True)
    """Not a config key: the DeepSpeed keys accepted without a field of their own
    (:mod:`zerostack.config.keys`: no effect, or not supported but given their default), as
    given; ``to_dict`` writes them back."""
    optimizer: OptimizerConfig | None = None
    """Optimizer built by the engine; None means the caller passes one."""
    scheduler: SchedulerConfig | None = None
    """Learning-rate scheduler built by the engine; None means none (or the caller's)."""
    fp16: FP16Config = Field(default_factory=FP16Config)
    """fp16 mixed precision."""
    bf16: BF16Config = Field(
        default_factory=BF16Config, validation_alias=AliasChoices("bf16", "bfloat16")
    )
    """bf16 mixed precision (alias bfloat16)."""
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    """Forward under ``torch.autocast`` (see :class:`TorchAutocastConfig`)."""
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO partitioning and offload."""
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    """Tensor (Megatron-style) parallelism."""
    sequence_parallel_size: PositiveInt = 1
    """Ulysses sequence parallelism (DeepSpeed's key): this many neighbouring data-parallel ranks
    read one batch, each a shard of its sequence, and exchange it for a shard of the attention
    heads around attention (see zerostack.sequence). It must divide world / (tp * pp); the
    batch is split over world / (tp * pp * sequence_parallel_size) replicas. With
    ``ring_parallel_size`` it is the product of both kinds: Ulysses x ring."""
    ring_parallel_size: PositiveInt = 1
    """Ring attention (context parallelism; zerostack's key, DeepSpeed has none) among the
    ``sequence_parallel_size`` ranks of a batch: they form this many ring groups of
    ``sequence_parallel_size / ring_parallel_size`` Ulysses neighbours. Keys and values pass
    around the ring, so heads need only divide by the Ulysses size. It must divide
    ``sequence_parallel_size``; the batches' sequences must divide by ``2 *
    ring_parallel_size`` and by ``sequence_parallel_size`` (zigzag chunks, see
    zerostack.sequence.sequence_piece)."""
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )
    """Activation checkpointing (see zerostack.checkpointing)."""
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    """Pipeline parallelism (used with a PipelineModule)."""
    tensorboard: MonitorConfig = Field(default_factory=MonitorConfig)
    """TensorBoard event files (needs the tensorboard package)."""
    csv_monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    """CSV metric files (one per metric)."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases."""
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    """DeepSpeed's flops profiler (see zerostack.profiling)."""
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    """DeepSpeed's comms logger (see zerostack.comm.log_summary)."""
    hybrid_engine: HybridEngineConfig = Field(default_factory=HybridEngineConfig)
    """DeepSpeed-Chat's hybrid engine: the model gathered once around ``generate``."""
    data_efficiency: DataEfficiencyConfig = Field(default_factory=DataEfficiencyConfig)
    """DeepSpeed's data efficiency block: dynamic batching (variable batch size and LR)."""
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    """Hang and frozen-rank detection (see zerostack.watchdog)."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Automatic and background checkpoints (see zerostack.checkpoint.auto_resume)."""
    loss_spike: LossSpikeConfig = Field(default_factory=LossSpikeConfig)
    """Roll back to the last checkpoint on a loss spike (see zerostack.checkpoint.loss_spike)."""
    communication_data_type: DtypeName | None = None
    """The dtype gradients are reduced in over the data-parallel ranks (fp32, fp16, bf16; e.g.
    fp32 under bf16, as FSDP2's reduce_dtype): each bucket is cast to it, reduced, and the result
    summed into the gradients. Not given: the model's dtype, as in DeepSpeed."""
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    """Gradient accumulation dtype."""

    _ALSO_KNOWN = tuple(DEEPSPEED_KEYS)

    @model_validator(mode="before")
    @classmethod
    def _deepspeed_keys(cls, data: Any) -> Any:
        """DeepSpeed's keys without a field: refused when not supported and asking for
        something, else kept in deepspeed_only; ``zero_optimization: true`` is stage 1."""
        return _deepspeed_only(cls, data)

    @model_validator(mode="after")
    def _spike_has_a_checkpoint(self) -> "ZeroStackConfig":
        ckpt = self.checkpoint
        if self.loss_spike.factor and not (ckpt.save_dir and ckpt.save_interval):
            _fail(
                "needs checkpoint.save_dir and checkpoint.save_interval (a checkpoint to roll "
                "back to)",
                "loss_spike.factor",
            )
        return self

    @model_validator(mode="after")
    def _one_precision(self) -> "ZeroStackConfig":
        if self.fp16.enabled and self.bf16.enabled:
            _fail("only one of fp16 and bf16 can be enabled", "fp16.enabled", "bf16.enabled")
        stage = self.zero_optimization.stage
        refusal = grad_accum_refusal(self, stage) if stage != "auto" else None
        if refusal is not None:  # "auto": checked once the stage is chosen (build_strategy)
            _fail(refusal[1], *refusal[0])
        return self

    _ignored: tuple[str, ...] = PrivateAttr(default=())
    _source: tuple = PrivateAttr(default=(None, False))  # the dict read; by the facade?

    def __eq__(self, other: object) -> bool:
        """The same settings (where they came from, and the keys ignored, do not count)."""
        return isinstance(other, ZeroStackConfig) and self.to_dict() == other.to_dict()

    @property
    def ignored_keys(self) -> tuple[str, ...]:
        """Keys left out as DeepSpeed leaves them out (``load_config(...,
        unknown_keys="as_deepspeed")``), as dotted paths; ``initialize`` warns about them."""
        return self._ignored

    @property
    def model_dtype(self) -> str:
        """The dtype the model computes in: "fp16", "bf16" or "fp32"."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    def resolve_batch(self, dp_world_size: int) -> tuple[int, int, int]:
        """``(train_batch_size, micro_batch_per_gpu, gradient_accumulation_steps)`` with
        train_batch_size == micro * gas * dp_world_size; any two given keys fix the third,
        and a batch size alone implies gas = 1, as in DeepSpeed."""
        if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int):
            raise ValueError(f"dp_world_size must be an int, got {dp_world_size!r}")
        if dp_world_size < 1:
            raise ValueError(f"dp_world_size must be >= 1, got {dp_world_size}")
        dp = dp_world_size
        tbs = self.train_batch_size
        mbs = self.train_micro_batch_size_per_gpu
        gas = self.gradient_accumulation_steps
        keys = "train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps"

        def divide(total: int, by: tuple[int, ...], what: str) -> int:
            if total % math.prod(by):
                shown = " * ".join(map(str, by))
                raise ConfigError(f"{keys}: {total} is not divisible by {shown} ({what})")
            return total // math.prod(by)

        if tbs is None and mbs is None:
            raise ConfigError(
                "train_batch_size: at least one of train_batch_size, "
                "train_micro_batch_size_per_gpu must be set"
            )
        if tbs is not None and mbs is not None and gas is not None:
            if tbs != mbs * gas * dp:
                raise ConfigError(
                    f"{keys}: {tbs} != {mbs} * {gas} * {dp} (micro * gas * data-parallel size)"
                )
        elif tbs is not None and mbs is not None:
            gas = divide(tbs, (mbs, dp), "micro * data-parallel size")
        elif tbs is not None and gas is not None:
            mbs = divide(tbs, (gas, dp), "gas * data-parallel size")
        elif tbs is not None:
            gas = 1
            mbs = divide(tbs, (dp,), "data-parallel size, with gas 1")
        else:
            gas = 1 if gas is None else gas
            tbs = mbs * gas * dp
        return tbs, mbs, gas

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict with DeepSpeed key names; ``load_config`` reads it back."""
        return {
            **self.model_dump(mode="json", by_alias=True, exclude_none=True),
            **self.deepspeed_only,
        }


def _deepspeed_only(cls, data: Any) -> Any:
    """:meth:`ZeroStackConfig._deepspeed_keys` (see it)."""
    if not isinstance(data, dict):
        return data
    if "deepspeed_only" in data:
        _fail("not a config key (set by the loader)", "deepspeed_only")
    data = dict(data)
    if isinstance(data.get("zero_optimization"), bool):  # DeepSpeed's deprecated form
        data["zero_optimization"] = {"stage": 1 if data["zero_optimization"] else 0}
    named = set(cls.model_fields)
    for field in cls.model_fields.values():
        if isinstance(field.validation_alias, AliasChoices):
            named.update(a for a in field.validation_alias.choices if isinstance(a, str))
    kept: dict[str, Any] = {}
    errors: list[InitErrorDetails] = []
    for key, entry in DEEPSPEED_KEYS.items():
        if key not in data or key in named:
            continue
        value = data.pop(key)
        if not _is_kind(value, entry.kind):
            msg = f"must be {_KIND_NAMES[entry.kind]} (got {_show(value)})"
        elif entry.status == UNSUPPORTED and entry.asks(value):
            msg = unsupported_error(key)
        else:
            kept[key] = value
            continue
        err = PydanticCustomError("zerostack", "{msg}", {"msg": msg, "paths": ()})
        errors.append(InitErrorDetails(type=err, loc=(key,), input=value))
    if errors:
        raise ValidationError.from_exception_data(cls.__name__, errors)
    if kept:
        data["deepspeed_only"] = kept
    return data
