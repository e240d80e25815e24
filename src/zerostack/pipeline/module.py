"""A model as a list of layers, cut into pipeline stages; each rank builds only its own layers.

DeepSpeed's ``PipelineModule`` API::

    layers = [
        TiedLayerSpec("embed", Embedding, cfg),          # first stage
        *[LayerSpec(Block, cfg) for _ in range(12)],
        TiedLayerSpec("embed", Embedding, cfg, forward_fn=as_head),   # last stage, same weight
    ]
    model = PipelineModule(layers, num_stages=4, loss_fn=loss, partition_method="type:Block")

A ``LayerSpec`` is built only on the stage that owns it. A ``TiedLayerSpec`` key names one module
per stage that holds it; the copies start from the first owner's values and their gradients are
all-reduced between the owning stages after every batch.

Partition methods (how the layer list is cut into ``stages x virtual_stages`` contiguous parts):

* ``uniform``: balance the number of layers;
* ``parameters``: balance the trainable parameter count of each part;
* ``type:<regex>``: balance the number of layers whose class name matches (others weigh 0);
* a list of ``parts + 1`` boundaries, e.g. ``[0, 5, 10]``.

Balancing minimises the heaviest part over all contiguous cuts (each part gets at least one layer);
among the cuts that reach that minimum, earlier parts take as many layers as they can, so
weightless layers at the ends go to the first and last parts.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from itertools import product

import torch
import torch.distributed as dist
from torch import nn

from ..activation_checkpointing import checkpoint
from ..comm.grid import comm_for
from ..topology import Topology
from ..world import hold_groups


class LayerSpec:
    """A layer to build later, on the stage that owns it: ``typename(*args, **kwargs)``."""

    def __init__(self, typename: type, *args, **kwargs) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec: {typename!r} is not an nn.Module class")
        self.typename, self.args, self.kwargs = typename, args, kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose ``tied_weight_attr`` parameters are shared by every layer with this ``key``.

    ``forward_fn(module, x)``, if given, replaces ``module(x)`` at this position (e.g. an
    embedding used as the output head).
    """

    def __init__(
        self,
        key: str,
        typename: type,
        *args,
        forward_fn=None,
        tied_weight_attr: str | list[str] = "weight",
        **kwargs,
    ) -> None:
        super().__init__(typename, *args, **kwargs)
        self.key, self.forward_fn = key, forward_fn
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else tied_weight_attr
        self.tied_weight_attrs = list(attrs)

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.typename.__name__})"


def _balanced(weights: list[float], parts: int) -> list[int]:
    """Boundaries of ``parts`` contiguous non-empty parts minimising the heaviest one."""
    n = len(weights)

    def cut(limit: float) -> list[int] | None:
        bounds, start = [0], 0
        for k in range(parts):
            left = parts - k - 1  # parts after this one, one layer each at least
            end, total = start, 0.0
            while end < n - left and (end == start or total + weights[end] <= limit):
                total += weights[end]
                end += 1
            if k == parts - 1:
                end = n
            if sum(weights[start:end]) > limit + 1e-9:
                return None
            bounds.append(end)
            start = end
        return bounds

    candidates = sorted({sum(weights[i:j]) for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1  # binary search for the smallest feasible bottleneck
    while lo < hi:
        mid = (lo + hi) // 2
        if cut(candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    return cut(candidates[lo]) or []


def _param_count(spec) -> int:
    if isinstance(spec, LayerSpec):
        with torch.device("meta"):  # count without allocating
            layer = spec.build()
    else:
        layer = spec
    if not isinstance(layer, nn.Module):
        return 0
    return sum(p.numel() for p in layer.parameters() if p.requires_grad)


def partition_layers(layers: list, parts: int, method) -> list[int]:
    """The ``parts + 1`` boundaries that cut ``layers`` by ``method`` (see the module doc)."""
    n = len(layers)
    if parts > n:
        raise ValueError(f"partition: {parts} stages (x virtual stages) but only {n} layers")
    if isinstance(method, (list, tuple)):
        bounds = list(method)
        ok = len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == n
        if not ok or any(b >= c for b, c in zip(bounds, bounds[1:], strict=False)):
            raise ValueError(
                f"partition_method: boundaries {bounds} must rise strictly from 0 to "
                f"{n} in {parts + 1} steps"
            )
        return bounds
    if not isinstance(method, str):
        raise ValueError(f"partition_method: {method!r} is not a method name or a boundary list")
    name = method.lower()
    if name == "uniform":
        weights = [1.0] * n
    elif name == "parameters":
        weights = [float(_param_count(spec)) for spec in layers]
    elif name.startswith("type:"):
        pattern = re.compile(method[5:], re.IGNORECASE)
        weights = [
            1.0 if pattern.search(getattr(spec, "typename", type(spec)).__name__) else 0.0
            for spec in layers
        ]
        if not any(weights):
            raise ValueError(f"partition_method: no layer's class matches {method[5:]!r}")
    else:
        raise ValueError(
            f"partition_method: {method!r} is not one of 'uniform', 'parameters', "
            "'type:<regex>' or a list of boundaries"
        )
    return _balanced(weights, parts)


@dataclass
class _Tie:
    key: str
    stages: list[int]  # pp stages that hold the tied module, ascending
    attrs: list[str]
    group: dist.ProcessGroup | None  # this rank's group of owners (None if not an owner)


class PipelineModule(nn.Module):
    """The layers of this rank's pipeline stage(s); see the module doc."""

    def __init__(
        self,
        layers: list,
        num_stages: int | None = None,
        topology: Topology | None = None,
        loss_fn: Callable | None = None,
        seed_layers: bool = False,
        seed_fn=None,
        base_seed: int = 1234,
        partition_method="parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func=None,
        checkpointable_layers=None,
        *,
        virtual_stages: int = 1,
    ) -> None:
        super().__init__()
        if topology is None:
            if num_stages is None:
                raise ValueError("PipelineModule: give num_stages or topology")
            topology = Topology.build(pp=num_stages)
        elif num_stages is not None and num_stages != topology.pp:
            raise ValueError(
                f"PipelineModule: num_stages {num_stages} but the topology has pp={topology.pp}"
            )
        if virtual_stages < 1:
            raise ValueError(f"PipelineModule: virtual_stages must be >= 1, got {virtual_stages}")
        if activation_checkpoint_interval < 0:
            raise ValueError("PipelineModule: activation_checkpoint_interval must be >= 0")
        self.topology = topology
        self.num_stages = topology.pp
        self.stage_id = topology.rank("pp")
        self.virtual_stages = virtual_stages
        self.loss_fn = loss_fn
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self._checkpoint = activation_checkpoint_func or checkpoint
        self.layer_specs = list(layers)
        parts = self.num_stages * virtual_stages
        self.parts = partition_layers(self.layer_specs, parts, partition_method)
        # chunk c of this rank is part c * pp + stage
        self.chunk_ranges = [
            (
                self.parts[c * self.num_stages + self.stage_id],
                self.parts[c * self.num_stages + self.stage_id + 1],
            )
            for c in range(virtual_stages)
        ]
        self.tied_modules = nn.ModuleDict()
        self._funcs: dict[int, Callable] = {}
        for lo, hi in self.chunk_ranges:
            for idx in range(lo, hi):
                if seed_layers:
                    (seed_fn or torch.manual_seed)(base_seed + idx)
                self._build(idx, self.layer_specs[idx])
        self.ties = self._make_ties()
        hold_groups(self)  # the ties' groups, released at zerostack.shutdown()

    def release_groups(self) -> None:
        """Drop the tied-weight groups (``zerostack.shutdown``)."""
        for tie in self.ties:
            tie.group = None

    # ------------------------------------------------------------------ building
    def _build(self, idx: int, spec) -> None:
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in self.tied_modules:
                self.tied_modules[spec.key] = spec.build()
            module = self.tied_modules[spec.key]
            fn = spec.forward_fn
            self._funcs[idx] = (lambda x, m=module, f=fn: f(m, x)) if fn else module
        elif isinstance(spec, LayerSpec):
            module = spec.build()
            self.add_module(str(idx), module)
            self._funcs[idx] = module
        elif isinstance(spec, nn.Module):
            self.add_module(str(idx), spec)
            self._funcs[idx] = spec
        elif callable(spec):
            self._funcs[idx] = spec
        else:
            raise TypeError(
                f"PipelineModule: layer {idx} ({spec!r}) is not a LayerSpec, an "
                "nn.Module or a callable"
            )

    def layer_alone(self, idx: int, tied: dict, dtype: torch.dtype) -> Callable:
        """Layer ``idx`` built afresh as a callable, its floating-point parameters in ``dtype``,
        whichever rank holds it (a dry run runs the layers before this rank's on the meta
        device to learn its activations' shapes); tied layers share their module through
        ``tied``."""
        spec = self.layer_specs[idx]
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                tied[spec.key] = spec.build().to(dtype)
            module, fn = tied[spec.key], spec.forward_fn
            return (lambda x: fn(module, x)) if fn else module
        return spec.build().to(dtype) if isinstance(spec, LayerSpec) else spec

    def stage_of(self, idx: int) -> int:
        """The pp stage whose chunk holds layer ``idx``."""
        for part in range(len(self.parts) - 1):
            if self.parts[part] <= idx < self.parts[part + 1]:
                return part % self.num_stages
        raise IndexError(f"layer {idx} out of range")

    def _make_ties(self) -> list[_Tie]:
        """One group per tie key and (dp, tp) coordinate, over the pp stages that hold the key;
        the copies start from the first owner's values. Collective: every rank runs it."""
        owners: dict[str, set[int]] = {}
        attrs: dict[str, list[str]] = {}
        for idx, spec in enumerate(self.layer_specs):
            if isinstance(spec, TiedLayerSpec):
                owners.setdefault(spec.key, set()).add(self.stage_of(idx))
                attrs.setdefault(spec.key, spec.tied_weight_attrs)
        topo = self.topology
        mesh = topo.mesh.mesh  # global ranks, shape (pp, dp, ep, tp), or (pp, dp, tp) at ep 1
        if topo.ep == 1:
            mesh = mesh.unsqueeze(2)
        here = (topo.rank("dp"), topo.rank("ep"), topo.rank("tp"))
        ties = []
        for key in sorted(owners):
            stages = sorted(owners[key])
            mine = None
            if len(stages) > 1:
                for coords in product(*(range(n) for n in mesh.shape[1:])):
                    ranks = [int(mesh[(s, *coords)]) for s in stages]
                    group = dist.new_group(ranks, timeout=topo.timeout)
                    if coords == here and self.stage_id in stages:
                        mine = group
            ties.append(_Tie(key, stages, attrs[key], mine))
        for tie in ties:
            if tie.group is not None:
                for p in self.tied_parameters(tie):
                    # the module is still in host memory (the engine moves it): NCCL broadcasts
                    # a device copy
                    data = p.data.to(self.topology.device)
                    comm_for(self.topology).broadcast(data, src=0, axis="tied", group=tie.group)
                    if data is not p.data:
                        p.data.copy_(data)
        return ties

    def tied_parameters(self, tie: _Tie) -> list[nn.Parameter]:
        if tie.key not in self.tied_modules:
            return []
        module = self.tied_modules[tie.key]
        return [module.get_parameter(a) for a in tie.attrs]

    def tied_copies(self) -> set[nn.Parameter]:
        """Tied parameters this stage holds that another (earlier) stage also holds: counted
        there, not here, in the global gradient norm."""
        return {
            p
            for tie in self.ties
            if tie.stages and self.stage_id != tie.stages[0]
            for p in self.tied_parameters(tie)
        }

    # ------------------------------------------------------------------ running
    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def forward_chunk(self, chunk: int, x):
        """Run this rank's chunk ``chunk`` (its layers in order) on ``x``."""
        lo, hi = self.chunk_ranges[chunk]
        interval = self.activation_checkpoint_interval
        idx = lo
        while idx < hi:
            end = min(hi, idx + interval) if interval else hi
            funcs = [self._funcs[i] for i in range(idx, end)]

            def run(inp, funcs=funcs):
                for f in funcs:
                    inp = f(inp)
                return inp

            x = self._checkpoint(run, x) if interval and torch.is_grad_enabled() else run(x)
            idx = end
        return x

    def side_loss(self, chunk: int) -> torch.Tensor | None:
        """The sum of the ``side_loss`` the chunk's layers left in their last forward (a term of
        the loss a stage other than the last produces, e.g. a MoE block's auxiliary loss: the
        executor backpropagates it with the loss's own scale), or None."""
        lo, hi = self.chunk_ranges[chunk]
        terms = [getattr(self._funcs[i], "side_loss", None) for i in range(lo, hi)]
        terms = [t for t in terms if t is not None]
        if terms and self.activation_checkpoint_interval:
            raise ValueError(
                "PipelineModule: a layer's side_loss (a MoE block's auxiliary loss) does not "
                "combine with activation_checkpoint_interval yet"
            )
        return sum(terms) if terms else None

    def forward(self, x, chunk: int | None = None):
        """The whole pipeline in one process (pp = 1, one chunk); with ``chunk``, that chunk of
        this rank's (what the engine's executor calls, so that hooks on this module, such as
        ZeRO-3's, see each chunk's forward)."""
        if chunk is not None:
            return self.forward_chunk(chunk, x)
        if self.num_stages != 1 or self.virtual_stages != 1:
            raise RuntimeError("PipelineModule: with pp > 1 use engine.train_batch()")
        return self.forward_chunk(0, x)
