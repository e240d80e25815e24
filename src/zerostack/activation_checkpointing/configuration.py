"""What :func:`configure` sets, the one state object, and DeepSpeed's names for the RNG helpers.

The state is module-level because DeepSpeed's API is; it is one object, mutated in place and
never rebound, so every module of the package (and ``zerostack.checkpointing``) sees the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import ActivationCheckpointingConfig, ConfigError, load_config
from ..tensor_parallel import get_rng_tracker, model_parallel_seed
from ..tensor_parallel.random import RNGStatesTracker
from ..topology import Topology
from .placement import _Contiguous


@dataclass(frozen=True)
class Settings:
    """What :func:`configure` set; the defaults are plain checkpointing."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    mpu: Topology | None = None

    @property
    def partitions(self) -> bool:
        """Whether inputs are really split: partitioning on and a tp size above 1."""
        return self.partition_activations and self.mpu is not None and self.mpu.tp > 1


@dataclass
class _State:
    settings: Settings = field(default_factory=Settings)
    configured: bool = False
    contiguous: _Contiguous | None = None
    seconds: dict[str, float] = field(default_factory=lambda: {"forward": 0.0, "recompute": 0.0})
    calls: dict[str, int] = field(default_factory=lambda: {"forward": 0, "recompute": 0})


_STATE = _State()  # module-level because DeepSpeed's API is; everything lives in this one object


def configure(
    mpu_: Topology | None = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Set how :func:`checkpoint` keeps its inputs (DeepSpeed's signature).

    ``deepspeed_config`` (a ZeroStackConfig, a dict, a JSON path or text) supplies the defaults
    from its ``activation_checkpointing`` block; arguments that are not None win. ``mpu_`` is the
    job's :class:`~zerostack.topology.Topology` (its tp axis is the partitioning group)::

        checkpointing.configure(mpu_=engine.topology, deepspeed_config=cfg, checkpoint_in_cpu=True)
    """
    block = (
        load_config(deepspeed_config).activation_checkpointing
        if deepspeed_config is not None
        else ActivationCheckpointingConfig()
    )
    if mpu_ is not None and not isinstance(mpu_, Topology):
        raise TypeError(
            f"checkpointing.configure: mpu_ must be a zerostack Topology (engine.topology), "
            f"got {type(mpu_).__name__}"
        )

    def pick(arg, default):
        return default if arg is None else arg

    new = Settings(
        partition_activations=bool(pick(partition_activations, block.partition_activations)),
        cpu_checkpointing=bool(pick(checkpoint_in_cpu, block.cpu_checkpointing)),
        contiguous_memory_optimization=bool(
            pick(contiguous_checkpointing, block.contiguous_memory_optimization)
        ),
        number_checkpoints=pick(num_checkpoints, block.number_checkpoints),
        synchronize_checkpoint_boundary=bool(
            pick(synchronize, block.synchronize_checkpoint_boundary)
        ),
        profile=bool(pick(profile, block.profile)),
        mpu=mpu_,
    )
    n = new.number_checkpoints
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ConfigError(f"activation_checkpointing.number_checkpoints: must be >= 1, got {n!r}")
    if new.partition_activations and mpu_ is None:
        raise ConfigError(
            "activation_checkpointing.partition_activations: needs the tensor-parallel group; "
            "call checkpointing.configure(mpu_=topology, ...)"
        )
    if new.contiguous_memory_optimization and n is None:
        raise ConfigError(
            "activation_checkpointing.number_checkpoints: must be set when "
            "contiguous_memory_optimization is on (it sizes the buffer)"
        )
    _STATE.settings, _STATE.configured = new, True
    _STATE.contiguous = _Contiguous(n) if new.contiguous_memory_optimization else None


def is_configured() -> bool:
    """Whether :func:`configure` was called (DeepSpeed's name)."""
    return _STATE.configured


def settings() -> Settings:
    return _STATE.settings


def reset() -> None:
    """Drop the contiguous buffers and start counting checkpoints afresh (DeepSpeed's meaning:
    call it between forwards that have no backward, as in evaluation). Settings stay."""
    if _STATE.contiguous is not None:
        _STATE.contiguous.reset()


def unconfigure() -> None:
    """Forget :func:`configure` and the timers: back to plain checkpointing."""
    vars(_STATE).update(vars(_State()))  # in place: recompute.py holds this same object


def timers(reset: bool = False) -> dict[str, float]:
    """Seconds and calls of checkpointed forwards and recomputations (counted with ``profile``)."""
    out = {f"{k}_seconds": v for k, v in _STATE.seconds.items()}
    out.update({f"{k}_calls": v for k, v in _STATE.calls.items()})
    if reset:
        _STATE.seconds = dict.fromkeys(_STATE.seconds, 0.0)
        _STATE.calls = dict.fromkeys(_STATE.calls, 0)
    return out


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """zerostack's tp RNG tracker (DeepSpeed's name)."""
    return get_rng_tracker()


def model_parallel_cuda_manual_seed(seed: int, topology: Topology | None = None) -> None:
    """:func:`zerostack.tensor_parallel.model_parallel_seed` on ``topology`` or the configured
    mpu (DeepSpeed's name and one-argument call)."""
    topology = topology or _STATE.settings.mpu
    if topology is None:
        raise ValueError(
            "model_parallel_cuda_manual_seed: no topology; pass one or call "
            "checkpointing.configure(mpu_=topology) first"
        )
    model_parallel_seed(seed, topology)
