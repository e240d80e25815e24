"""Model-state bytes per rank: what zerostack holds for a layout, and the ZeRO paper's accounting.

:func:`model_states` is zerostack's layout (what ``engine.memory_breakdown()`` reports);
:func:`zero_paper_bytes` is Rajbhandari et al. (SC'20), Figure 1: 16-bit parameters and
gradients, K = 12 bytes of Adam state per parameter. zerostack differs at stages 2 and 3 by
keeping the gradient shard in fp32 (2 bytes per parameter / dp more, in exchange for gradients
accumulated without 16-bit rounding).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from ..zero.partition import piece_numel

PRECISION_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}

# Optimizer state bytes per trained parameter (fp32 state, as torch keeps it).
OPTIMIZER_STATE_BYTES = {
    "adam": 8,
    "adamw": 8,
    "lamb": 8,
    "adagrad": 4,
    "lion": 4,
    "momentum": 4,
    "sgd": 0,
}


OFFLOAD = ("none", "cpu", "nvme")

GIB = 2**30


class EstimateError(ValueError):
    """A layout or model description that cannot be estimated (one line naming what)."""


@dataclass(frozen=True)
class Layout:
    """One rank's place in the grid and what it keeps where. With expert parallelism ``dp``
    is the expert-data-parallel degree (the ranks holding the same experts) and ``ep`` the
    ranks splitting the experts: what all of them hold is held by ``dp * ep`` ranks. ``sp``:
    Ulysses sequence-parallel ranks, a part of dp (each holds a shard of the sequence)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    sp: int = 1
    stage: int = 0
    precision: str = "fp32"
    optimizer: str = "adam"
    offload_optimizer: str = "none"
    offload_param: str = "none"

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "ep", "sp"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise EstimateError(f"{name}: {getattr(self, name)!r} is not a positive integer")
        if self.dp % self.sp:
            raise EstimateError(f"sp: {self.sp} does not divide the dp axis of {self.dp} ranks")
        if self.stage not in (0, 1, 2, 3):
            raise EstimateError(f"stage: {self.stage!r} is not one of 0, 1, 2, 3")
        if self.precision not in PRECISION_BYTES:
            raise EstimateError(f"precision: {self.precision!r} is not one of fp32, fp16, bf16")
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            known = ", ".join(OPTIMIZER_STATE_BYTES)
            raise EstimateError(f"optimizer: {self.optimizer!r} is not one of {known}")
        for name in ("offload_optimizer", "offload_param"):
            if getattr(self, name) not in OFFLOAD:
                raise EstimateError(f"{name}: {getattr(self, name)!r} is not none, cpu or nvme")
        if self.offload_optimizer != "none" and self.stage == 0:
            raise EstimateError("offload_optimizer: needs ZeRO stage 1, 2 or 3 (stage is 0)")
        if self.offload_param != "none" and self.stage != 3:
            raise EstimateError(f"offload_param: only with ZeRO stage 3 (stage is {self.stage})")

    @property
    def world(self) -> int:
        return self.dp * self.ep * self.tp * self.pp


@dataclass
class ModelStates:
    """Bytes one rank holds for its model states: on the device and in host memory (offload).
    In files (NVMe) nothing is counted here, as ``engine.memory_breakdown()`` counts nothing."""

    params: int = 0
    grads: int = 0
    master: int = 0
    optimizer: int = 0
    scratch: int = 0  # one gradient bucket, kept between steps for the next backward
    host: dict[str, int] = field(default_factory=dict)

    @property
    def device(self) -> int:
        return self.params + self.grads + self.master + self.optimizer + self.scratch

    @property
    def total(self) -> int:
        return self.device + sum(self.host.values())

    def by_kind(self) -> dict[str, int]:
        """Device and host bytes together, per kind (as ``engine.memory_breakdown()`` sums)."""
        kinds = ("params", "grads", "master", "optimizer", "scratch")
        return {k: getattr(self, k) + self.host.get(k, 0) for k in kinds}

    def as_dict(self) -> dict:
        return {**asdict(self), "device": self.device, "total": self.total}

    def __add__(self, other: ModelStates) -> ModelStates:
        """Both parts' bytes (one kept bucket: the larger)."""
        kinds = ("params", "grads", "master", "optimizer")
        out = ModelStates(**{k: getattr(self, k) + getattr(other, k) for k in kinds})
        out.scratch = max(self.scratch, other.scratch)
        for k in self.host.keys() | other.host.keys():
            out.host[k] = self.host.get(k, 0) + other.host.get(k, 0)
        return out


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def model_states(
    trained: int,
    layout: Layout,
    frozen: int = 0,
    *,
    sizes: list[int] | None = None,
    persistent: int = 0,
    bucket: int | None = None,
    experts: int = 0,
) -> ModelStates:
    """Model-state bytes per rank for ``trained`` (and ``frozen``) parameters held by this
    rank's tensor- and pipeline-parallel slice, as zerostack lays them out.

    ============  ============  ==================  =========================  ==============
    stage         parameters    gradients           fp32 master (16-bit run)   optimizer state
    ============  ============  ==================  =========================  ==============
    0             c x P         c x P               4 x P                      k x P
    1             c x P         c x P               4 x P / dp                 k x P / dp
    2             c x P         4 x P / dp (fp32)   4 x P / dp                 k x P / dp
    3             c x P / dp    4 x P / dp (fp32)   4 x P / dp                 k x P / dp
    ============  ============  ==================  =========================  ==============

    ``c``: bytes of the compute dtype; ``k``: the optimizer's state bytes per parameter. In fp32
    training the master is the parameter (or its piece) itself, 0 bytes extra. Offloaded to the
    CPU, the master (a separate copy even in fp32), the optimizer state and the fp32 gradient
    piece live in host memory; to NVMe, master and state live in files. Shards are rounded up to
    whole pieces (padding), as zerostack pads: given the trained tensors' ``sizes``, stage 3
    pads each tensor's pieces to whole 16-byte blocks
    (:func:`~zerostack.zero.partition.piece_numel`). ``persistent``: elements of stage-3
    parameters below ``stage3_param_persistence_threshold``, also held whole on every rank.
    ``bucket``: elements of the largest gradient bucket (``reduce_bucket_size``, or the model
    when smaller): at stages 1-2 with dp > 1 one bucket's buffer in the compute dtype is kept
    between steps for the next backward's reduction (``scratch``: zerostack's pool on the CPU,
    the caching allocator's block on a GPU); None leaves it out.

    ``experts``: how many of ``trained`` are this rank's experts (at ``layout.ep`` > 1). Their
    state is cut over the ``dp`` ranks holding the same experts; the rest, which every ep rank
    holds, over all ``dp * ep`` ranks (stages 1-3), each its own buckets.
    """
    if trained < 0 or frozen < 0 or not 0 <= experts <= trained:
        raise EstimateError(
            f"parameters: {trained} trained ({experts} experts), {frozen} frozen; need >= 0"
        )
    if layout.ep > 1 and experts and layout.stage > 0:
        if sizes is not None or persistent:
            raise EstimateError("sizes, persistent: not with experts (give the counts alone)")
        own = replace(layout, ep=1)
        shared = model_states(trained - experts, replace(own, dp=layout.dp * layout.ep))
        out = shared + model_states(experts, own, frozen)
        if bucket is not None and layout.stage < 3:  # the largest bucket of either part
            biggest = min(bucket, max(experts, trained - experts))
            out.scratch = PRECISION_BYTES[layout.precision] * biggest
        return out
    c = PRECISION_BYTES[layout.precision]
    k = OPTIMIZER_STATE_BYTES[layout.optimizer]
    dp, stage = layout.dp, layout.stage
    shard = _ceil_div(trained, dp) if stage > 0 else trained  # this rank's trained elements
    if sizes is not None and stage == 3:
        shard = sum(piece_numel(n, dp) for n in sizes)
    out = ModelStates()
    out.params = c * (shard + _ceil_div(frozen, dp) if stage == 3 else trained + frozen)
    if stage == 3:
        out.params += c * persistent
    out.grads = c * trained if stage < 2 else 4 * shard
    if bucket is not None and stage in (1, 2) and dp > 1:
        out.scratch = c * min(bucket, trained)
    separate_master = c != 4
    where = layout.offload_optimizer
    if where == "none":
        out.master = 4 * shard if separate_master else 0
        out.optimizer = k * shard
    else:
        if where == "cpu":
            out.host["master"] = 4 * shard
            out.host["optimizer"] = k * shard
        out.host["grads"] = 4 * shard  # the fp32 gradient piece the host optimizer steps with
        if stage >= 2:
            out.grads = 0  # stages 2-3 keep it only there
        if where == "nvme" and stage == 3:
            out.host.pop("grads")  # stage 3 keeps its gradients in files too
    if layout.offload_param != "none":
        out.params = 0  # pieces read in for each gather; persistent ones are not estimated
        if layout.offload_param == "cpu":
            out.host["params"] = c * _ceil_div(trained + frozen, dp)
    return out


def zero_paper_bytes(params: float, dp: int, stage: int, k: int = 12) -> float:
    """The ZeRO paper's model-state bytes per rank (16-bit parameters and gradients, ``k`` bytes
    of optimizer state per parameter including the fp32 master): Psi = params, N = dp."""
    if stage == 0:
        return (2 + 2 + k) * params
    if stage == 1:
        return (2 + 2) * params + k * params / dp
    if stage == 2:
        return 2 * params + (2 + k) * params / dp
    if stage == 3:
        return (2 + 2 + k) * params / dp
    raise EstimateError(f"stage: {stage!r} is not one of 0, 1, 2, 3")
