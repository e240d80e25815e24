"""DeepSpeed's optimizer state as its ZeRO optimizers keep it, for :mod:`.deepspeed_write`: each
stage's cut of the fp32 masters and moments into what one dp rank's file holds, read from any
checkpoint through a reader (see :mod:`.deepspeed_write` for the layouts, read in DeepSpeed
0.19.8's ZeRO optimizers' ``state_dict``), and the loss scaler object its files keep.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from .deepspeed_read import _DynamicLossScaler, _FragmentAddress, _LossScaler
from .errors import CheckpointError

VERSION = "0.19.8"  # the DeepSpeed API level the files are written for


# ---------------------------------------------------------------------------- the optimizer
def _group(kind: str, hyper: dict, index: list[int]) -> dict:
    if kind == "torch":
        return {**hyper, "params": index}
    # the keys DeepSpeed's MoE tutorial gives a group come first (the client's dict, to which
    # the optimizer adds its defaults)
    out = {k: hyper[k] for k in ("name", "moe") if k in hyper}
    out.update(
        lr=hyper["lr"],
        bias_correction=True,
        betas=tuple(hyper["betas"]),
        eps=hyper["eps"],
        weight_decay=hyper["weight_decay"],
    )
    if kind == "cpu":
        out["amsgrad"] = hyper.get("amsgrad", False)
    else:
        out["step"] = 0  # FusedAdam keeps the count per tensor, 0 here
    return {**out, "params": index}


def _state(kind: str, step, values: dict) -> dict:
    """One flat tensor's optimizer state: its moments, and the step count where the optimizer
    keeps one (torch's as a tensor, DeepSpeed's Adams as an int); empty before any step."""
    if step is None:
        return values if any(v.any() for v in values.values()) else {}
    if kind == "torch":
        return {"step": torch.tensor(float(step)), **values}
    return {"step": int(step), **values}


_ORDER_1_2 = (
    "loss_scaler",
    "dynamic_loss_scale",
    "overflow",
    "clip_grad",
    "base_optimizer_state",
    "single_partition_of_fp32_groups",
    "zero_stage",
    "group_paddings",
    "param_alignment_paddings",
    "partition_count",
    "ds_version",
    "param_slice_mappings",
)


def _scaler(layout, state: dict) -> _LossScaler:
    """DeepSpeed's loss scaler object, attributes in its order: fp16's dynamic one (its
    settings from the layout, its state from the checkpoint's), else a fixed scale."""
    if not (layout.fp16 and layout.scaler["dynamic"]):
        out = _LossScaler()
        out.__dict__.update(cur_scale=float(state.get("cur_scale", 1.0)), dynamic=False)
        return out
    s = layout.scaler
    out = _DynamicLossScaler()
    out.__dict__.update(
        cur_scale=state["cur_scale"],
        dynamic=True,
        cur_iter=state["cur_iter"],
        last_overflow_iter=state["last_overflow_iter"],
        scale_factor=s["scale_factor"],
        scale_window=s["scale_window"],
        min_scale=s["min_scale"],
        delayed_shift=s["delayed_shift"],
        cur_hysteresis=state.get("cur_hysteresis", s["delayed_shift"]),
        consecutive_hysteresis=s["consecutive_hysteresis"],
        raise_error_at_min_scale=True,
        dtype=torch.float16,
    )
    return out


def _stage_0(layout, reader, shapes, moments, hyper, steps, scaler: dict) -> dict:
    """The ``optimizer`` entry of DeepSpeed's stage 0 model-states file: in fp32 the
    optimizer's own state dict (each parameter's state shaped as it, keyed by its index over
    the groups; FusedAdam counts the step on each group's last parameter only), in 16 bits
    ``FP16_Optimizer``'s (each group's fp32 masters flat, the state over them, fp16's scale)."""
    if layout.precision == "fp32":
        states, param_groups, index = {}, [], 0
        for g, group in enumerate(layout.groups):
            ids = list(range(index, index + len(group)))
            for i, n in zip(ids, group, strict=True):
                values = {k: reader.full(n, k) for k in moments}
                step = steps[g] if layout.kind == "torch" or i == ids[-1] else 0
                states[i] = _state(layout.kind, step if steps[g] is not None else None, values)
            param_groups.append(_group(layout.kind, hyper[g], ids))
            index += len(group)
        return {"state": {i: s for i, s in states.items() if s}, "param_groups": param_groups}
    out: dict = {}
    if layout.fp16:
        out.update(
            dynamic_loss_scale=layout.scaler["dynamic"],
            cur_scale=scaler["cur_scale"],
            cur_iter=scaler.get("cur_iter", 0),
        )
        if layout.scaler["dynamic"]:
            out.update(
                last_overflow_iter=scaler["last_overflow_iter"],
                scale_factor=layout.scaler["scale_factor"],
                scale_window=layout.scaler["scale_window"],
            )
    flats, states = [], {}
    for g, group in enumerate(layout.groups):
        values = {
            k: torch.cat([reader.full(n, k).reshape(-1) for n in group])
            for k in ["master", *moments]
        }
        flats.append(values.pop("master"))
        states[g] = _state(layout.kind, steps[g], values)
    out["optimizer_state_dict"] = {
        "state": {g: s for g, s in states.items() if s},
        "param_groups": [_group(layout.kind, h, [g]) for g, h in enumerate(hyper)],
    }
    out.update(fp32_groups_flat=flats, clip_grad=layout.clip)
    return out


def _stages_1_2(layout, reader, shapes, moments, hyper, steps, rank) -> dict:
    """DeepSpeed's stage 1-2 optimizer file of dp rank ``rank``."""
    kind, names = layout.kind, layout.global_names or {}
    fp32, paddings, states, maps, counts, aligns = [], [], {}, [], [], []
    for g, group in enumerate(layout.groups):
        # experts: cut over their ep rank's dp // ep ranks, read under their global names
        dp, part = (
            (layout.dp // layout.ep, rank // layout.ep)
            if g in layout.expert_groups
            else (layout.dp, rank)
        )
        numels = [math.prod(shapes[names.get(n, n)]) for n in group]
        total = sum(numels)
        align = 2 * dp
        size = -(-total // align) * align // dp
        lo = part * size
        padding = size if total <= lo else max(0, lo + size - total)
        values = {k: torch.zeros(size) for k in ["master", *moments]}
        slices, offset = OrderedDict(), 0
        for n, numel in zip(group, numels, strict=True):
            x, y = max(offset, lo), min(offset + numel, lo + size)
            if x < y:
                for k, dest in values.items():
                    got = reader.fill(
                        dest, names.get(n, n), k, None, x - offset, y - offset, x - lo
                    )
                    if k == "master" and got != y - x:
                        raise CheckpointError(f"{n}: {got} of {y - x} elements in the shards")
                slices[n] = _address(y - x, x - lo)
            offset += numel
        fp32.append(values.pop("master")[: size - padding].clone())
        states[g] = _state(kind, steps[g], values)
        paddings.append(padding)
        maps.append(slices)
        counts.append(dp)
        aligns.append([0] * len(group))
    base = {
        "state": {g: s for g, s in states.items() if s},
        "param_groups": [_group(kind, h, [g]) for g, h in enumerate(hyper)],
    }
    return {
        "clip_grad": layout.clip,
        "base_optimizer_state": base,
        "single_partition_of_fp32_groups": fp32,
        "group_paddings": paddings,
        "param_alignment_paddings": aligns,
        "partition_count": counts,
        "ds_version": VERSION,
        "param_slice_mappings": maps,
    }


def _address(numel: int, start: int) -> _FragmentAddress:
    out = _FragmentAddress()
    out.__dict__.update(numel=numel, start=start)
    return out


def _sub_groups(numels: list[int], dp: int, limit: int) -> list[list[int]]:
    """DeepSpeed's stage 3 sub-groups: runs of parameters whose pieces reach ``limit``."""
    pieces = [-(-n // dp) for n in numels]
    if limit >= sum(pieces):
        return [list(range(len(numels)))]
    out, run, size = [], [], 0
    for i, piece in enumerate(pieces):
        run.append(i)
        size += piece
        if size >= limit or i == len(pieces) - 1:
            out.append(run)
            run, size = [], 0
    return out


def _stage_3(layout, reader, shapes, moments, hyper, steps, rank) -> dict:
    """DeepSpeed's stage 3 optimizer file of dp rank ``rank``."""
    dp, kind, limit = layout.dp, layout.kind, layout.sub_group_size
    flats, states, param_groups = [], {}, []
    for g, group in enumerate(layout.groups):
        numels = [math.prod(shapes[n]) for n in group]
        index = []
        for sub in _sub_groups(numels, dp, limit):
            size = sum(-(-numels[i] // dp) for i in sub)
            values = {k: torch.zeros(size) for k in ["master", *moments]}
            offset = 0
            for i in sub:
                piece = -(-numels[i] // dp)
                lo, hi = min(rank * piece, numels[i]), min((rank + 1) * piece, numels[i])
                for k, dest in values.items():
                    got = reader.fill(dest, group[i], k, None, lo, hi, offset)
                    if k == "master" and got != hi - lo:
                        raise CheckpointError(f"{group[i]}: {got} of {hi - lo} elements")
                offset += piece
            flats.append(values.pop("master"))
            states[len(flats) - 1] = _state(kind, steps[g], values)
            index.append(len(flats) - 1)
        param_groups.append(_group(kind, hyper[g], index))
    return {
        "partition_count": dp,
        "optimizer_state_dict": {
            "state": {i: s for i, s in states.items() if s},
            "param_groups": param_groups,
        },
        "fp32_flat_groups": flats,
    }
