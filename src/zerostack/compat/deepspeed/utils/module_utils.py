"""``deepspeed.utils.module_utils``: a submodule reached by its dotted name, read or replaced
(DeepSpeed-Chat swaps a model's linear layers for LoRA ones this way)."""

from __future__ import annotations

import functools


def recursive_getattr(model, module_name: str):
    """``model.a.b.c`` for ``module_name`` ``"a.b.c"``."""
    return functools.reduce(getattr, module_name.split("."), model)


def recursive_setattr(model, module_name: str, module) -> None:
    """Make ``model.a.b.c`` (``module_name`` ``"a.b.c"``) ``module``."""
    parent, _, last = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, last, module)


__all__ = ["recursive_getattr", "recursive_setattr"]
