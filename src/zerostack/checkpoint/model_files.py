"""Whole-model weights from a sharded run (collectives: every rank calls them): the full fp32
weights (``engine.full_state_dict()``) and DeepSpeed's 16-bit model file
(``engine.save_16bit_model``, ``engine._zero3_consolidated_16bit_state_dict``), from the run's
parts (a :class:`~..core.run.Run`).
"""

from __future__ import annotations

import logging
import os

import torch

from ..core.run import Run
from .state import _atomic_replace, _barrier

log = logging.getLogger("zerostack")


def full_weights(run: Run) -> dict[str, torch.Tensor]:
    """The full model weights in fp32 on the CPU, tensor-parallel slices joined."""
    master = run.zero.full_master()
    out = {}
    for name, p in run.module.named_parameters():
        src = master.get(p)
        t = (src if src is not None else p.detach()).float()
        out[name] = run.full_params.join_tp(p, t).cpu().clone()
    return out


def consolidated_16bit(run: Run, exclude_frozen: bool) -> dict[str, torch.Tensor]:
    """Every entry of ``module.state_dict()`` whole (dp pieces and tp slices joined), the
    parameters in the 16-bit dtype (the compute dtype; fp32 without fp16/bf16), the buffers
    as held; tied names are copies."""
    if run.topology.pp > 1:
        raise NotImplementedError(
            "the 16-bit model of a pipeline: each stage holds its own layers; save a "
            "checkpoint and run `zerostack consolidate` on it"
        )
    full = full_weights(run)
    dtype = run.precision.compute_dtype
    canonical = {id(p): (n, p) for n, p in run.module.named_parameters()}
    out = {}
    for key, t in run.module.state_dict(keep_vars=True).items():
        if id(t) not in canonical:  # a buffer
            out[key] = t.detach().cpu().clone()
            continue
        name, p = canonical[id(t)]
        if not (exclude_frozen and not p.requires_grad):
            out[key] = full[name].to(dtype, copy=True)
    return out


def save_16bit_model(
    run: Run, save_dir: str, save_filename: str, exclude_frozen: bool
) -> bool:
    """``engine.save_16bit_model`` (its docstring says what is written): False, and nothing
    written, at ZeRO stage 3 without ``stage3_gather_16bit_weights_on_model_save``."""
    path = os.path.join(save_dir, save_filename)
    zero_cfg = run.config.zero_optimization
    if zero_cfg.stage == 3 and not zero_cfg.stage3_gather_16bit_weights_on_model_save:
        if run.global_rank == 0:
            log.info(
                "Did not save the model %s because "
                "stage3_gather_16bit_weights_on_model_save is False",
                path,
            )
        return False
    state = consolidated_16bit(run, exclude_frozen)
    if run.global_rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        tensors = {k: v.contiguous() for k, v in state.items()}
        if save_filename.endswith(".safetensors"):
            from safetensors.torch import save_file

            write = lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"})
        else:
            write = lambda tmp: torch.save(tensors, tmp)
        _atomic_replace(path, write)
    _barrier(run.comm)
    return True
