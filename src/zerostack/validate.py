"""The one validate step of ``initialize``: the rules that span features, run once on the
resolved config, before any work.

The grid is built first (its sizes are checked as it is: :func:`zerostack.compose`), then
:func:`validate` chooses what ``"auto"`` leaves open (:mod:`zerostack.plan.auto`) and runs every
rule on the result, so a stage that "auto" picks meets the same rules as one asked for. A
combination of settings either passes or is refused with one ``ConfigError`` naming the
settings that conflict and why. What comes back (:class:`Resolved`: the config as resolved, the
grid, the batch, the ZeRO stage the strategy runs) is what the engine is built from; nothing
below resolves it again.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from .activation_checkpointing import model_checkpointed_layers
from .config import ConfigError, ZeroStackConfig, grad_accum_refusal
from .core.precision import Precision, autocast_dtype
from .moe.utils import is_moe_param
from .pipeline.module import PipelineModule
from .pipeline.schedule import DeadlockError, ScheduleError
from .pipeline.simulate import check_schedule
from .plan.auto import resolve as resolve_auto
from .topology import Topology
from .watchdog import default_store
from .zero.stage3.params import is_sharded

log = logging.getLogger("zerostack")


@dataclass(frozen=True)
class Resolved:
    """What :func:`validate` resolved: the config with "auto" chosen, the grid, the batch
    ``(train_batch_size, micro-batch per rank, gradient_accumulation_steps)`` and the ZeRO stage
    the strategy runs."""

    config: ZeroStackConfig
    topology: Topology
    batch: tuple[int, int, int]
    stage: int
    forward_only: bool


def validate(
    cfg: ZeroStackConfig, model: nn.Module, topo: Topology, *, optimizer, lr_scheduler
) -> Resolved:
    """``cfg`` resolved for ``model`` on ``topo`` and checked against every cross-feature rule;
    ``optimizer`` / ``lr_scheduler``: what ``initialize`` was given (None: none)."""
    cfg = resolve_auto(cfg, model, topo)  # "auto" stage / micro-batch, chosen and logged
    stage = cfg.zero_optimization.stage
    refusal = grad_accum_refusal(cfg, stage)
    if refusal is not None:
        raise ConfigError(f"{', '.join(refusal[0])}: {refusal[1]}")
    forward_only = optimizer is None and cfg.optimizer is None
    _check_optimizer(cfg, optimizer, lr_scheduler, forward_only)
    if topo.ep > 1 and cfg.zero_optimization.zero_hpz_partition_size > 1:
        raise ConfigError(
            f"zero_optimization.zero_hpz_partition_size with MoE ep_size {topo.ep}: hpZ's "
            "secondary partitions are not built beside expert parallelism yet"
        )
    params = list(model.parameters())
    if any(is_sharded(p) for p in params) and any(is_moe_param(p) for p in params):
        raise ConfigError(
            "zero.Init with a MoE model: a gate's weight is read before zero.Init's pieces are "
            "gathered (not yet); build the model outside zero.Init"
        )
    if (
        cfg.activation_checkpointing.cpu_checkpointing
        and getattr(model, "supports_gradient_checkpointing", False)
        and not model_checkpointed_layers(model)
    ):
        raise ConfigError(
            "activation_checkpointing.cpu_checkpointing: the Hugging Face model checkpoints no "
            "layer, so nothing would be kept on the CPU; call model.gradient_checkpointing_enable"
            "() before initialize"
        )
    _check_deepspeed_files(cfg, topo, stage, forward_only, model)
    _check_random_ltd(cfg, topo, model)
    _check_torch_autocast(cfg, topo, stage, model)
    _check_muon(cfg, topo, model)
    _check_sixteen_bit_masters(cfg, stage, optimizer)
    batch = cfg.resolve_batch(topo.data_parallel_size)  # batch errors before any work
    if isinstance(model, PipelineModule):
        _check_pipeline(model, cfg, stage, batch[2])
    return Resolved(cfg, topo, batch, stage, forward_only)


def _check_deepspeed_files(cfg, topo: Topology, stage: int, forward_only: bool, model) -> None:
    """``checkpoint.deepspeed_files: true`` where DeepSpeed's files cannot be written: refused."""
    from .checkpoint.deepspeed_layout import refusal

    why = "a forward-only engine" if forward_only else refusal(cfg, topo, stage, model)
    if cfg.checkpoint.deepspeed_files and why:
        raise ConfigError(f"checkpoint.deepspeed_files with {why}")


def _check_sixteen_bit_masters(cfg, stage: int, optimizer) -> None:
    """DeepSpeed's rules for ``bf16.bf16_master_weights_and_grads``, ``bf16.bf16_optimizer_states``
    and ``fp16.fp16_master_weights_and_grads``: ZeRO 1-3; fp32 moments beside 16-bit masters only
    in the CPU Adam (the optimizer offloaded to host memory). Each refusal names its keys."""
    bf16, fp16, zero = cfg.bf16, cfg.fp16, cfg.zero_optimization
    flags = [
        ("bf16.bf16_master_weights_and_grads", bf16.bf16_master_weights_and_grads, bf16.enabled),
        ("bf16.bf16_optimizer_states", bf16.bf16_optimizer_states, bf16.enabled),
        ("fp16.fp16_master_weights_and_grads", fp16.fp16_master_weights_and_grads, fp16.enabled),
    ]
    on = [(key, enabled) for key, flag, enabled in flags if flag]
    if not on:
        return
    key, enabled = on[0]
    block = key.split(".")[0]
    offload = zero.offload_optimizer.device if zero.offload_optimizer is not None else "none"
    cpu_adam = (
        optimizer is None
        and cfg.optimizer is not None
        and cfg.optimizer.type in ("Adam", "AdamW")
        and not cfg.optimizer.params.torch_adam
    )
    why = None
    if not enabled:
        why = f"{key} without {block}.enabled: the weights are not {block}"
    elif stage not in (1, 2, 3):
        why = f"{key} at zero_optimization.stage {stage}: only ZeRO stages 1-3 keep masters"
    elif bf16.bf16_optimizer_states and not bf16.bf16_master_weights_and_grads:
        why = "bf16.bf16_optimizer_states without bf16.bf16_master_weights_and_grads"
    elif offload == "nvme":
        why = f"{key} with offload_optimizer on NVMe: 16-bit masters in files (not yet)"
    elif not bf16.bf16_optimizer_states and offload != "cpu":
        other = " or bf16.bf16_optimizer_states" if block == "bf16" else ""
        why = (
            f"{key} without the optimizer offloaded to the CPU: fp32 moments beside 16-bit "
            "masters are the CPU Adam's (DeepSpeed's rule); set zero_optimization."
            f'offload_optimizer.device to "cpu"{other}'
        )
    elif offload == "cpu" and not cpu_adam:
        why = f"{key} with the optimizer offloaded: only the config's Adam or AdamW (the CPU Adam)"
    if why:
        raise ConfigError(why)


def _check_muon(cfg, topo: Topology, model) -> None:
    """``optimizer.type`` Muon where its pieces are known to meet as whole matrices (ZeRO 0-3
    over dp and tp, under a pipeline, the optimizer in memory, host memory or files); the rest
    refused, naming why."""
    if cfg.optimizer is None or cfg.optimizer.type != "Muon":
        return
    zero = cfg.zero_optimization
    why = None
    if topo.ep > 1:
        why = f"expert parallelism (ep {topo.ep}): experts are not put "
    elif zero.offload_param is not None and zero.offload_param.device == "nvme":
        why = "offload_param on NVMe: pieces read from files are not put "
    if why:
        raise ConfigError(f"optimizer.type Muon with {why}together whole for Newton-Schulz yet")


def _check_torch_autocast(cfg, topo: Topology, stage: int, model) -> None:
    """``torch_autocast``: served in bf16, where DeepSpeed reduces every gradient in the dtype
    zerostack reduces it in (the bf16 block; fp32 weights at stage 0, which reduces in
    ``communication_data_type``); the rest refused, naming why."""
    import importlib

    block = cfg.torch_autocast
    if not block.enabled:
        return
    for name in block.lower_precision_safe_modules or ():
        package, _, cls = name.rpartition(".")
        try:
            getattr(importlib.import_module(package), cls)
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigError(
                f"torch_autocast.lower_precision_safe_modules: cannot import {name!r} ({e})"
            ) from None
    dtype = Precision(autocast_dtype(cfg, topo.device)).name  # the device this run uses
    why = None
    if dtype != "bf16":
        why = (
            f"torch_autocast.dtype {dtype}: DeepSpeed scales the loss with torch's GradScaler "
            "there; zerostack serves bf16 autocast (or use the fp16 block)"
        )
    elif cfg.fp16.enabled:
        why = "torch_autocast.dtype bf16 with fp16.enabled: the weights are fp16"
    elif not cfg.bf16.enabled and stage > 0:
        why = (
            f"torch_autocast with fp32 weights at zero_optimization.stage {stage}: DeepSpeed "
            "reduces the lower-precision-safe modules' gradients in bf16, the others in "
            "fp32, zerostack one dtype per bucket (not yet); use the bf16 block or stage 0"
        )
    elif cfg.communication_data_type is not None:
        why = (
            "torch_autocast with communication_data_type: DeepSpeed then reduces by the "
            "parameters' dtype and ignores it; leave it out"
        )
    elif cfg.zero_optimization.zero_quantized_weights:
        why = "torch_autocast with zero_optimization.zero_quantized_weights (DeepSpeed refuses it)"
    elif isinstance(model, PipelineModule):
        why = "torch_autocast with a PipelineModule: its stages' forward does not run under it"
    if why:
        raise ConfigError(why)


def _check_random_ltd(cfg, topo: Topology, model) -> None:
    """Random-LTD: driven by DeepSpeed's ``convert_to_random_ltd``, on layers that hold whole
    sequences (each rank draws the kept tokens from its own generator)."""
    from .config.load import served_as_deepspeed

    if cfg.data_efficiency.random_ltd() is None:
        return
    key = "data_efficiency.data_routing.random_ltd"
    if not served_as_deepspeed(cfg):
        raise ConfigError(
            f"{key}: DeepSpeed's convert_to_random_ltd(engine, ...) drives it; "
            "initialize through zerostack.compat.deepspeed"
        )
    split = [f"{k} {n}" for k, n in (("tp", topo.tp), ("sp", topo.sp), ("pp", topo.pp)) if n > 1]
    if split or isinstance(model, PipelineModule):
        raise ConfigError(
            f"{key} with {', '.join(split) or 'a pipeline'}: ranks sharing a sequence would "
            "each draw their own kept tokens (random-LTD runs over data parallelism only)"
        )


def _check_optimizer(cfg: ZeroStackConfig, optimizer, lr_scheduler, forward_only: bool) -> None:
    if optimizer is not None and cfg.optimizer is not None:
        raise ConfigError("optimizer: given both as an argument and in the config; pass only one")
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ConfigError("scheduler: given both as an argument and in the config; pass only one")
    # no optimizer anywhere: DeepSpeed's forward-only engine (Lightning's and Transformers'
    # evaluation without training): every parameter is held as a frozen one, no masters
    if forward_only and (lr_scheduler is not None or cfg.scheduler is not None):
        raise ConfigError(
            "scheduler: given without an optimizer (none passed, no optimizer block): "
            "a forward-only engine has no learning rate to schedule"
        )


def _check_pipeline(module: PipelineModule, cfg: ZeroStackConfig, stage: int, gas: int) -> None:
    """The config's ``pipeline`` block against the module, and the schedule against the batch."""
    pcfg, fields = cfg.pipeline, cfg.pipeline.model_fields_set
    if pcfg.stages != "auto" and pcfg.stages != module.num_stages:
        raise ConfigError(
            f"pipeline.stages: {pcfg.stages} but the PipelineModule has {module.num_stages} stages"
        )
    if pcfg.virtual_stages != module.virtual_stages:
        raise ConfigError(
            f"pipeline.virtual_stages: {pcfg.virtual_stages} but the "
            f"PipelineModule has {module.virtual_stages}"
        )
    if "partition" in fields and pcfg.partition != module.partition_method:
        raise ConfigError(
            f"pipeline.partition: {pcfg.partition!r} but the PipelineModule was "
            f"partitioned by {module.partition_method!r}"
        )
    interval = module.activation_checkpoint_interval
    if (
        "activation_checkpoint_interval" in fields
        and pcfg.activation_checkpoint_interval != interval
    ):
        raise ConfigError(
            f"pipeline.activation_checkpoint_interval: "
            f"{pcfg.activation_checkpoint_interval} but the PipelineModule has "
            f"{interval}"
        )
    try:  # the simulator runs the executor's communication model: what it refuses would hang
        check_schedule(pcfg.schedule, module.num_stages, gas, module.virtual_stages)
    except (ValueError, ScheduleError, DeadlockError) as exc:
        raise ConfigError(
            f"pipeline.schedule: {pcfg.schedule!r} cannot run {module.num_stages} stages x "
            f"{module.virtual_stages} chunks with gradient_accumulation_steps={gas}: {exc}"
        ) from None


_ROUNDS = itertools.count()  # agreements so far in this process: the same count on every rank


def agreed(grid: Topology | None, check, *args, **kwargs):
    """``check(*args, **kwargs)``, with a refusal on any rank raised on every rank.

    Part of a model is one rank's own (a pipeline stage's layers), so a rule may refuse on some
    ranks and pass on others, which would go on into the engine's first collective and wait
    there for the ranks that left. Where a grid exists before the check (``grid``: the one
    given, or the model's), every rank posts its refusal or "" in the job's store and reads
    the others'; the first rank's refusal is raised everywhere, as it was worded. The store,
    not a collective: nothing on a device, no process group used before the engine's. Without a
    grid the check builds it, and what it refuses (sizes, the config) every rank refuses alike.
    """
    if grid is None:
        return check(*args, **kwargs)
    try:
        out, mine = check(*args, **kwargs), None
    except ConfigError as exc:
        out, mine = None, exc
    refusals = [r for r in _posted(str(mine) if mine else "", grid) if r]
    if refusals:
        if mine is not None and str(mine) == refusals[0]:
            raise mine
        raise ConfigError(refusals[0])
    return out


def _posted(text: str, grid: Topology) -> list[str]:
    """Every rank's ``text``, in rank order, through the store ``torch.distributed`` was
    initialised with (only this rank's when it has none, or one that keeps no keys: torch's
    fake store, for the fake process group)."""
    store = default_store()
    if store is None:
        return [text]
    key = f"/zerostack/agreed/{next(_ROUNDS)}/"
    try:
        store.set(f"{key}{dist.get_rank()}", text)
    except RuntimeError as exc:  # torch's FakeStore: "Not implemented"
        log.debug("initialize: no agreement through the store (%s)", exc)
        return [text]
    keys = [f"{key}{r}" for r in range(dist.get_world_size())]
    store.wait(keys, grid.timeout)
    return [store.get(k).decode() for k in keys]
