"""Typed, strict zerostack configuration, with DeepSpeed's JSON key names and defaults.

Usage::

    from zerostack.config import load_config

    cfg = load_config({
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
        "bf16": {"enabled": True},
    })                                          # or a JSON file path, or a JSON string
    cfg.optimizer.params.lr                     # 0.0003
    cfg.resolve_batch(dp_world_size=8)          # (64, 4, 2)

Every problem surfaces as one :class:`ConfigError` whose one-line message starts with the dotted
JSON key path, e.g. ``fp16.initial_scale_powr: unknown key (did you mean 'initial_scale_power'?)``.
Every top-level key of DeepSpeed's config is known (:mod:`zerostack.config_keys`): it works, or
it is accepted with no effect (warned about once at ``initialize``), or it is refused with a
``ConfigError`` saying why.
"""

import difflib
import json
import math
import os
from typing import Annotated, Any, ClassVar, Literal, NoReturn

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SkipValidation,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from .config_keys import DEEPSPEED_KEYS, UNSUPPORTED, unsupported_error

DEFAULT_BUCKET_NUMEL = 4_000_000
"""Gradient bucket size when ``reduce_bucket_size`` is not given (torch DDP uses 25 MB)."""
SUPPORTED_ZERO_STAGES: frozenset[int] = frozenset({0, 1, 2, 3})
"""ZeRO stages this version implements; widen as stages land (checked in `_check_implemented`)."""

_SUPPORTED_OFFLOAD_DEVICES = frozenset({"none", "cpu", "nvme"})


class ConfigError(ValueError):
    """A bad config. The message is one line: ``"<dotted.key.path>: <what is wrong>"``."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).splitlines()))


# --- error plumbing -------------------------------------------------------------------------


def _fail(msg: str, *paths: str) -> NoReturn:
    """Fail validation; ``paths`` name the keys at fault, relative to the model being validated."""
    raise PydanticCustomError("zerostack", "{msg}", {"msg": msg, "paths": paths})


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _dotted(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _describe(err: Any) -> str:
    where, kind, ctx = _dotted(err["loc"]), err["type"], err.get("ctx") or {}
    if kind == "zerostack":
        paths = ctx.get("paths") or ("",)
        where = ", ".join(".".join(p for p in (where, rel) if p) for rel in paths)
        msg = ctx["msg"]
    elif kind == "missing":
        msg = "required key is missing"
    elif kind == "extra_forbidden":
        msg = "unknown key"
    elif kind in ("model_type", "model_attributes_type", "dict_type"):
        msg = f"must be a JSON object (got {_show(err['input'])})"
    else:
        msg = err["msg"].removeprefix("Value error, ").replace("Input should be", "must be", 1)
        msg = f"{msg} (got {_show(err['input'])})"
    return f"{where or 'config'}: {msg}"


def _config_error(exc: ValidationError) -> ConfigError:
    return ConfigError("; ".join(_describe(e) for e in exc.errors()))


# --- value types ----------------------------------------------------------------------------


def _integral(v: Any) -> Any:
    # DeepSpeed configs write sizes as 5e8: accept integral floats, reject 2.5.
    if isinstance(v, float):
        if not v.is_integer():
            _fail(f"must be an integer (got {v!r})")
        return int(v)
    return v


def _auto_is_none(v: Any) -> Any:
    # HF Trainer writes "auto" for values it fills in itself; here it means "not given".
    return None if v == "auto" else v


def _list_to_tuple(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


Int = Annotated[int, BeforeValidator(_integral)]


def _stage_or_auto(v: Any) -> Any:
    # "auto" passes as itself; anything else must be a whole number (one clean error, not a
    # union's two).
    if v == "auto":
        return v
    v = _integral(v)
    if isinstance(v, bool) or not isinstance(v, int):
        _fail(f"must be a valid integer or 'auto' (got {v!r})")
    return v


StageOrAuto = Annotated[int | str, BeforeValidator(_stage_or_auto)]


def _every_or_never(v: Any) -> Any:
    # Accelerate always sets steps_per_print to float("inf"): never, None here (one clean
    # error for anything else, not a union's two)
    if isinstance(v, float) and v == math.inf:
        return None
    v = _integral(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        _fail(f"must be a positive integer or inf (got {v!r})")
    return v


EveryOrNever = Annotated[int | None, BeforeValidator(_every_or_never)]
PositiveInt = Annotated[Int, Field(gt=0)]
NonNegInt = Annotated[Int, Field(ge=0)]
BatchSize = Annotated[PositiveInt | None, BeforeValidator(_auto_is_none)]
NonNegFloat = Annotated[float, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Ratio = Annotated[float, Field(ge=0, le=1)]
Beta = Annotated[float, Field(ge=0, lt=1)]
WarmupType = Literal["log", "linear"]


def _aliases(default: Any, *names: str) -> Any:
    return Field(default, validation_alias=AliasChoices(*names))


class _Model(BaseModel):
    _ALSO_KNOWN: ClassVar[tuple[str, ...]] = ()
    """Keys without a field that a misspelling may be suggested as."""

    # Strict: JSON is typed, so "16" for an int or 1 for a bool is a mistake, not a value.
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        populate_by_name=True,
        use_attribute_docstrings=True,
        allow_inf_nan=False,
    )

    @model_validator(mode="before")
    @classmethod
    def _canonical_keys(cls, data: Any) -> Any:
        """Rename alias keys to the canonical name; report unknown keys with a suggestion."""
        if not isinstance(data, dict):
            return data
        canonical: dict[str, str] = {}
        for name, field in cls.model_fields.items():
            canonical[name] = name
            if isinstance(field.validation_alias, AliasChoices):
                canonical.update(
                    (a, name) for a in field.validation_alias.choices if isinstance(a, str)
                )
        out: dict[str, Any] = {}
        seen_as: dict[str, str] = {}
        errors: list[InitErrorDetails] = []
        for key, value in data.items():
            name = canonical.get(key) if isinstance(key, str) else None
            if name is None:
                close = difflib.get_close_matches(str(key), [*canonical, *cls._ALSO_KNOWN], n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                msg = f"unknown key{hint}"
                loc = (str(key),)
            elif name in out:
                msg, loc = f"given twice (as {seen_as[name]!r} and {key!r})", (name,)
            else:
                out[name], seen_as[name] = value, key
                continue
            err = PydanticCustomError("zerostack", "{msg}", {"msg": msg, "paths": ()})
            errors.append(InitErrorDetails(type=err, loc=loc, input=value))
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return out


# --- optimizer and scheduler ----------------------------------------------------------------


class AdamParams(_Model):
    """``optimizer.params`` for Adam and AdamW (DeepSpeed's FusedAdam arguments)."""

    lr: NonNegFloat = 1e-3
    """Learning rate."""
    betas: Annotated[tuple[Beta, Beta], BeforeValidator(_list_to_tuple)] = (0.9, 0.999)
    """Coefficients of the running averages of the gradient and its square."""
    eps: PositiveFloat = 1e-8
    """Term added to the denominator for numerical stability."""
    weight_decay: NonNegFloat = 0.0
    """Weight decay coefficient."""
    adam_w_mode: bool = True
    """As in DeepSpeed: with type "Adam", true (the default) means decoupled weight decay
    (AdamW) and false means L2 regularisation (classic Adam). Type "AdamW" is always decoupled."""
    torch_adam: bool = False
    """Use torch.optim's plain (not fused) Adam / AdamW, also with the optimizer offloaded (where
    CPUAdam is the default), as DeepSpeed does."""
    amsgrad: bool = False
    """Use the AMSGrad variant."""


class SGDParams(_Model):
    """``optimizer.params`` for SGD (torch.optim.SGD arguments)."""

    lr: NonNegFloat = 0.001
    """Learning rate (torch's default, which DeepSpeed passes on)."""
    momentum: NonNegFloat = 0.0
    """Momentum factor."""
    dampening: float = 0.0
    """Dampening for momentum."""
    weight_decay: NonNegFloat = 0.0
    """Weight decay (L2 penalty)."""
    nesterov: bool = False
    """Nesterov momentum; needs momentum > 0 and dampening 0."""

    @model_validator(mode="after")
    def _nesterov(self) -> "SGDParams":
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            _fail("requires momentum > 0 and dampening 0", "nesterov")
        return self


class WarmupLRParams(_Model):
    """``scheduler.params`` for WarmupLR."""

    warmup_min_lr: NonNegFloat = 0.0
    """Learning rate at the start of the warmup."""
    warmup_max_lr: NonNegFloat | None = None
    """Learning rate at the end of the warmup; None: each param group's own lr, as DeepSpeed's
    WarmupLR."""
    warmup_num_steps: NonNegInt = 1000
    """Number of warmup steps (the scheduler uses at least 2, as DeepSpeed does)."""
    warmup_type: WarmupType = "log"
    """Shape of the warmup: "log" or "linear"."""
    last_batch_iteration: Annotated[Int, Field(ge=-1)] = -1
    """Index of the last batch when resuming; -1 for a fresh start."""


class WarmupDecayLRParams(WarmupLRParams):
    """``scheduler.params`` for WarmupDecayLR: WarmupLR, then linear decay to 0."""

    total_num_steps: PositiveInt
    """Step at which the learning rate reaches 0 (required, >= warmup_num_steps)."""
    warmup_max_lr: NonNegFloat = 0.001
    """Learning rate at the end of the warmup (DeepSpeed's WarmupDecayLR default)."""

    @model_validator(mode="after")
    def _total_after_warmup(self) -> "WarmupDecayLRParams":
        if self.total_num_steps < self.warmup_num_steps:
            msg = f"{self.total_num_steps} is less than warmup_num_steps ({self.warmup_num_steps})"
            _fail(msg, "total_num_steps")
        return self


class WarmupCosineLRParams(_Model):
    """``scheduler.params`` for WarmupCosineLR (ratios of each param group's own lr)."""

    total_num_steps: PositiveInt
    """Total number of training steps (required)."""
    warmup_min_ratio: Ratio = 0.0
    """Ratio of the optimizer's lr at the start of the warmup."""
    warmup_num_steps: NonNegInt = 1000
    """Number of warmup steps."""
    cos_min_ratio: Ratio = 0.0001
    """Ratio of the optimizer's lr at the end of the cosine decay."""
    warmup_type: WarmupType = "log"
    """Shape of the warmup: "log" or "linear"."""
    last_batch_iteration: Annotated[Int, Field(ge=-1)] = -1
    """Index of the last batch when resuming; -1 for a fresh start."""


class _TypedBlock(_Model):
    """A ``{"type": ..., "params": {...}}`` block whose params model depends on the type."""

    _PARAMS: ClassVar[dict[str, type[_Model]]]
    _CASE_INSENSITIVE: ClassVar[bool] = False

    @field_validator("type", mode="before", check_fields=False)
    @classmethod
    def _known_type(cls, v: Any) -> Any:
        if isinstance(v, str):
            for name in cls._PARAMS:
                if v == name or (cls._CASE_INSENSITIVE and v.lower() == name.lower()):
                    return name
        _fail(f"{v!r} is not supported (supported: {', '.join(cls._PARAMS)})")

    @field_validator("params", mode="before", check_fields=False)
    @classmethod
    def _typed_params(cls, v: Any, info: ValidationInfo) -> Any:
        kind = info.data.get("type")
        if kind is None:  # the bad type is reported; params can't be checked without it
            return v
        # A ValidationError raised here is merged into the outer one under "<block>.params".
        return cls._PARAMS[kind].model_validate({} if v is None else v)


class OptimizerConfig(_TypedBlock):
    """The ``optimizer`` block."""

    _PARAMS = {"Adam": AdamParams, "AdamW": AdamParams, "SGD": SGDParams}
    _CASE_INSENSITIVE = True  # DeepSpeed lower-cases optimizer names

    type: Literal["Adam", "AdamW", "SGD"]
    """Optimizer name, case-insensitive on input ("adamw" becomes "AdamW")."""
    params: Annotated[AdamParams | SGDParams, SkipValidation] = Field(
        default=None, validate_default=True
    )
    """Optimizer arguments, checked against the type's own keys (AdamParams or SGDParams)."""

    @property
    def decoupled_weight_decay(self) -> bool:
        """True when weight decay is AdamW-style (type AdamW, or Adam with adam_w_mode)."""
        return self.type == "AdamW" or (self.type == "Adam" and self.params.adam_w_mode)


class SchedulerConfig(_TypedBlock):
    """The ``scheduler`` block."""

    _PARAMS = {
        "WarmupLR": WarmupLRParams,
        "WarmupDecayLR": WarmupDecayLRParams,
        "WarmupCosineLR": WarmupCosineLRParams,
    }

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    """Scheduler name (case-sensitive, as in DeepSpeed)."""
    params: Annotated[
        WarmupLRParams | WarmupDecayLRParams | WarmupCosineLRParams, SkipValidation
    ] = Field(default=None, validate_default=True)
    """Scheduler arguments, checked against the type's own keys."""


# --- precision, ZeRO, monitors --------------------------------------------------------------


class FP16Config(_Model):
    """The ``fp16`` block."""

    enabled: bool = False
    """Train in fp16 with fp32 master weights and loss scaling."""
    auto_cast: bool = False
    """Cast the floating-point tensors among the engine's positional inputs to fp16, as
    DeepSpeed does (keyword arguments and integer tensors are left as they are; see
    ``Engine.forward``). Without it no input is cast."""
    loss_scale: NonNegFloat = 0.0
    """Static loss scale; 0 means dynamic loss scaling."""
    initial_scale_power: Annotated[Int, Field(ge=0, le=64)] = 16
    """The dynamic loss scale starts at 2**initial_scale_power."""
    loss_scale_window: PositiveInt = 1000
    """Steps without overflow before the dynamic loss scale is doubled."""
    hysteresis: PositiveInt = 2
    """Overflows tolerated before the dynamic loss scale is halved."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis on every step without overflow."""
    min_loss_scale: PositiveFloat = 1.0
    """Lower bound of the dynamic loss scale."""


class BF16Config(_Model):
    """The ``bf16`` block (DeepSpeed also accepts the key ``bfloat16``)."""

    enabled: bool = False
    """Train in bf16 with fp32 master weights (no loss scaling needed)."""
    immediate_grad_update: bool = False
    """Accepted for DeepSpeed compatibility; no effect (see zerostack.config_keys)."""


# DeepSpeed's spellings of a dtype (its DtypeEnum; communication_data_type in any case).
_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
}


def _dtype_name(v: Any) -> Any:
    return _DTYPE_ALIASES.get(v.lower(), v.lower()) if isinstance(v, str) else v


DtypeName = Annotated[Literal["fp32", "fp16", "bf16"], BeforeValidator(_dtype_name)]


class DataTypesConfig(_Model):
    """The ``data_types`` block."""

    grad_accum_dtype: DtypeName | None = None
    """The dtype gradients are summed in across the micro-batches of an accumulation window
    (fp32, fp16, bf16). Not given: at stages 0-1 the model's dtype (DeepSpeed's default); at
    stages 2-3 fp32, where zerostack keeps the reduced pieces (DeepSpeed keeps them in the
    model's dtype: give it to get DeepSpeed's bytes). Stage 0 takes only the model's dtype, as in
    DeepSpeed."""


def grad_accum_refusal(cfg: "ZeroStackConfig", stage: int) -> tuple[tuple[str, ...], str] | None:
    """Why ``cfg`` cannot accumulate gradients in ``data_types.grad_accum_dtype`` at ZeRO
    ``stage``: (the keys at fault, what is wrong), or None when it can."""
    accum, model = cfg.data_types.grad_accum_dtype, cfg.model_dtype
    if accum is None:
        return None
    if stage == 0 and accum != model:  # DeepSpeed: "unsupported mix of model_dtype and ..."
        keys = ("data_types.grad_accum_dtype", "zero_optimization.stage")
        return keys, (
            f"{accum} accumulation of a {model} model needs ZeRO stage 1, 2 or 3 (stage 0 "
            f"accumulates in the model's dtype, as in DeepSpeed)"
        )
    offload = cfg.zero_optimization.offload_optimizer
    if stage == 3 and accum != "fp32" and offload is not None and offload.device == "nvme":
        keys = ("data_types.grad_accum_dtype", "zero_optimization.offload_optimizer.device")
        return keys, f"stage 3 with nvme offload keeps its gradients in fp32 files, not {accum}"
    return None


class OffloadConfig(_Model):
    """``zero_optimization.offload_optimizer`` / ``offload_param``. One model serves both, so
    buffer_count defaults to 4 for both (DeepSpeed's offload_param default is 5)."""

    device: Literal["none", "cpu", "nvme"] = "none"
    """Where to offload to: host memory ("cpu") or files under nvme_path ("nvme")."""
    nvme_path: str | None = None
    """Directory for nvme offload (required when device is "nvme"); each rank writes its files
    in its own subdirectory, removed at the end."""
    pin_memory: bool = True
    """Page-locked host buffers, so copies to and from the GPU overlap the host's work (only
    matters with a GPU; :mod:`zerostack.pinned`)."""
    buffer_count: PositiveInt = 4
    """Sub-groups (optimizer) or parameter shards held in host memory at once with nvme."""
    buffer_size: PositiveInt = 100_000_000
    """Size of the nvme swap buffers. Accepted for DeepSpeed compatibility; no effect yet."""
    max_in_cpu: NonNegInt = 1_000_000_000
    """Parameter elements kept in CPU memory with nvme. Accepted for DeepSpeed compatibility;
    no effect yet."""
    fast_init: bool = False
    """Fast optimizer init with nvme. Accepted for DeepSpeed compatibility; no effect yet."""
    ratio: Ratio = 1.0
    """Fraction of the optimizer offloaded. Accepted for DeepSpeed compatibility; no effect yet."""

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> "OffloadConfig":
        if self.device == "nvme" and not self.nvme_path:
            _fail("required when device is 'nvme'", "nvme_path")
        return self


def _check_implemented(zero: "ZeroConfig") -> None:
    """The one place that knows what this version implements: widen it as features land."""
    if zero.stage != "auto" and zero.stage not in SUPPORTED_ZERO_STAGES:
        supported = ", ".join(map(str, sorted(SUPPORTED_ZERO_STAGES)))
        msg = f"{zero.stage} is not implemented yet in this version of zerostack"
        _fail(f"{msg} (supported: {supported})", "stage")
    for name in ("offload_optimizer", "offload_param"):
        offload = getattr(zero, name)
        if offload is not None and offload.device not in _SUPPORTED_OFFLOAD_DEVICES:
            _fail(f"{offload.device!r} is not implemented yet", f"{name}.device")


class ZeroConfig(_Model):
    """The ``zero_optimization`` block."""

    stage: StageOrAuto = 0
    """ZeRO stage: 0 (plain data parallel), 1, 2 or 3; see SUPPORTED_ZERO_STAGES. "auto": the
    lowest stage whose bytes per rank fit the device, chosen at ``initialize``
    (:mod:`zerostack.plan.auto`) and logged."""
    allgather_partitions: bool = True
    """All-gather updated partitions (vs. a series of broadcasts). Accepted for DeepSpeed
    compatibility; no effect yet."""
    allgather_bucket_size: PositiveInt = 500_000_000
    """Elements all-gathered at a time. Accepted for DeepSpeed compatibility; no effect: stages
    1-2 all-gather updated parameters per reduce bucket, stage 3 per module."""
    overlap_comm: bool | None = None
    """Overlap gradient reduction with the backward pass (None: the stage's default). Accepted
    for DeepSpeed compatibility; no effect: reduction always overlaps backward."""
    reduce_scatter: bool = True
    """Stages 1-2: reduce each gradient bucket with a reduce-scatter (true: each rank receives
    its piece, (N-1)/N of the bucket on the wire per rank) or an all-reduce (false: every rank
    receives the whole sum and keeps its piece, twice the bytes), as DeepSpeed's key. Stage 0
    always all-reduces; stage 3 always reduce-scatters. Over gloo a reduce-scatter is an
    all-to-all and a local sum (:mod:`zerostack.comm.grid`), faster than gloo's own."""
    reduce_bucket_size: PositiveInt = 500_000_000
    """Elements per gradient bucket: each bucket is reduced (and, at stages 1-2, its updated
    parameters all-gathered) as one collective, launched during backward; at stage 3 a bucket
    groups whole modules' gradients into one reduce-scatter. When the
    key is not given, buckets hold 4M elements (see ``effective_reduce_bucket_size``): DeepSpeed's
    default of 5e8 makes one bucket of any model under 500M parameters, which leaves nothing to
    overlap with backward."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer. Accepted for DeepSpeed compatibility; no
    effect: gradients always live in contiguous flat buffers."""
    sub_group_size: PositiveInt = 1_000_000_000
    """Elements of fp32 masters stepped at a time with the optimizer offloaded to NVMe (each
    sub-group is read, stepped and written back in turn)."""
    stage3_prefetch_bucket_size: NonNegInt = _aliases(
        50_000_000, "stage3_prefetch_bucket_size", "prefetch_bucket_size"
    )
    """Stage 3: elements of parameters whose all-gather is launched ahead of use, in the order
    recorded on the first step (alias prefetch_bucket_size); 0 disables prefetching. When the
    key is not given, the largest module's parameter count (see
    ``effective_prefetch_bucket_size``): DeepSpeed's default of 5e7 gathers the whole of any
    model under 50M parameters at its first module."""
    stage3_param_persistence_threshold: NonNegInt = _aliases(
        100_000, "stage3_param_persistence_threshold", "param_persistence_threshold"
    )
    """Stage 3: parameters with fewer elements than this stay gathered between uses and are
    refreshed after each step (alias param_persistence_threshold)."""
    stage3_max_live_parameters: NonNegInt = _aliases(
        1_000_000_000, "stage3_max_live_parameters", "max_live_parameters"
    )
    """Stage 3: at most this many parameter elements gathered at once, counting the prefetched
    ones (alias max_live_parameters); as in DeepSpeed it limits what is prefetched, never what
    the running module needs."""
    stage3_max_reuse_distance: NonNegInt = _aliases(
        1_000_000_000, "stage3_max_reuse_distance", "max_reuse_distance"
    )
    """Stage 3: a module done with its parameters keeps those gathered that the recorded order
    uses again within this many elements of gathers (alias max_reuse_distance). When the key is
    not given, 0: released at once (see ``effective_max_reuse_distance``); DeepSpeed's default
    of 1e9 keeps the whole of a model under 0.5B parameters gathered from its forward to its
    backward."""
    stage3_gather_16bit_weights_on_model_save: bool = _aliases(
        False,
        "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
        "gather_16bit_weights_on_model_save",
    )
    """Stage 3: let ``engine.save_16bit_model`` gather the whole 16-bit weights (without it,
    as in DeepSpeed, it writes nothing and returns False) (aliases
    stage3_gather_fp16_weights_on_model_save, gather_16bit_weights_on_model_save)."""
    round_robin_gradients: bool = False
    """Stage 1/2 gradient partitioning order. Accepted for DeepSpeed compatibility; no effect
    yet."""
    elastic_checkpoint: bool = False
    """Accepted for DeepSpeed compatibility; no effect yet."""
    ignore_unused_parameters: bool = True
    """Tolerate parameters that get no gradient. Accepted for DeepSpeed compatibility; no
    effect yet."""
    load_from_fp32_weights: bool = True
    """Restore fp32 master weights from the checkpoint's fp32 copy. Accepted for DeepSpeed
    compatibility; no effect yet."""
    zero_quantized_weights: bool = False
    """Stage 3 (ZeRO++ qwZ): parameters are all-gathered for forward and backward as int8 blocks
    of 32 elements with one bf16 scale each (3.76x fewer bytes than fp32, 1.88x than bf16);
    the gathered weights are within half a step of their block's scale, the masters, optimizer
    and checkpoints stay exact (:mod:`zerostack.zero.quantize`)."""
    zero_quantized_gradients: bool = False
    """Stage 3 (ZeRO++ qgZ): gradients are reduce-scattered as an all-to-all of int8 blocks
    (each rank's contribution within half a step of its block's scale, summed in fp32 by the
    receiving rank), 3.76x fewer bytes than fp32; no error feedback."""
    zero_quantized_gradients_bits: Literal[8, 4] = 8
    """qgZ's value width (a zerostack key): 8, or 4 as DeepSpeed's qgZ sends (two values to a
    byte, scale = max |x| / 7 per block of 32: 7.11x fewer bytes than fp32, each contribution
    within half of that coarser step)."""
    zero_hpz_partition_size: PositiveInt = 1
    """Stage 3 (ZeRO++ hpZ): a training forward's gathers leave each rank its piece of every
    parameter cut this many ways among consecutive dp ranks (one node when it times tp divides
    the ranks per node), and the backward all-gathers within those ranks instead of over all of
    dp: parameter bytes / this size more memory while a forward's parameters await their
    backward. 1: off. Must divide the data-parallel size."""
    offload_optimizer: OffloadConfig | None = None
    """Offload optimizer state (stages 1-3)."""
    offload_param: OffloadConfig | None = None
    """Offload parameters (stage 3 only)."""
    cpu_offload: bool | None = Field(default=None, exclude=True)
    """Deprecated DeepSpeed key: true means offload_optimizer.device "cpu". It is translated
    while parsing, so it always reads None afterwards."""

    @property
    def effective_prefetch_bucket_size(self) -> int | None:
        """``stage3_prefetch_bucket_size`` if given, else None: the largest module's count."""
        given = {"stage3_prefetch_bucket_size"} & self.model_fields_set
        return self.stage3_prefetch_bucket_size if given else None

    @property
    def effective_max_reuse_distance(self) -> int:
        """``stage3_max_reuse_distance`` if given, else 0 (release as soon as done)."""
        given = {"stage3_max_reuse_distance"} & self.model_fields_set
        return self.stage3_max_reuse_distance if given else 0

    @property
    def effective_reduce_bucket_size(self) -> int:
        """``reduce_bucket_size`` if given, else 4M elements (16 MB of fp32 gradients)."""
        if "reduce_bucket_size" in self.model_fields_set:
            return self.reduce_bucket_size
        return DEFAULT_BUCKET_NUMEL

    @field_validator("stage")
    @classmethod
    def _stage_range(cls, v: int | str) -> int | str:
        if v != "auto" and v not in range(4):
            _fail(f"{v} is not one of 0, 1, 2, 3, auto")
        return v

    @model_validator(mode="after")
    def _check(self) -> "ZeroConfig":
        if self.cpu_offload is not None:
            if self.offload_optimizer is not None:
                _fail("deprecated alias of offload_optimizer; give only one", "cpu_offload")
            if self.cpu_offload:
                self.offload_optimizer = OffloadConfig(device="cpu")
            self.cpu_offload = None
        # Rule errors come before "not implemented yet", so they are seen while it still holds.
        if self.offload_param is not None and self.offload_param.device != "none":
            if self.stage not in (3, "auto"):
                _fail(f"only valid with stage 3 (stage is {self.stage})", "offload_param")
        if self.offload_optimizer is not None and self.offload_optimizer.device != "none":
            if self.stage == 0:  # "auto" picks a stage that can
                _fail("needs ZeRO stage 1, 2 or 3 (stage is 0)", "offload_optimizer")
        if self.zero_quantized_weights and self.stage != 3:
            _fail(
                f"quantizes stage 3's parameter all-gathers; set stage 3 (stage is {self.stage})",
                "zero_quantized_weights",
            )
        if self.zero_hpz_partition_size > 1 and self.stage != 3:
            _fail(
                f"partitions stage 3's parameters; set stage 3 (stage is {self.stage})",
                "zero_hpz_partition_size",
            )
        if self.zero_quantized_gradients_bits != 8 and not self.zero_quantized_gradients:
            _fail(
                "sets the width of qgZ's values; set zero_quantized_gradients: true as well",
                "zero_quantized_gradients_bits",
            )
        if self.zero_quantized_gradients and self.stage != 3:
            _fail(
                f"quantizes stage 3's gradient reduce-scatter; set stage 3 (stage is {self.stage})",
                "zero_quantized_gradients",
            )
        _check_implemented(self)
        return self


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


class MonitorConfig(_Model):
    """The ``tensorboard`` and ``csv_monitor`` blocks: write the training metrics (see
    :mod:`zerostack.monitor`) under ``<output_path>/<job_name>/`` on global rank 0."""

    enabled: bool = False
    """Write training metrics."""
    output_path: str = ""
    """Directory for the output ("" means the current directory)."""
    job_name: str = "DeepSpeedJobName"
    """Subdirectory / run name under output_path."""


class WandbConfig(_Model):
    """The ``wandb`` block (DeepSpeed's keys): log the training metrics to a Weights & Biases
    run (``WANDB_MODE=offline`` keeps it on disk)."""

    enabled: bool = False
    """Log to Weights & Biases (needs the wandb package)."""
    group: str | None = None
    """The run's group."""
    team: str | None = None
    """The run's entity (team or user)."""
    project: str = "deepspeed"
    """The run's project."""


class FlopsProfilerConfig(_Model):
    """The ``flops_profiler`` block (DeepSpeed's keys and defaults): profile one step's forward
    with :class:`zerostack.profiling.FlopsProfiler` and print it."""

    enabled: bool = False
    """Profile the forward of step ``profile_step`` and print the profile."""
    recompute_fwd_factor: NonNegFloat = 0.0
    """Share of the forward recomputed in backward (1.0: full activation checkpointing); a
    step's flops are (3 + this) x the forward's."""
    profile_step: NonNegInt = 1
    """The global step to profile (later steps time better: the first ones warm up)."""
    module_depth: Annotated[Int, Field(ge=-1)] = -1
    """Deepest module level in the aggregated profile (-1: every level)."""
    top_modules: PositiveInt = 1
    """Module types listed per level in the aggregated profile."""
    detailed: bool = True
    """Also print the module tree with each module's figures."""
    output_file: str | None = None
    """Write the profile to this file instead of stdout (None: stdout)."""


class CommsLoggerConfig(_Model):
    """The ``comms_logger`` block (DeepSpeed's keys and defaults): summarise every collective by
    op and message size, with latency and bandwidth, printed by
    :func:`zerostack.comm.log_summary` on rank 0."""

    enabled: bool = False
    """Record the collectives (the engine's and zerostack.comm's)."""
    verbose: bool = False
    """Also print each collective as it completes (rank 0)."""
    prof_all: bool = True
    """Record every op; false: only those named in prof_ops."""
    debug: bool = False
    """Name each row with where the op ran too (its grid axis, or the calling function)."""
    prof_ops: list[str] = Field(default_factory=list)
    """Ops recorded when prof_all is false (e.g. ["all_reduce", "all_gather"])."""


# --- top level ------------------------------------------------------------------------------


_KIND_NAMES: dict[Any, str] = {
    object: "any value",
    dict: "a JSON object",
    bool: "true or false",
    str: "a string",
    (int, float): "a number",
}


def _is_kind(value: Any, kind: type | tuple[type, ...]) -> bool:
    if kind is not bool and isinstance(value, bool):  # JSON true is not a number
        return kind is object
    return isinstance(value, kind)


class WatchdogConfig(_Model):
    """The ``watchdog`` block (zerostack's): a rank that stops answering, or ranks waiting in
    different collectives, end the job within ``timeout`` seconds with a report naming who
    stopped where (:mod:`zerostack.watchdog`)."""

    enabled: bool = True
    """Run the watchdog on every rank of a world larger than one."""
    timeout: PositiveFloat | None = None
    """Seconds without a heartbeat, or in one collective, before the job ends (default: 120, or
    the process group's timeout from ``init_distributed(timeout=...)`` when shorter)."""
    interval: PositiveFloat | None = None
    """Seconds between heartbeats and checks (default: timeout / 4, at most 10)."""
    history: PositiveInt = 16
    """Collectives each rank lists in its report."""


class ParallelWriteConfig(_Model):
    """``checkpoint.parallel_write`` (DeepSpeed's; no effect: every rank writes its own file)."""

    pipeline_stage: bool = False
    """DeepSpeed: each pipeline stage writes its own layers' files."""


class CheckpointConfig(_Model):
    """The ``checkpoint`` block: DeepSpeed's I/O options (accepted, no effect) and zerostack's
    automatic checkpoints (:mod:`zerostack.checkpoint.auto_resume`, :mod:`.async_save`)."""

    save_dir: str | None = None
    """Folder of the automatic checkpoints (``auto_resume``, ``save_interval``)."""
    auto_resume: bool = False
    """At ``initialize``, load ``latest`` from ``save_dir`` when there is one (the engine's
    loader continues at the next unseen sample), e.g. after torchrun restarted the job."""
    save_interval: NonNegInt = 0
    """Save to ``save_dir`` every this many optimizer steps, inside ``step()`` (0: never)."""
    keep_last: NonNegInt = 0
    """Keep only the newest this many ``global_step<N>`` tags in ``save_dir`` (0: all); the tag
    ``latest`` names is never removed."""
    async_save: bool = False
    """``save_checkpoint`` (and the automatic saves) copy the state to host memory and write it
    in the background; ``latest`` moves once every rank's files are written and verified."""
    tag_validation: Annotated[
        Literal["Ignore", "Warn", "Fail"],
        BeforeValidator(lambda v: v.capitalize() if isinstance(v, str) else v),
    ] = "Warn"
    """DeepSpeed's check that every rank saves the same tag (no effect)."""
    load_universal: bool = False
    """DeepSpeed's universal-checkpoint load (no effect: every checkpoint loads on any layout)."""
    use_node_local_storage: bool = False
    """DeepSpeed's node-local checkpoint folders (no effect)."""
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    """DeepSpeed's parallel write options (no effect)."""
    writer: dict[str, Any] | None = None
    """DeepSpeed's checkpoint writer block (no effect: safetensors, one file per rank)."""
    pickled_client_state: bool = False
    """``save_checkpoint(client_state=...)`` values that are neither JSON nor tensors (objects
    among a Lightning module's hyper-parameters, say) are pickled into their own file, its
    sha256 in the manifest, and loads unpickle them; false: such a value is refused naming its
    key, and a checkpoint holding them does not load. Unpickling runs code from the file: turn
    it on only for checkpoints you wrote."""

    @model_validator(mode="after")
    def _needs_dir(self) -> "CheckpointConfig":
        if (self.auto_resume or self.save_interval) and not self.save_dir:
            _fail("needed by auto_resume and save_interval", "save_dir")
        return self


class LossSpikeConfig(_Model):
    """The ``loss_spike`` block (zerostack's): when a step's loss stays above ``factor`` times the
    median of the last ``window`` steps' for ``patience`` steps in a row, the engine reloads the
    last checkpoint in ``checkpoint.save_dir`` and goes on with the data after the spike, so the
    window that caused it is skipped (:mod:`zerostack.checkpoint.loss_spike`)."""

    factor: NonNegFloat = 0.0
    """How many times the running median a loss must exceed to count (0: off; above 1 when on).
    A loss that is NaN or infinite always counts."""
    window: PositiveInt = 20
    """Steps in the running median; no loss counts until the window is full."""
    patience: PositiveInt = 1
    """Steps in a row above the bound before rolling back (no automatic save in between)."""
    max_rollbacks: NonNegInt = 3
    """Rollbacks in one run before a spike raises instead (the data is not the cause)."""

    @model_validator(mode="after")
    def _above_one(self) -> "LossSpikeConfig":
        if 0 < self.factor <= 1:
            _fail(f"must be above 1, or 0 for off (got {self.factor:g})", "factor")
        return self


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
    (:mod:`zerostack.config_keys`: no effect, or not supported but given their default), as
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
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO partitioning and offload."""
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    """Tensor (Megatron-style) parallelism."""
    sequence_parallel_size: PositiveInt = 1
    """Ulysses sequence parallelism (DeepSpeed's key): this many neighbouring data-parallel ranks
    read one batch, each a shard of its sequence, and exchange it for a shard of the attention
    heads around attention (see zerostack.sequence). It must divide world / (tp * pp); the
    batch is split over world / (tp * pp * sequence_parallel_size) replicas."""
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


# --- loading --------------------------------------------------------------------------------


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of duplicated keys silently; DeepSpeed rejects them too.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"config: duplicate key {key!r} in JSON")
        out[key] = value
    return out


def _parse_json(text: str, source: str = "") -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config: not valid JSON{source}: {exc}") from None


def load_config(config: Any) -> ZeroStackConfig:
    """Validate ``config``: a dict, a ZeroStackConfig (returned as is), a path to a JSON file
    (str or os.PathLike) or JSON text (a str starting with "{"). Raises only ConfigError."""
    if isinstance(config, ZeroStackConfig):
        return config
    typed = getattr(config, "typed", None)  # engine.config (a ConfigView) is its typed config
    if isinstance(typed, ZeroStackConfig):
        return typed
    if config is None:
        raise ConfigError(
            "config: no config given; pass config=dict, a JSON file path or a JSON string"
        )
    config = read_config(config)
    try:
        return ZeroStackConfig.model_validate(config)
    except ValidationError as exc:
        raise _config_error(exc) from None


def read_config(config: Any) -> dict:
    """The dict a config stands for, not yet validated: a dict as is, a JSON file's path or JSON
    text parsed (duplicate keys refused). Raises only ConfigError."""
    if isinstance(config, str) and config.lstrip().startswith(("{", "[")):
        config = _parse_json(config)
    elif isinstance(config, str | os.PathLike):
        path = os.fsdecode(config)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise ConfigError(f"config: file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config: cannot read {path}: {exc}") from None
        config = _parse_json(text, f" in {path}")
    if not isinstance(config, dict):
        raise ConfigError(f"config: must be a JSON object (a dict), got {type(config).__name__}")
    return config
