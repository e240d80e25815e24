"""``deepspeed.module_inject.layers.GatherReplacedLayerParams``: AutoTP-split parameters whole
for a while (zerostack's :func:`~zerostack.tensor_parallel.whole.whole_tp`)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from zerostack.tensor_parallel.layers import partition_spec
from zerostack.tensor_parallel.whole import tp_topology, whole_tp


class GatherReplacedLayerParams:
    """DeepSpeed's ``GatherReplacedLayerParams(params, module, enabled=True)``: within, each
    tensor-parallel-split one of ``params`` (a parameter, or an iterable of them) holds its
    whole value in ``.data``; on leaving, each rank's slice of it again. ``module``: the model
    holding them (its tensor-parallel layers name the grid). Not enabled, or none of the
    parameters split: nothing happens, as in DeepSpeed."""

    def __init__(self, params, module: nn.Module, enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = list(params) if enabled else []
        self.module = module
        split = [p for p in self.params if partition_spec(p) is not None]
        topology = tp_topology(module) if split else None
        self._context = whole_tp(split, topology) if topology else contextlib.nullcontext()

    def __enter__(self) -> None:
        self._context.__enter__()

    def __exit__(self, *exc) -> None:
        self._context.__exit__(*exc)


__all__ = ["GatherReplacedLayerParams"]
