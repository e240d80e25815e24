"""Hugging Face Transformers models under zerostack's stage 3 (tested with transformers 5.24).

A ``PreTrainedModel`` initialises its weights in ``post_init()``, at the end of its constructor,
over the whole model: under :class:`zerostack.zero.Init` every layer is already cut into pieces by
then and that pass would see empty tensors. While ``zero.Init`` is open, ``init_weights`` is
replaced by :func:`init_weights_gathered`, which runs the same per-module initialisation in the
same order on each module's gathered parameters, a few at a time, and writes dp rank 0's values
back into every rank's pieces. Every rank draws the same random numbers, so its generator stays in
step with the others, and a model built under ``zero.Init`` holds exactly the values the same
seed gives without it.
"""

from __future__ import annotations

import sys

import torch
from torch import nn


def transformers_loaded():
    """The ``transformers`` module if the user has imported it, else None (never imported here)."""
    return sys.modules.get("transformers")


def is_pretrained_model(module: nn.Module) -> bool:
    hf = transformers_loaded()
    return hf is not None and isinstance(module, hf.PreTrainedModel)


def init_weights_gathered(model: nn.Module, gathered) -> None:
    """``PreTrainedModel.init_weights`` for a model whose parameters are stage-3 pieces:
    ``gathered(params)`` is the context (zero.Init's) that gathers those of ``params`` that are
    pieces and writes dp rank 0's values back into every rank's pieces."""
    from transformers import PreTrainedModel
    from transformers.initialization import guard_torch_init_functions

    custom = model.is_remote_code()

    def visit(module: nn.Module, fn) -> None:  # transformers' smart_apply, children first
        for child in module.children():
            visit(child, child._initialize_weights if isinstance(child, PreTrainedModel) else fn)
        # _init_weights(module) may also write its direct children's parameters
        params = list(module.parameters(recurse=False))
        for child in module.children():
            if not isinstance(child, PreTrainedModel):
                params += list(child.parameters(recurse=False))
        with gathered(params):
            fn(module, custom)

    with torch.no_grad(), guard_torch_init_functions():
        visit(model, model._initialize_weights)
    model.tie_weights(recompute_mapping=False)


def patch_init_weights(gathered):
    """Route ``PreTrainedModel.init_weights`` to :func:`init_weights_gathered` with
    ``gathered``, unless something has switched it off; returns the undo."""
    hf = transformers_loaded()
    if hf is None:
        return lambda: None
    cls = hf.PreTrainedModel
    original = cls.__dict__["init_weights"]
    if getattr(original, "__qualname__", "") != "PreTrainedModel.init_weights":
        # switched off (``from_pretrained`` enters transformers' ``no_init_weights`` before
        # ``zero.Init``: the weights are loaded, not drawn): leave it off, drawing nothing
        return lambda: None

    def init_weights(model: nn.Module) -> None:
        init_weights_gathered(model, gathered)

    cls.init_weights = init_weights

    def undo() -> None:
        cls.init_weights = original

    return undo
