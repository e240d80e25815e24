"""ZeRO-3 leaf modules: a module whose parameters, its descendants' included, are gathered and
released as one unit, with no hooks on its descendants (DeepSpeed's ``set_z3_leaf_modules``).

A mixture-of-experts block is the reason: its router picks experts by the data, so ranks run
different experts, and a gather per expert would be a different collective on each rank (the
hang DeepSpeed's users meet, #7461). As a leaf, the block gathers every expert in one collective
whatever the router picks. A model with many small modules gathers fewer, larger pieces too.

The flag is DeepSpeed's (``module._z3_leaf``): set before ``initialize`` with these functions, or
by the config's ``zero_optimization.leaf_module`` (``classes``, ``names``, ``name_suffixes``),
which ``initialize`` applies; stage 3 reads it when it hooks the model. At stages 0-2 it changes
nothing. DeepSpeed 0.19.8's default classes (Mixtral's, Qwen2-MoE's and Qwen3-MoE's sparse MoE
blocks) are leaves unless the config says otherwise, as in DeepSpeed.
"""

from __future__ import annotations

import logging

from torch import nn

from ...config.zero import DEFAULT_LEAF_CLASSES

log = logging.getLogger("zerostack")


def z3_leaf_module(module: nn.Module) -> bool:
    """Whether ``module`` is flagged as a leaf."""
    return bool(getattr(module, "_z3_leaf", False))


def z3_leaf_parameter(param: nn.Parameter) -> bool:
    """Whether ``param`` belongs to a leaf (stage 3 marks it ``ds_z3_leaf_module``)."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` flagged as leaves."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Flag (or unflag) ``model`` itself."""
    model._z3_leaf = flag


def _class_matches(module: nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _flag_classes(model, classes, flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    bad = [c for c in classes if not isinstance(c, type | str)]
    if bad:
        raise TypeError(f"leaf module classes must be types or class names, got {bad!r}")
    found = [m for m in model.modules() if any(_class_matches(m, c) for c in classes)]
    for m in found:
        m._z3_leaf = flag
    if not found and raise_if_not_found:
        raise ValueError(f"no modules of type {list(classes)!r} in the model")
    return found


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Flag as leaves the modules of ``model`` that are instances of ``leaf_module_classes``
    (types, or class names: ``"MixtralSparseMoeBlock"`` or the qualified name); returns them.
    Call it before ``initialize``."""
    return _flag_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Unflag the modules :func:`set_z3_leaf_modules` would flag; returns them."""
    return _flag_classes(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(
    model: nn.Module, module_names, flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules named (as ``named_modules()`` names them); returns them and the names
    that matched nothing (raised about with ``raise_if_not_found``)."""
    by_name = dict(model.named_modules())
    found = [by_name[n] for n in module_names if n in by_name]
    missing = [n for n in module_names if n not in by_name]
    for m in found:
        m._z3_leaf = flag
    if missing and raise_if_not_found:
        raise ValueError(f"no modules named {missing!r} in the model")
    return found, missing


def set_z3_leaf_modules_by_suffix(
    model: nn.Module, module_name_suffixes, flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules whose ``named_modules()`` name ends with one of the suffixes; returns
    them (once each) and the suffixes that matched nothing."""
    found: dict[int, nn.Module] = {}
    missing = []
    for suffix in module_name_suffixes:
        hits = [m for name, m in model.named_modules() if name.endswith(suffix)]
        found.update((id(m), m) for m in hits)
        if not hits:
            missing.append(suffix)
    for m in found.values():
        m._z3_leaf = flag
    if missing and raise_if_not_found:
        raise ValueError(f"no modules matching suffixes {missing!r} in the model")
    return list(found.values()), missing


def apply_leaf_config(model: nn.Module, leaf_cfg) -> list[nn.Module]:
    """Flag the leaves ``zero_optimization.leaf_module`` names (``initialize`` calls it); a
    name or suffix the user gave that matches nothing is warned about, and a block the user
    set that matches nothing at all, as DeepSpeed does."""
    matched: dict[int, nn.Module] = {}
    if leaf_cfg.classes:
        matched.update((id(m), m) for m in set_z3_leaf_modules(model, leaf_cfg.classes, False))
    if leaf_cfg.names:
        found, missing = set_z3_leaf_modules_by_name(model, leaf_cfg.names, True, False)
        matched.update((id(m), m) for m in found)
        if missing:
            log.warning("zero_optimization.leaf_module.names: no modules named %s", missing)
    if leaf_cfg.name_suffixes:
        found, missing = set_z3_leaf_modules_by_suffix(model, leaf_cfg.name_suffixes, True, False)
        matched.update((id(m), m) for m in found)
        if missing:
            log.warning("zero_optimization.leaf_module.name_suffixes: no match for %s", missing)
    customized = leaf_cfg.names or leaf_cfg.name_suffixes
    if not matched and (customized or tuple(leaf_cfg.classes) != DEFAULT_LEAF_CLASSES):
        log.warning("zero_optimization.leaf_module matches no module; no leaves")
    return list(matched.values())


__all__ = [
    "DEFAULT_LEAF_CLASSES",
    "apply_leaf_config",
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]
