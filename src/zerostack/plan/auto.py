"""``"auto"`` in the config, resolved at ``initialize`` for the current world, and logged.

* ``zero_optimization.stage: "auto"``: the lowest ZeRO stage (the least communication) whose
  bytes per rank fit ``fraction`` of the device's memory (:mod:`zerostack.estimate`: the model
  states of the parameters this rank holds, and, when the model describes itself, activations);
  stages an offload needs are the only ones considered.
* ``train_micro_batch_size_per_gpu`` / ``gradient_accumulation_steps: "auto"`` with
  ``train_batch_size`` given: the largest micro-batch (the fewest micro-steps) whose activations
  fit beside the model states; the other follows. This needs a model that describes itself
  (zerostack's GPT, a Hugging Face model's ``config``); otherwise "auto" keeps DeepSpeed's
  meaning of "not given".
"""

from __future__ import annotations

import logging
import os

from torch import nn

from ..config import ConfigError, ZeroStackConfig
from ..core.precision import Precision
from ..estimate import (
    EstimateError,
    Layout,
    Transformer,
    count_parameters,
    model_states,
    stage_activation_bytes,
)
from ..estimate.memory import OPTIMIZER_STATE_BYTES, PRECISION_BYTES
from .hardware import host_memory

log = logging.getLogger("zerostack")
GB = 1e9


def describe_module(module: nn.Module) -> Transformer | None:
    """A GPT-style description of ``module`` if it has one: zerostack's reference GPT (its
    ``cfg``) or a Hugging Face model (its ``config``); None otherwise."""
    cfg = getattr(module, "cfg", None)
    if cfg is not None and hasattr(cfg, "n_layer") and hasattr(cfg, "d_model"):
        return Transformer.from_gpt_config(cfg)
    hf = getattr(module, "config", None)
    if hf is not None and hasattr(hf, "to_dict"):
        try:
            return Transformer.from_hf_config(hf.to_dict())
        except EstimateError:
            return None
    return None


def device_memory(topology) -> float:
    """Bytes one rank may use: its GPU's memory, or the host's shared by this node's ranks."""
    device = topology.device
    if device.type == "cuda":
        import torch

        return float(torch.cuda.get_device_properties(device).total_memory)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", topology.world_size))
    return host_memory() / max(1, local)


def _layout(cfg: ZeroStackConfig, topology, stage: int) -> Layout:
    zero = cfg.zero_optimization
    precision = Precision.from_config(cfg).name
    opt = (cfg.optimizer.type if cfg.optimizer is not None else "adam").lower()
    if opt == "sgd" and cfg.optimizer.params.momentum:
        opt = "momentum"  # SGD keeps a momentum buffer only with momentum
    return Layout(
        dp=topology.dp,
        stage=stage,
        precision=precision,
        optimizer=opt if opt in OPTIMIZER_STATE_BYTES else "adam",
        offload_optimizer=zero.offload_optimizer.device if zero.offload_optimizer else "none",
        offload_param=zero.offload_param.device if zero.offload_param else "none",
    )


def _bytes(counts, model, cfg, topology, stage: int, micro: int, gas: int) -> float:
    """Device bytes per rank at ``stage`` with ``micro`` x ``gas`` micro-batches, for the
    ``(trained, frozen, _)`` parameter ``counts`` of this rank's module."""
    trained, frozen, _ = counts
    layout = _layout(cfg, topology, stage)
    total = model_states(trained, layout, frozen=frozen).device
    if model is not None:
        total += stage_activation_bytes(
            model,
            micro,
            tp=topology.tp,
            pp=topology.pp,
            in_flight=min(topology.pp, gas),
            sequence_parallel=topology.tp > 1,
            dtype_bytes=PRECISION_BYTES[layout.precision],
            flash=True,
        )
    return total


def resolve(
    cfg: ZeroStackConfig,
    module: nn.Module,
    topology,
    *,
    memory_bytes: float | None = None,
    fraction: float = 0.9,
) -> ZeroStackConfig:
    """``cfg`` with its "auto" values chosen (unchanged when it has none)."""
    zero = cfg.zero_optimization
    if zero.stage != "auto" and not cfg.planned_batch:
        return cfg
    budget = fraction * (memory_bytes if memory_bytes is not None else device_memory(topology))
    model = describe_module(module)
    counts = count_parameters(module)
    micro = cfg.train_micro_batch_size_per_gpu or 1
    gas = cfg.gradient_accumulation_steps or 1
    stage = zero.stage
    if stage == "auto":
        stages = [0, 1, 2, 3]
        if zero.offload_optimizer is not None and zero.offload_optimizer.device != "none":
            stages = [s for s in stages if s >= 1]
        if zero.offload_param is not None and zero.offload_param.device != "none":
            stages = [3]
        need = {s: _bytes(counts, model, cfg, topology, s, micro, gas) for s in stages}
        fits = [s for s in stages if need[s] <= budget]
        if not fits:
            last = stages[-1]
            raise ConfigError(
                f"zero_optimization.stage: auto finds no stage that fits: stage {last} needs "
                f"{need[last] / GB:.3g} GB per rank, {budget / GB:.3g} GB usable"
            )
        stage = fits[0]
        log.info(
            "zero_optimization.stage: auto -> %d (%.3g GB per rank of %.3g GB usable)",
            stage,
            need[stage] / GB,
            budget / GB,
        )
    update: dict = {"zero_optimization": zero.model_copy(update={"stage": stage})}
    tbs = cfg.train_batch_size
    if cfg.planned_batch and tbs is not None and model is not None:
        per_rank, rem = divmod(tbs, topology.dp)
        if rem:
            raise ConfigError(
                f"train_batch_size: {tbs} is not divisible by the data-parallel size {topology.dp}"
            )
        sizes = [m for m in range(per_rank, 0, -1) if per_rank % m == 0]
        if "train_micro_batch_size_per_gpu" not in cfg.planned_batch:
            sizes = [micro]
        elif (
            "gradient_accumulation_steps" not in cfg.planned_batch
            and cfg.gradient_accumulation_steps
        ):
            sizes = [per_rank // cfg.gradient_accumulation_steps]
        chosen = next(
            (
                m
                for m in sizes
                if _bytes(counts, model, cfg, topology, stage, m, per_rank // m) <= budget
            ),
            sizes[-1],
        )
        update["train_micro_batch_size_per_gpu"] = chosen
        update["gradient_accumulation_steps"] = per_rank // chosen
        log.info(
            "train_micro_batch_size_per_gpu: auto -> %d, gradient_accumulation_steps: auto -> %d",
            chosen,
            per_rank // chosen,
        )
    return cfg.model_copy(update=update)
