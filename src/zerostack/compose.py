"""``initialize``: the composition step. From a model, a config and the world it builds, in order:
the topology (given, the model's, an ``mpu``'s or the config's; a plain model is split for tp
here), the optimizer's parameter groups, activation checkpointing, the ZeRO strategy and optimizer
inside the engine (:class:`~zerostack.engine.Engine`, or the pipeline engine for a
:class:`~zerostack.pipeline.PipelineModule`), and the data loader.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

from . import activation_checkpointing
from .comm import comms_logger
from .comm import configure as configure_comms
from .comm.grid import comm_for
from .config import ConfigError, ZeroStackConfig, load_config
from .config.keys import warn_no_effect, warn_pageable_offload
from .core.pinned import can_pin
from .data.sampler import ResumableSampler
from .engine import Engine
from .moe import MoE
from .moe.sync import divide_expert_grads_by_ep
from .mpu import check_mpu_groups, mpu_sizes
from .optim import CPUAdam, build_lr_scheduler, build_optimizer
from .optim.muon import muon_groups
from .pipeline import PipelineModule, PipelineRunner
from .sequence import shard_sequence
from .sequence.check import wires_sequence
from .tensor_parallel.autotp import POLICIES, model_type
from .tensor_parallel.autotp import parallelize as autotp_parallelize
from .topology import Topology
from .validate import agreed, validate
from .world import default_timeout, init_distributed
from .zero.stage3.leaves import apply_leaf_config


def _param_groups(model: nn.Module, optimizer, model_parameters) -> list[dict]:
    """Trainable parameters as optimizer groups, from the optimizer, model_parameters or model."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError("optimizer: it already has state; pass a freshly built optimizer")
        raw = optimizer.param_groups
    elif model_parameters is not None:
        items = list(model_parameters)
        raw = items if items and isinstance(items[0], dict) else [{"params": items}]
    else:
        raw = [{"params": list(model.parameters())}]
    in_model = {id(p): name for name, p in model.named_parameters()}
    seen: set[int] = set()
    groups = []
    for i, group in enumerate(raw):
        if "params" not in group:
            raise ValueError(f"model_parameters[{i}]: a parameter group needs a 'params' entry")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        kept = []
        for p in params:
            if id(p) not in in_model:
                raise ValueError(
                    f"model_parameters[{i}]: a parameter of shape {tuple(p.shape)} "
                    "is not in the model"
                )
            if id(p) in seen:
                raise ValueError(
                    f"model_parameters[{i}]: parameter {in_model[id(p)]!r} is in two groups"
                )
            seen.add(id(p))
            if p.requires_grad:
                kept.append(p)
        groups.append({**group, "params": kept})
    return groups


def _model_topology(model: nn.Module) -> Topology | None:
    """The topology the model's tensor-parallel layers were built on (None for a plain model)."""
    for m in model.modules():
        topo = getattr(m, "topology", None)
        if isinstance(topo, Topology):
            return topo
    return None


def _topology(model: nn.Module, cfg: ZeroStackConfig, topology, mpu) -> Topology:
    """The one grid of the job: given, or the model's, or built from ``mpu`` / the config; every
    source that names a tp size must agree, and a plain model is split here if tp > 1."""
    built = _model_topology(model)
    want_tp = cfg.tensor_parallel.autotp_size or None
    sources = []
    if want_tp:
        sources.append(("tensor_parallel.autotp_size", want_tp))
    sp = cfg.sequence_parallel_size
    if mpu is not None:
        mpu_tp, mpu_pp, mpu_sp = mpu_sizes(mpu)
        sources.append(("mpu.get_model_parallel_world_size()", mpu_tp))
        if mpu_sp > 1:
            if "sequence_parallel_size" in cfg.model_fields_set and sp != mpu_sp:
                raise ConfigError(
                    f"sequence_parallel_size: {sp} disagrees with the mpu's sequence-parallel "
                    f"size ({mpu_sp})"
                )
            sp = mpu_sp
    mpu_topo = getattr(mpu, "topology", None)  # zerostack's own mpu carries its grid
    topo = topology or built or (mpu_topo if isinstance(mpu_topo, Topology) else None)
    if topo is not None:
        sources.append(("the topology", topo.tp))
    for name, size in sources[1:]:
        if size != sources[0][1]:
            raise ConfigError(
                f"{sources[0][0]}: tensor-parallel size {sources[0][1]} disagrees with "
                f"{name} ({size})"
            )
    ep = _expert_parallel_size(model)
    if topo is None:
        tp = sources[0][1] if sources else 1
        pp = mpu_pp if mpu is not None else 1
        world = torch.distributed.get_world_size()
        for key, size in (("sequence_parallel_size", sp), ("MoE ep_size", ep)):
            if world % (tp * pp) or (world // (tp * pp)) % size:
                raise ConfigError(
                    f"{key}: {size} does not divide the data-parallel ranks, world {world} / "
                    f"(tp {tp} * pp {pp})"
                )
        topo = Topology.build(tp=tp, pp=pp, sp=sp, ep=ep, ring=cfg.ring_parallel_size)
    elif ep != topo.ep and not (ep == 1 and isinstance(model, PipelineModule)):
        # (a pipeline stage without MoE layers runs on its grid's ep axis all the same)
        raise ConfigError(f"MoE ep_size: the model's layers have {ep}, the topology ep {topo.ep}")
    elif sp != topo.sp and ("sequence_parallel_size" in cfg.model_fields_set or sp > 1):
        raise ConfigError(
            f"sequence_parallel_size: {sp} disagrees with the topology's sp ({topo.sp})"
        )
    ring = cfg.ring_parallel_size
    if ring != topo.ring and ("ring_parallel_size" in cfg.model_fields_set or ring > 1):
        raise ConfigError(
            f"ring_parallel_size: {cfg.ring_parallel_size} disagrees with the topology's ring "
            f"({topo.ring})"
        )
    if mpu is not None:
        check_mpu_groups(mpu, topo)
    if built is not None and built.tp != topo.tp:
        raise ConfigError(
            f"model: its tensor-parallel layers were built for tp={built.tp}, the topology has "
            f"tp={topo.tp}"
        )
    _bind_experts(model, topo)
    wire_ulysses = topo.sp > 1 and wires_sequence(model, topo, built)
    specs = cfg.tensor_parallel.partition_config
    if built is None and (topo.tp > 1 or wire_ulysses):
        if specs is None and callable(getattr(model, "parallelize", None)):
            model.parallelize(topo)
        elif specs is not None or model_type(model) is not None:  # the specs (first, as in
            try:  # DeepSpeed), or the per-architecture table
                autotp_parallelize(model, topo, specs)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        else:
            raise ConfigError(
                f"tensor_parallel.autotp_size: tp={topo.tp} needs a tensor-parallel model: build "
                "it from zerostack.tensor_parallel layers, give it a parallelize(topology) "
                f"method, or pass a Hugging Face model of a known type ({', '.join(POLICIES)})"
            )
    return topo


def _expert_parallel_size(model: nn.Module) -> int:
    """The ``ep_size`` of the model's MoE layers (1 without any); they must agree."""
    sizes = {m.ep_size for m in model.modules() if isinstance(m, MoE)}
    if len(sizes) > 1:
        raise ConfigError(f"MoE ep_size: the model's layers disagree ({sorted(sizes)})")
    return sizes.pop() if sizes else 1


def _bind_experts(model: nn.Module, topo: Topology) -> None:
    """MoE layers exchange tokens over the grid's ep axis; at ep > 1 the experts' gradients are
    divided by ep (:func:`zerostack.moe.sync.divide_expert_grads_by_ep`)."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for m in layers:
        m.set_topology(topo)
    if topo.ep > 1:  # what combines with it is checked by zerostack.validate
        divide_expert_grads_by_ep(model, topo)


def _host_threads_for_offload(cfg: ZeroStackConfig, topo: Topology) -> None:
    """On a GPU node with the optimizer offloaded, the host steps it (CPUAdam) while the cores
    sit idle: torchrun's ``OMP_NUM_THREADS=1`` would leave it one thread. Give each local rank
    its share of the cores instead, as DeepSpeed's launcher does (an explicit
    ``torch.set_num_threads`` above one is kept)."""
    offload = cfg.zero_optimization.offload_optimizer
    if offload is None or offload.device == "none" or topo.device.type != "cuda":
        return
    if torch.get_num_threads() > 1:
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    share = max(1, (os.cpu_count() or 1) // local)
    if share > 1:
        torch.set_num_threads(share)
        logging.getLogger("zerostack").info(
            "offload_optimizer: %d host threads per rank for the optimizer step", share
        )


def _optimizer_factory(optimizer, cfg: ZeroStackConfig):
    """A function from flat fp32 groups to the optimizer that steps them."""
    if isinstance(optimizer, torch.optim.Optimizer):

        def rebind(flat_groups):  # keep the user's object (and any scheduler built on it)
            on_device = [p for flat in flat_groups for p in flat["params"] if not p.is_cpu]
            if isinstance(optimizer, CPUAdam) and on_device:
                raise ConfigError(
                    f"optimizer: CPUAdam steps masters in host memory, these are on "
                    f"{on_device[0].device}; set zero_optimization.offload_optimizer.device to "
                    f'"cpu" (or pass torch.optim.AdamW)'
                )
            for group, flat in zip(optimizer.param_groups, flat_groups, strict=True):
                group["params"] = flat["params"]
            return optimizer

        return rebind
    if callable(optimizer):
        return optimizer
    offload = cfg.zero_optimization.offload_optimizer
    offloaded = offload is not None and offload.device != "none"
    fp32_states = not cfg.bf16.bf16_optimizer_states  # beside 16-bit masters: the CPU Adam's
    return lambda flat_groups: build_optimizer(
        cfg.optimizer, flat_groups, offload=offloaded, fp32_states=fp32_states
    )


def _no_optimizer(flat_groups):
    """A forward-only engine's optimizer: none (it has nothing to step)."""
    return None


def _scheduler_factory(lr_scheduler, cfg: ZeroStackConfig):
    if lr_scheduler is not None:
        return lr_scheduler
    if cfg.scheduler is not None:
        params = cfg.scheduler.params.model_dump()
        return lambda opt: build_lr_scheduler(opt, cfg.scheduler.type, params)
    return None


def _dataloader(dataset: Dataset, engine: Engine, collate_fn) -> DataLoader:
    topo, cfg = engine.topology, engine.config
    sampler = ResumableSampler(  # DistributedSampler's order; checkpoints keep its position
        dataset,
        num_replicas=topo.data_parallel_size,  # the sp ranks of a batch read the same samples
        rank=topo.data_parallel_rank,
        shuffle=True,
        seed=cfg.seed,
        drop_last=cfg.dataloader_drop_last,
    )
    return DataLoader(
        dataset,
        batch_size=engine.batch[1],
        sampler=sampler,
        collate_fn=collate_fn if topo.sp == 1 else _sequence_shards(collate_fn, topo),
        drop_last=cfg.dataloader_drop_last,
        # Each iter(loader) draws a seed from this generator, else from the global RNG: a resumed
        # run, which calls iter() again after load_checkpoint, would then draw its dropout masks
        # out of step with the uninterrupted run.
        generator=torch.Generator().manual_seed(cfg.seed),
        # page-locked batches on a GPU, so the copy to the device need not wait (non_blocking)
        pin_memory=engine.topology.device.type == "cuda" and can_pin(),
    )


def _sequence_shards(collate_fn, topo: Topology):
    """The loader's collate, then this sp rank's shard of the sequence (dim 1) of each tensor."""
    collate = collate_fn or default_collate

    def collate_shard(samples):
        return shard_sequence(collate(samples), topo)

    return collate_shard


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer=None,
    model_parameters=None,
    training_data: Dataset | None = None,
    lr_scheduler=None,
    distributed_port: int | None = None,
    mpu=None,
    dist_init_required: bool | None = None,
    collate_fn=None,
    config=None,
    config_params=None,
    topology: Topology | None = None,
    engine_type: type[Engine] = Engine,
    unknown_keys: Literal["refuse", "as_deepspeed"] = "refuse",
):
    """DeepSpeed's ``initialize``: returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    ``config`` is a dict, a JSON file path or a JSON string (also read from
    ``args.deepspeed_config``). ``optimizer`` may be a torch optimizer built over the model's
    parameters, or a callable taking parameter groups; else the config's ``optimizer`` block is
    used. ``lr_scheduler`` likewise (an object or a callable taking the optimizer). With neither
    an optimizer nor an optimizer block, the engine runs forward only (DeepSpeed's inference
    engine): parameters sharded as the stage says, no fp32 masters, and ``backward``/``step``
    refuse; ``load_checkpoint`` reads the weights of any checkpoint. ``engine_type``: the
    engine class built (``zerostack.initialize`` builds DeepSpeed's, with its own accessors:
    :mod:`zerostack.compat.deepspeed.runtime.engine`). ``unknown_keys``: what a key nobody
    knows does (:func:`~zerostack.config.load_config`): refused, or, for ``deepspeed.initialize``
    served by zerostack, ignored with a warning where DeepSpeed ignores it.
    """
    if model is None:
        raise ValueError("model: initialize needs a model")
    if config is None:
        config = config_params
    if config is None and args is not None:  # DeepSpeed's add_config_arguments' flags
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    cfg = load_config(config, unknown_keys=unknown_keys)
    if dist_init_required is not False:
        init_distributed(timeout=default_timeout(watchdog=cfg.watchdog))
    # a refusal on some ranks only (a pipeline stage's layers) is every rank's (validate.agreed)
    topo = agreed(topology or _model_topology(model), _topology, model, cfg, topology, mpu)
    if cfg.log_level is not None:  # DeepSpeed sets its own logger's level from the key
        logging.getLogger("zerostack").setLevel(cfg.log_level.upper())
    warn_no_effect(cfg, topo.global_rank)
    warn_pageable_offload(cfg, topo.device, topo.global_rank)
    # "auto" chosen, then every cross-feature rule on the result (before any work)
    resolved = agreed(
        topo, validate, cfg, model, topo, optimizer=optimizer, lr_scheduler=lr_scheduler
    )
    cfg, forward_only = resolved.config, resolved.forward_only
    apply_leaf_config(model, cfg.zero_optimization.leaf_module)  # stage 3's leaf modules
    groups = [] if forward_only else _param_groups(model, optimizer, model_parameters)
    if cfg.optimizer is not None and cfg.optimizer.type == "Muon":
        groups = muon_groups(model, groups, cfg.optimizer.params)  # DeepSpeed's two halves
    opt_factory = _no_optimizer if forward_only else _optimizer_factory(optimizer, cfg)
    sched = _scheduler_factory(lr_scheduler, cfg)
    if cfg.activation_checkpointing.model_fields_set:  # else a user's own configure() stands
        activation_checkpointing.configure(mpu_=topo, deepspeed_config=cfg)
        activation_checkpointing.adopt_model_checkpointing(model)  # a Hugging Face model's
    # DeepSpeed's comms_logger block: the engine's collectives (its grid's CommLog, set-up
    # included) are summarised with zerostack.comm's while the logger is enabled
    configure_comms(deepspeed_config=cfg)
    comms_logger.follow(comm_for(topo).log)
    _host_threads_for_offload(cfg, topo)
    runner = None  # micro-batch by micro-batch, or a pipeline's schedule
    if isinstance(model, PipelineModule):
        runner = PipelineRunner(model, cfg, comm_for(topo))
    engine = engine_type(
        module=model,
        config=cfg,
        topology=topo,
        batch=resolved.batch,
        stage=resolved.stage,
        param_groups=groups,
        optimizer_factory=opt_factory,
        lr_scheduler=sched,
        runner=runner,
    )
    loader = _dataloader(training_data, engine, collate_fn) if training_data is not None else None
    engine.set_dataloader(loader)  # train_batch() reads it; checkpoints keep its position
    engine.start(cfg)  # step callbacks, the watchdog, checkpoint.auto_resume
    return engine, engine.optimizer, loader, engine.lr_scheduler
