"""DeepSpeed-MoE's optimizer helpers: expert parameters in parameter groups of their own."""

from __future__ import annotations

from collections import defaultdict

from torch import nn

EXPERTS = ".deepspeed_experts."
"""What every expert parameter's name holds: ``<layer>.deepspeed_experts.<index>.<name>``."""


def is_moe_param(param: nn.Parameter) -> bool:
    """An expert parameter (marked by :class:`~zerostack.moe.experts.Experts`)."""
    return hasattr(param, "allreduce") and not param.allreduce


def global_names(module: nn.Module, ep_rank: int) -> dict[nn.Parameter, str]:
    """Every parameter's name, with each expert under its index among all the layer's experts
    (this rank's local expert ``l`` is expert ``ep_rank * local + l``), as checkpoints key
    them: a checkpoint then loads on any ep size."""
    from .experts import Experts

    names = {p: n for n, p in module.named_parameters()}
    for prefix, m in module.named_modules():
        if isinstance(m, Experts):
            first = ep_rank * m.num_local_experts
            for i, expert in enumerate(m.deepspeed_experts):
                for rest, p in expert.named_parameters():
                    names[p] = f"{prefix}{EXPERTS}{first + i}.{rest}"
    return names


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=None):
    """``param_groups`` with each group's expert parameters moved to a group of their own per
    expert group name (DeepSpeed's function): same options, ``"moe": True``, and the expert
    group's name (``"ep_size_<n>"``, as DeepSpeed 0.19 names it). Every group needs a
    ``"name"``."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"param_groups: a list, tuple or dict, got {type(param_groups).__name__}")
    for i, group in enumerate(param_groups):
        if "name" not in group:
            raise ValueError(f"param_groups[{i}]: has no 'name' (DeepSpeed requires one)")
    moe_groups: dict = defaultdict(dict)
    for group in param_groups:
        kept = []
        for p in group["params"]:
            if not is_moe_param(p):
                kept.append(p)
                continue
            by_name = moe_groups[group["name"]]
            if p.group_name not in by_name:
                by_name[p.group_name] = {  # the keys in DeepSpeed's order
                    **group,
                    "name": p.group_name,
                    "moe": True,
                    "params": [],
                }
            by_name[p.group_name]["params"].append(p)
        group["params"] = kept
    for by_name in moe_groups.values():
        param_groups.extend(by_name.values())
    return param_groups
