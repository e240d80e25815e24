"""Writing DeepSpeed's files beside zerostack's (``checkpoint.deepspeed_files``), so DeepSpeed
0.19's ``load_checkpoint``, the ``zero_to_fp32.py`` placed in the save folder and Lightning's
``convert_zero_checkpoint_to_fp32_state_dict`` read a folder zerostack wrote, as they read the
folder DeepSpeed writes for the same run (the layout is :mod:`.deepspeed_read`'s).

The tag folder keeps zerostack's files and manifest; zerostack loads from those (each tensor's
sha256 checked, any layout), and the manifest lists DeepSpeed's files with their sha256
(``deepspeed_files``). They are written inside the incomplete folder, after zerostack's shards and
manifest and before the rename, so the save stays atomic: DeepSpeed's files exist complete or
not at all. Each rank writes DeepSpeed's files of its own dp rank, reading the values it needs
from zerostack's shards in the same folder (:class:`~.reader.ShardReader`, every tensor checked): no
collective, whatever ZeRO stage or dp cut wrote the shards.

What DeepSpeed writes, and so what is written here (read in DeepSpeed 0.19.8's
``engine._save_checkpoint`` / ``_save_zero_checkpoint`` and the ZeRO optimizers'
``state_dict``):

- stages 1-2: each group's trained parameters back to back, padded at the end to a multiple
  of ``2 x dp`` elements, cut into ``dp`` equal partitions; rank r's fp32 partition without the
  padding (``single_partition_of_fp32_groups``), its optimizer state over the whole partition
  (``base_optimizer_state``), and its slice map (``param_slice_mappings``);
- stage 3: each parameter cut into ``ceil(numel / dp)``-element pieces (the last padded), rank
  r's pieces of each sub-group back to back (``fp32_flat_groups``) and the optimizer state
  over them;
- the optimizer state as DeepSpeed's optimizer for the config keeps it (``FusedAdam``,
  ``DeepSpeedCPUAdam`` with offload: its group keys, an integer ``step``), else as torch's.

DeepSpeed's classes in these pickles (the loss scaler, the ZeRO stage, the slice map's
``fragment_address``) are written by name from stand-ins (:class:`_Pickler`), so no DeepSpeed
is needed to write them, and the pickles hold nothing else of zerostack's.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections import OrderedDict

import torch

from ..moe.utils import EXPERTS
from .deepspeed_layout import Layout
from .deepspeed_optim import (
    _ORDER_1_2,
    VERSION,
    _scaler,
    _stage_0,
    _stage_3,
    _stages_1_2,
)
from .deepspeed_read import (
    _DynamicLossScaler,
    _FragmentAddress,
    _LossScaler,
    _ZeroStageEnum,
)
from .errors import CheckpointError

SCRIPT = "zero_to_fp32.py"

_NAMES = {
    _LossScaler: ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    _DynamicLossScaler: ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    _ZeroStageEnum: ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    _FragmentAddress: ("deepspeed.utils.tensor_fragment", "fragment_address"),
}


class _Pickler(pickle._Pickler):
    """torch.save's pickler writing each stand-in class under DeepSpeed's name (no import of
    that name is tried: DeepSpeed need not be installed)."""

    def save_global(self, obj, name=None):
        where = _NAMES.get(obj)
        if where is None:
            return super().save_global(obj, name)
        self.write(pickle.GLOBAL + f"{where[0]}\n{where[1]}\n".encode())
        self.memoize(obj)


class _PickleModule:
    Pickler = _Pickler
    Unpickler = pickle.Unpickler


# ---------------------------------------------------------------------------- the files
def write(
    layout: Layout,
    folder: str,
    rank: int,
    manifest: dict,
    reader,
    module,
    client_state,
    exclude_frozen: bool,
) -> dict:
    """DeepSpeed's files of dp rank ``rank`` into ``folder``, the values read through
    ``reader`` (zerostack's shards, or any checkpoint); ``module()`` gives the module's state
    dict for the model-states file. Returns ``{file: sha256}`` of what it wrote."""
    moments = reader.kinds()
    hyper = [g["hyper"] for g in manifest["optimizer_groups"]]
    steps = [g["step"] for g in manifest["optimizer_groups"]]
    shapes = {n: torch.Size(s) for n, s in manifest["params"].items()}
    written, scaler = {}, manifest["loss_scaler"]
    if layout.stage == 0:  # no optimizer files: rank 0's model states hold the optimizer
        if rank > 0:
            return written
        optimizer = _stage_0(layout, reader, shapes, moments, hyper, steps, scaler)
    else:
        build = _stages_1_2 if layout.stage < 3 else _stage_3
        optim = build(layout, reader, shapes, moments, hyper, steps, rank)
        dynamic = layout.fp16 and layout.scaler["dynamic"]
        # the last step's overflow, which DeepSpeed keeps beside the scaler
        overflow = dynamic and scaler["last_overflow_iter"] == scaler["cur_iter"] - 1
        optim = {
            "zero_stage": _ZeroStageEnum(layout.stage),
            "loss_scaler": _scaler(layout, scaler),
            "dynamic_loss_scale": dynamic,
            "overflow": overflow,
            **optim,
        }
        if layout.stage < 3:
            optim = {k: optim[k] for k in _ORDER_1_2}
        prefix = "bf16_" if layout.bf16 else ""
        name = f"{prefix}zero_pp_rank_{rank}_mp_rank_{layout.mp:02d}_optim_states.pt"
        written[name] = _save(
            folder,
            name,
            {"optimizer_state_dict": optim, "ds_config": layout.config, "ds_version": VERSION},
        )
        optimizer = None
    if layout.moe_layers and rank < layout.ep:  # each ep rank's experts, from its first rank
        state = module()
        written.update(_expert_files(folder, layout, state))
        module = lambda: OrderedDict((k, v) for k, v in state.items() if EXPERTS not in k)  # noqa: E731
    if layout.stage == 3 or rank == 0:
        if layout.pp > 1:  # the stage's layers in files of their own, the module nowhere else
            written.update(_layer_files(folder, module()))
            module = lambda: None  # noqa: E731
        model = _model_states(
            layout, rank, manifest, shapes, module, client_state, exclude_frozen, reader, optimizer
        )
        name = f"mp_rank_{layout.mp:02d}_model_states.pt"
        name = (f"zero_pp_rank_{rank}_" if layout.stage == 3 else "") + name
        written[name] = _save(folder, name, model)
    return written


def _expert_files(folder: str, layout, state: dict) -> dict:
    """``layer_<L>_expert_<E>_mp_rank_00_model_states.pt``: MoE layer L's expert E (its index
    among all the layer's experts, as in its keys), as DeepSpeed's ``_save_moe_checkpoint``
    writes each ep rank's local experts."""
    out = {}
    for layer, (prefix, _, local) in enumerate(layout.moe_layers):
        experts = f"{prefix}.deepspeed_moe.experts" if prefix else "deepspeed_moe.experts"
        for index in range(local):
            number = layout.ep_rank * local + index
            mine = f"{experts}{EXPERTS}{index}."
            sd = OrderedDict(
                (k.replace(mine, f"{experts}{EXPERTS}{number}."), v.detach().cpu().clone())
                for k, v in state.items()
                if k.startswith(mine)
            )
            name = f"layer_{layer}_expert_{number}_mp_rank_00_model_states.pt"
            out[name] = _save(folder, name, sd)
    return out


def _layer_files(folder: str, state: dict) -> dict:
    """A pipeline stage's ``layer_<XX>-model_states.pt``: each layer's state dict under its own
    names (``3.lin.weight`` is layer 3's ``lin.weight``), as DeepSpeed's ``PipelineModule``
    saves them from the first dp rank."""
    layers: dict[int, OrderedDict] = {}
    for key, value in state.items():
        index, rest = key.split(".", 1)
        layers.setdefault(int(index), OrderedDict())[rest] = value.detach().cpu().clone()
    return {
        f"layer_{i:02d}-model_states.pt": _save(folder, f"layer_{i:02d}-model_states.pt", sd)
        for i, sd in sorted(layers.items())
    }


def _model_states(
    layout, rank, manifest, shapes, module, client_state, exclude_frozen, reader, optimizer=None
):
    """DeepSpeed's model-states file: rank 0's at stages 0-2 (with ``optimizer`` at stage 0),
    each rank's at stage 3."""
    stage, dp = layout.stage, layout.dp
    module = module()
    if module is not None:
        module = OrderedDict((k, v.detach().cpu().clone()) for k, v in module.items())
    if exclude_frozen and module is not None:
        for n in layout.frozen:
            module.pop(n, None)
    shapes_out, fragments = None, None
    if stage >= 2 and not exclude_frozen:
        shapes_out, fragments = OrderedDict(), OrderedDict()
        for n in layout.frozen:
            shapes_out[n] = shapes[n]
            value = reader.full(n).to(layout.dtype)
            if stage == 3:
                numel = value.numel()
                piece = -(-numel // dp)
                flat = torch.zeros(piece, dtype=layout.dtype)
                lo, hi = min(rank * piece, numel), min((rank + 1) * piece, numel)
                flat[: hi - lo] = value.reshape(-1)[lo:hi]
                value = flat
            fragments[n] = value
    shared = {a: c for a, c in manifest["aliases"].items()} if rank == 0 else {}
    names = layout.global_names or {}
    shape = tuple if layout.moe_layers else torch.Size  # as DeepSpeed's MoE save keeps them
    param_shapes = [
        OrderedDict((n, shape(shapes[names.get(n, n)])) for n in g) for g in layout.groups
    ]
    if stage == 0:  # DeepSpeed's stage 0 names none of it
        param_shapes = shared = None
    out = {
        "module": module,
        "buffer_names": list(layout.buffers),
        "optimizer": optimizer,
        "param_shapes": param_shapes,
        "frozen_param_shapes": shapes_out,
        "shared_params": shared,
        "frozen_param_fragments": fragments,
        "lr_scheduler": manifest["lr_scheduler"],
        "data_sampler": None,
        "random_ltd": manifest.get("random_ltd"),
        "skipped_steps": manifest["counters"]["skipped_steps"],
        "global_steps": manifest["counters"]["global_steps"],
        "global_samples": manifest["counters"]["global_samples"],
        "dp_world_size": dp,
        "mp_world_size": layout.pp,
        "checkpoint_parallel_dimensions": {"pp_degree": layout.pp, "tp_degree": 1},
        "ds_config": layout.config,
        "ds_version": VERSION,
    }
    if layout.moe_layers:
        out.update(num_experts=[n for _, n, _ in layout.moe_layers], ds_autoep_layers=None)
    if "checkpoint_parallel_dimensions" in (client_state or {}):
        raise CheckpointError(
            "client_state: 'checkpoint_parallel_dimensions' is DeepSpeed's own "
            "key in its model-states file"
        )
    out.update(client_state or {})
    return out


def _save(folder: str, name: str, obj) -> str:
    """``torch.save`` of ``obj`` to ``folder/name`` (DeepSpeed's names by :class:`_Pickler`),
    written under a temporary name, made durable and renamed; returns its sha256 (read back
    from the file: no second copy of it in memory)."""
    path = os.path.join(folder, name)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f, pickle_module=_PickleModule)
            f.flush()
            os.fsync(f.fileno())
        digest = hashlib.sha256()
        with open(tmp, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return digest.hexdigest()


def place_script(save_dir: str) -> None:
    """``zero_to_fp32.py`` in ``save_dir``, as DeepSpeed places its own there: it runs
    zerostack's (``zerostack.compat.deepspeed.utils.zero_to_fp32``) where zerostack is installed,
    else DeepSpeed's, with the same arguments."""
    path = os.path.join(save_dir, SCRIPT)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(_SCRIPT_TEXT)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)


_SCRIPT_TEXT = '''#!/usr/bin/env python
"""Whole fp32 weights from a checkpoint in this folder, placed here by zerostack as DeepSpeed
places its zero_to_fp32.py: python zero_to_fp32.py . OUTPUT_DIR [-t TAG] [--safe_serialization]
Runs zerostack's converter where zerostack is installed, else DeepSpeed's (both read the
folder: it holds DeepSpeed's files beside zerostack's)."""
import runpy

try:
    import zerostack.compat.deepspeed.utils.zero_to_fp32  # noqa: F401
    NAME = "zerostack.compat.deepspeed.utils.zero_to_fp32"
except ImportError:
    NAME = "deepspeed.utils.zero_to_fp32"
runpy.run_module(NAME, run_name="__main__", alter_sys=True)
'''
