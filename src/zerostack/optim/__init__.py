"""Optimizers built from the config's ``optimizer`` block, and DeepSpeed's LR schedules."""

from __future__ import annotations

import torch

from .cpu_adam import CPUAdam
from .lamb import Lamb
from .lion import Lion
from .lr_schedules import SCHEDULERS, build_lr_scheduler
from .muon import Muon

__all__ = [
    "SCHEDULERS",
    "CPUAdam",
    "Lamb",
    "Lion",
    "Muon",
    "build_lr_scheduler",
    "build_optimizer",
]


def _fused_ok(groups: list[dict]) -> bool:
    # The fused kernels need fp32/16-bit floating params on CPU or CUDA; ours are flat fp32 masters.
    return all(p.device.type in ("cpu", "cuda") for g in groups for p in g["params"])


def build_optimizer(
    spec, groups: list[dict], *, offload: bool = False, fp32_states: bool = True
) -> torch.optim.Optimizer:
    """A torch optimizer over ``groups`` from the config's ``optimizer`` block.

    DeepSpeed's meaning of ``type``: "Adam" steps with decoupled weight decay (AdamW) unless
    ``adam_w_mode`` is false, "AdamW" always does. The fused implementation is used where torch
    has one for the device (on CPU it is several times faster than the default loop). With the
    optimizer offloaded, Adam and AdamW are :class:`CPUAdam` (as DeepSpeed uses its CPU Adam).
    ``torch_adam`` asks for torch.optim's default implementation instead, offloaded or not (as
    DeepSpeed's ``torch_adam`` does); ``fp32_states``: its moments in fp32 beside 16-bit
    masters (false with ``bf16_optimizer_states``). "Lion" is :class:`Lion` (DeepSpeed's
    FusedLion, or its CPU Lion when offloaded: one update), "Adagrad" torch's Adagrad
    (DeepSpeed's choice without offload; its CPU Adagrad is the same update at torch's
    defaults). Both update each element
    from its own gradient and state alone, so they step shards as they step whole tensors.
    "Lamb" is :class:`Lamb` (DeepSpeed's FusedLamb, whose trust ratio here is each parameter's).
    "Muon" is :class:`Muon` over groups :func:`.muon.muon_groups` split (whose pieces of
    matrices the engine describes to it).
    """
    p = spec.params
    if spec.type in ("Adam", "AdamW"):
        decoupled = spec.type == "AdamW" or p.adam_w_mode
        if offload and not p.torch_adam:
            return CPUAdam(
                groups,
                lr=p.lr,
                betas=tuple(p.betas),
                eps=p.eps,
                weight_decay=p.weight_decay,
                amsgrad=p.amsgrad,
                adamw_mode=decoupled,
                fp32_optimizer_states=fp32_states,
            )
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        kwargs = dict(
            lr=p.lr, betas=tuple(p.betas), eps=p.eps, weight_decay=p.weight_decay, amsgrad=p.amsgrad
        )
        if _fused_ok(groups) and not p.torch_adam:
            kwargs["fused"] = True
        return cls(groups, **kwargs)
    if spec.type == "SGD":
        return torch.optim.SGD(
            groups,
            lr=p.lr,
            momentum=p.momentum,
            dampening=p.dampening,
            weight_decay=p.weight_decay,
            nesterov=p.nesterov,
            maximize=p.maximize,
            foreach=p.foreach,
        )
    if spec.type == "Lion":  # DeepSpeed's FusedLion and DeepSpeedCPULion: the same update
        return Lion(groups, lr=p.lr, betas=tuple(p.betas), weight_decay=p.weight_decay)
    if spec.type == "Adagrad":  # DeepSpeed builds torch's (DeepSpeedCPUAdagrad is torch's too)
        return torch.optim.Adagrad(
            groups,
            lr=p.lr,
            lr_decay=p.lr_decay,
            weight_decay=p.weight_decay,
            initial_accumulator_value=p.initial_accumulator_value,
            eps=p.eps,
            foreach=p.foreach,
            maximize=p.maximize,
        )
    if spec.type == "Lamb":  # DeepSpeed's FusedLamb: the trust ratio per parameter here
        return Lamb(
            groups,
            lr=p.lr,
            bias_correction=p.bias_correction,
            betas=tuple(p.betas),
            eps=p.eps,
            eps_inside_sqrt=p.eps_inside_sqrt,
            weight_decay=p.weight_decay,
            max_coeff=p.max_coeff,
            min_coeff=p.min_coeff,
        )
    if spec.type == "Muon":  # groups split by muon_groups, each half's settings in it
        return Muon(groups, adam_w_mode=p.adam_w_mode)
    raise ValueError(f"optimizer.type: {spec.type!r} is not supported")
