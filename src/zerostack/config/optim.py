"""The ``optimizer`` and ``scheduler`` blocks, with DeepSpeed's types and parameters."""

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BeforeValidator,
    Field,
    SkipValidation,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .base import (
    Beta,
    Int,
    NonNegFloat,
    NonNegInt,
    PositiveFloat,
    PositiveInt,
    Ratio,
    WarmupType,
    _fail,
    _list_to_tuple,
    _Model,
)

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
    set_grad_none: bool = True
    """FusedAdam's: its ``zero_grad`` sets gradients to None. The engine releases them after
    every step either way, so either value trains the same."""


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
    maximize: bool = False
    """torch's: ascend the objective instead."""
    foreach: bool | None = None
    """torch's choice of implementation (None: torch picks); the figures are the same."""

    @model_validator(mode="after")
    def _nesterov(self) -> "SGDParams":
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            _fail("requires momentum > 0 and dampening 0", "nesterov")
        return self


class LionParams(_Model):
    """``optimizer.params`` for Lion (DeepSpeed's ``FusedLion``, or ``DeepSpeedCPULion`` with the
    optimizer offloaded: the same update, :class:`zerostack.optim.Lion`)."""

    lr: NonNegFloat = 1e-3
    """Learning rate."""
    betas: Annotated[tuple[Beta, Beta], BeforeValidator(_list_to_tuple)] = (0.9, 0.999)
    """The first interpolates the gradient into the update's sign, the second the momentum."""
    weight_decay: NonNegFloat = 0.0
    """Decoupled weight decay: each step multiplies the weights by ``1 - lr * weight_decay``."""
    set_grad_none: bool = True
    """FusedLion's: its ``zero_grad`` sets gradients to None. The engine releases them after
    every step either way, so either value trains the same."""
    fp32_optimizer_states: bool = True
    """DeepSpeedCPULion's: states in fp32 or in the parameters' dtype. The optimizer steps the
    fp32 masters, so both give fp32 states (as DeepSpeed's, which also steps its masters)."""


class AdagradParams(_Model):
    """``optimizer.params`` for Adagrad (DeepSpeed builds ``torch.optim.Adagrad``, or
    ``DeepSpeedCPUAdagrad`` with the optimizer offloaded, which is torch's Adagrad without
    learning-rate decay and with a zero initial accumulator)."""

    lr: NonNegFloat = 1e-2
    """Learning rate."""
    eps: PositiveFloat = 1e-10
    """Term added to the denominator for numerical stability."""
    weight_decay: NonNegFloat = 0.0
    """L2 penalty (added to the gradient)."""
    lr_decay: NonNegFloat = 0.0
    """torch's: the learning rate divided by ``1 + (step - 1) * lr_decay``."""
    initial_accumulator_value: NonNegFloat = 0.0
    """torch's: where the sum of squared gradients starts."""
    maximize: bool = False
    """torch's: ascend the objective instead."""
    foreach: bool | None = None
    """torch's choice of implementation (None: torch picks); the figures are the same."""
    amsgrad: bool = False
    """DeepSpeedCPUAdagrad's argument; Adagrad has no AMSGrad variant (DeepSpeed's kernel
    ignores it), so true is refused."""
    fp32_optimizer_states: bool = True
    """DeepSpeedCPUAdagrad's: the optimizer steps the fp32 masters, so both give fp32 states."""

    @field_validator("amsgrad")
    @classmethod
    def _no_amsgrad(cls, v: bool) -> bool:
        if v:
            _fail("Adagrad has no AMSGrad variant (DeepSpeed's CPU Adagrad ignores it)")
        return v


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


class OneCycleParams(_Model):
    """``scheduler.params`` for OneCycle (DeepSpeed's 1Cycle: the lr up and down once, then
    decaying; Adam's first beta the other way)."""

    cycle_min_lr: NonNegFloat
    """The cycle's lower lr (required)."""
    cycle_max_lr: NonNegFloat
    """The cycle's upper lr (required)."""
    decay_lr_rate: NonNegFloat = 0.0
    """After the cycle, the lr is cycle_min_lr / (1 + rate * steps / decay_step_size)."""
    cycle_first_step_size: PositiveInt = 2000
    """Steps from the lower lr to the upper one."""
    cycle_second_step_size: NonNegInt | None = None
    """Steps back down (None: cycle_first_step_size)."""
    cycle_first_stair_count: NonNegInt = 0
    """Stairs on the way up (0: continuous)."""
    cycle_second_stair_count: NonNegInt | None = None
    """Stairs on the way down (None: cycle_first_stair_count)."""
    decay_step_size: NonNegInt = 0
    """Steps per unit of decay after the cycle (0: no decay)."""
    cycle_momentum: bool = True
    """Cycle the first beta (optimizers with betas only)."""
    cycle_min_mom: Beta = 0.8
    """The first beta at the cycle's top lr."""
    cycle_max_mom: Beta = 0.9
    """The first beta at the cycle's lower lr."""
    decay_mom_rate: NonNegFloat = 0.0
    """After the cycle, the first beta is cycle_max_mom * (1 + rate * steps / decay_step_size)."""
    last_batch_iteration: Annotated[Int, Field(ge=-1)] = -1
    """Index of the last batch when resuming; -1 for a fresh start."""


class LRRangeTestParams(_Model):
    """``scheduler.params`` for LRRangeTest (the lr grows from lr_range_test_min_lr)."""

    lr_range_test_min_lr: NonNegFloat = 1e-3
    """The starting lr."""
    lr_range_test_step_size: PositiveInt = 2000
    """Steps per unit of growth."""
    lr_range_test_step_rate: NonNegFloat = 1.0
    """lr = min_lr * (1 + rate * steps / step_size)."""
    lr_range_test_staircase: bool = False
    """Grow in whole stairs of step_size steps."""
    last_batch_iteration: Annotated[Int, Field(ge=-1)] = -1
    """Index of the last batch when resuming; -1 for a fresh start."""


class LambParams(_Model):
    """``optimizer.params`` for Lamb (DeepSpeed's ``FusedLamb``, :class:`zerostack.optim.Lamb`):
    the trust ratio per parameter."""

    lr: NonNegFloat = 1e-3
    """Learning rate."""
    bias_correction: bool = True
    """Scale the step by ``sqrt(1 - beta2^t) / (1 - beta1^t)``."""
    betas: Annotated[tuple[Beta, Beta], BeforeValidator(_list_to_tuple)] = (0.9, 0.999)
    """Coefficients of the running averages of the gradient and its square."""
    eps: PositiveFloat = 1e-8
    """Term added to the denominator."""
    eps_inside_sqrt: bool = False
    """Add ``eps`` under the square root instead of after it."""
    weight_decay: NonNegFloat = 0.0
    """Added to the update times the weights, before the trust ratio."""
    max_coeff: NonNegFloat = 10.0
    """The largest trust ratio."""
    min_coeff: NonNegFloat = 0.01
    """The smallest trust ratio."""
    amsgrad: bool = False
    """FusedLamb's argument; it has no AMSGrad variant, so true is refused."""

    @field_validator("amsgrad")
    @classmethod
    def _no_amsgrad(cls, v: bool) -> bool:
        if v:
            _fail("FusedLamb does not support the AMSGrad variant")
        return v

    @model_validator(mode="after")
    def _coeff_order(self) -> "LambParams":
        if self.min_coeff > self.max_coeff:
            _fail(f"{self.min_coeff} is above max_coeff {self.max_coeff}", "min_coeff")
        return self


class MuonParams(_Model):
    """``optimizer.params`` for Muon (DeepSpeed's ``MuonWithAuxAdam``,
    :class:`zerostack.optim.Muon`): Muon for the weight matrices, an Adam for the rest (which
    parameters take which: :func:`zerostack.optim.muon.muon_groups`)."""

    lr: NonNegFloat | None = None
    """Both halves' learning rate, unless ``muon_lr`` / ``adam_lr`` is given (unset: 0.02 for
    Muon, 3e-4 for Adam, DeepSpeed's defaults)."""
    muon_lr: NonNegFloat | None = None
    """The Muon half's learning rate (over ``lr``)."""
    adam_lr: NonNegFloat | None = None
    """The auxiliary Adam's learning rate (over ``lr``)."""
    momentum: Beta = 0.95
    """Muon's momentum (Nesterov's, always)."""
    weight_decay: NonNegFloat = 0.0
    """Both halves': Muon's decoupled; Adam's decoupled with ``adam_w_mode``, else L2."""
    ns_method: Literal["gram", "standard"] = "gram"
    """Newton-Schulz on the Gram matrix (fp16 where the device has it, else fp32) or the
    standard quintic iteration (bf16), as DeepSpeed runs them."""
    betas: Annotated[tuple[Beta, Beta], BeforeValidator(_list_to_tuple)] = (0.9, 0.95)
    """The auxiliary Adam's coefficients."""
    eps: PositiveFloat = 1e-10
    """The auxiliary Adam's term added to the denominator."""
    adam_w_mode: bool = True
    """The auxiliary Adam's weight decay decoupled (AdamW), else added to the gradient."""
    per_head_muon: bool = False
    """DeepSpeed's: orthogonalise each attention head's rows apart. Not supported yet: true is
    refused."""

    @field_validator("per_head_muon")
    @classmethod
    def _no_per_head(cls, v: bool) -> bool:
        if v:
            _fail("not supported yet (each projection is orthogonalised whole)")
        return v

    @property
    def muon_rate(self) -> float:
        """The Muon half's learning rate."""
        return next(x for x in (self.muon_lr, self.lr, 0.02) if x is not None)

    @property
    def adam_rate(self) -> float:
        """The auxiliary Adam's learning rate."""
        return next(x for x in (self.adam_lr, self.lr, 3e-4) if x is not None)


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

    _PARAMS = {
        "Adam": AdamParams,
        "AdamW": AdamParams,
        "SGD": SGDParams,
        "Lion": LionParams,
        "Adagrad": AdagradParams,
        "Lamb": LambParams,
        "Muon": MuonParams,
    }
    _CASE_INSENSITIVE = True  # DeepSpeed lower-cases optimizer names

    type: Literal["Adam", "AdamW", "SGD", "Lion", "Adagrad", "Lamb", "Muon"]
    """Optimizer name, case-insensitive on input ("adamw" becomes "AdamW")."""
    params: Annotated[
        AdamParams | SGDParams | LionParams | AdagradParams | LambParams | MuonParams,
        SkipValidation,
    ] = Field(default=None, validate_default=True)
    """Optimizer arguments, checked against the type's own keys (AdamParams, SGDParams,
    LionParams, AdagradParams, LambParams or MuonParams)."""

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
        "OneCycle": OneCycleParams,
        "LRRangeTest": LRRangeTestParams,
    }

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]
    """Scheduler name (case-sensitive, as in DeepSpeed)."""
    params: Annotated[
        WarmupLRParams
        | WarmupDecayLRParams
        | WarmupCosineLRParams
        | OneCycleParams
        | LRRangeTestParams,
        SkipValidation,
    ] = Field(default=None, validate_default=True)
    """Scheduler arguments, checked against the type's own keys."""
