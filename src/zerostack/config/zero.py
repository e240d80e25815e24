"""Precision (``fp16``, ``bf16``, ``data_types``) and the ``zero_optimization`` block with its
offload sub-blocks."""

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    field_validator,
    model_validator,
)

from .base import (
    _SUPPORTED_OFFLOAD_DEVICES,
    DEFAULT_BUCKET_NUMEL,
    SUPPORTED_ZERO_STAGES,
    Int,
    NonNegFloat,
    NonNegInt,
    PositiveFloat,
    PositiveInt,
    Ratio,
    StageOrAuto,
    _aliases,
    _fail,
    _Model,
)

if TYPE_CHECKING:  # (top imports this module)
    from .top import ZeroStackConfig

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
    fp16_master_weights_and_grads: bool = False
    """Keep the masters and the gradients they are handed in fp16 (ZeRO 1-3 with the optimizer
    offloaded to the CPU, as DeepSpeed: its CPU Adam keeps fp32 moments)."""


class BF16Config(_Model):
    """The ``bf16`` block (DeepSpeed also accepts the key ``bfloat16``)."""

    enabled: bool = False
    """Train in bf16 with fp32 master weights (no loss scaling needed)."""
    immediate_grad_update: bool = False
    """Accepted for DeepSpeed compatibility; no effect (see zerostack.config.keys)."""
    bf16_master_weights_and_grads: bool = False
    """Keep the masters and the gradients they are handed in bf16 (ZeRO 1-3): 2 bytes each per
    parameter instead of 4. As DeepSpeed, without ``bf16_optimizer_states`` the optimizer must
    be offloaded (its CPU Adam keeps fp32 moments)."""
    bf16_optimizer_states: bool = False
    """Keep the optimizer's moments in bf16 too (needs ``bf16_master_weights_and_grads``)."""


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
    matters with a GPU; :mod:`zerostack.core.pinned`)."""
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


DEFAULT_LEAF_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)
"""``zero_optimization.leaf_module.classes`` by default (DeepSpeed 0.19.8's)."""


def _one_or_list(v: Any) -> Any:
    return [v] if isinstance(v, str) else v


class LeafModuleConfig(_Model):
    """``zero_optimization.leaf_module``: the modules stage 3 gathers and releases as one unit,
    their descendants included (:mod:`zerostack.zero.stage3.leaves`). ``initialize`` flags them at
    every stage (only stage 3 reads the flag), as DeepSpeed does."""

    classes: Annotated[list[str], BeforeValidator(_one_or_list)] = Field(
        default_factory=lambda: list(DEFAULT_LEAF_CLASSES)
    )
    """Class names (``"MixtralSparseMoeBlock"``, or qualified) whose instances are leaves;
    DeepSpeed's default: Mixtral's, Qwen2-MoE's and Qwen3-MoE's sparse MoE blocks."""
    names: Annotated[list[str], BeforeValidator(_one_or_list)] = Field(default_factory=list)
    """Module names, as ``model.named_modules()`` gives them (a name that matches nothing is
    warned about)."""
    name_suffixes: Annotated[list[str], BeforeValidator(_one_or_list)] = Field(
        default_factory=list
    )
    """Ends of module names (``"mlp.experts"``; one that matches nothing is warned about)."""


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
    all-to-all and a local sum (:mod:`zerostack.comm.gloo`), faster than gloo's own."""
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
    key is not given, twice the largest module's parameter count (see
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
    memory_efficient_linear: bool = True
    """Stage 3's linear saves the weight parameter for backward, not its gathered storage
    (DeepSpeed's memory-efficient form). Always so here: false (torch's linear, which keeps
    every gathered weight until backward) has no effect."""
    zero_quantized_weights: bool = False
    """Stage 3 (ZeRO++ qwZ): parameters are all-gathered for forward and backward as int8 blocks
    of 32 elements with one bf16 scale each (3.76x fewer bytes than fp32, 1.88x than bf16);
    the gathered weights are within half a step of their block's scale, the masters, optimizer
    and checkpoints stay exact (:mod:`zerostack.zero.stage3.quantize`)."""
    zero_quantized_nontrainable_weights: bool = False
    """Stage 3 (DeepSpeed's Mixed Precision ZeRO++): each frozen parameter's piece is quantized
    once at initialize into qwZ's int8 blocks and kept so (1.0625 bytes an element), gathered
    as it is held; the frozen weights become their quantized values, trained ones are exact
    (:mod:`zerostack.zero.stage3.frozen_pieces`)."""
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
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    """Stage 3's leaf modules (gathered as one unit); see :class:`LeafModuleConfig`."""
    offload_optimizer: OffloadConfig | None = None
    """Offload optimizer state (stages 1-3)."""
    offload_param: OffloadConfig | None = None
    """Offload parameters (stage 3 only)."""
    cpu_offload: bool | None = Field(default=None, exclude=True)
    """Deprecated DeepSpeed key: true means offload_optimizer.device "cpu". It is translated
    while parsing, so it always reads None afterwards."""

    @property
    def effective_prefetch_bucket_size(self) -> int | None:
        """``stage3_prefetch_bucket_size`` if given, else None: twice the largest module's
        count (``zero.coordinator.PREFETCH_UNITS``)."""
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
        if self.zero_quantized_nontrainable_weights:
            if self.stage != 3:
                _fail(
                    f"quantizes stage 3's frozen pieces; set stage 3 (stage is {self.stage})",
                    "zero_quantized_nontrainable_weights",
                )
            if self.offload_param is not None and self.offload_param.device != "none":
                _fail(
                    "keeps frozen pieces quantized in device memory; offload_param moves them "
                    "out: use one or the other",
                    "zero_quantized_nontrainable_weights",
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
