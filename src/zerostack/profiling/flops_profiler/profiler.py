"""DeepSpeed's flops profiler, counting with ``torch.utils.flop_counter.FlopCounterMode``.

Profile a training step (what an engine does at ``flops_profiler.profile_step``)::

    prof = FlopsProfiler(model)
    prof.start_profile()
    loss = model(x, y)                  # only the model's forward is counted and timed
    prof.stop_profile()
    prof.print_model_profile(profile_step=step)
    flops = prof.get_total_flops()      # forward flops; get_step_flops() adds the backward
    prof.end_profile()

or one forward of a model, with DeepSpeed's helper::

    flops, macs, params = get_model_profile(model, args=[idx])   # ('15.73 M', '7.86 MMACs', ...)

What is counted. ``FlopCounterMode`` counts matrix products only (mm, addmm, bmm, convolutions,
scaled-dot-product attention; the CPU attention kernel through a formula added here), 2 flops per
multiply-add; element-wise work (norms, activations, softmax, residual adds, bias adds) counts 0,
where DeepSpeed's profiler adds it. So a module's **MACs are its flops / 2**, exactly. Attention
is counted as the full s x s products even when causal, as torch and Narayanan et al. count it.

Per module: flops are those counted between the module's forward pre- and post-hook (including
its children's, so a parent's figure contains its children's), summed over its calls. That is the
figure FlopCounterMode files under the module's dotted name (``get_flop_counts()["GPT.blocks.0"]``),
taken instead from its running total and keyed by the module object: its names start at the first
module it sees run (an engine wrapping the model shifts them) and it files backward work under the
same names. Latency is wall time between the same hooks, with the device synchronised. Params are
the module's parameters, a tied one once (in the module and in the total), at full size when ZeRO
stage 3 holds only a shard. Only work inside the profiled model's own forward counts: a backward
run before ``stop_profile`` and the recomputation of checkpointed activations in it are left out.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ...zero.stage3.params import full_shape
from . import report
from .units import duration_to_string, macs_to_string, number_to_string, params_to_string


@dataclass
class ModuleProfile:
    """One module's figures over the profiled forwards."""

    params: int = 0
    flops: int = 0
    duration: float = 0.0
    ncalls: int = 0
    open_calls: list[tuple[float, int]] = field(default_factory=list, repr=False)  # (t0, flops0)


def _attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    # torch counts the GPU attention kernels but not the CPU one: the same two batched products,
    # q @ k^T and scores @ v, over the whole s_q x s_k square (causal or not, as torch does).
    *batch, s_q, d = query_shape
    s_k, d_v = key_shape[-2], value_shape[-1]
    return 2 * math.prod(batch) * s_q * s_k * (d + d_v)


def flop_formulas() -> dict[Any, Any]:
    """What the profiler adds to FlopCounterMode's formulas (``custom_mapping``): the CPU
    attention kernel."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    return {op: _attention_flops} if op is not None else {}


def _warm_up_counting() -> None:
    # The first operation ever dispatched through a FlopCounterMode costs ~1 s (torch sets the
    # mode up lazily); pay it here, not inside the first profiled module's latency.
    with FlopCounterMode(display=False):
        torch.ones(1, 1) @ torch.ones(1, 1)


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def param_count(module: nn.Module) -> int:
    """Parameters of ``module``, a tied one once (``parameters()`` skips repeats), at full size
    when ZeRO stage 3 holds only a shard."""
    return sum(math.prod(full_shape(p)) for p in module.parameters())


class FlopsProfiler:
    """Flops, MACs, parameters and forward latency of each module of ``model``.

    ``ds_engine``: an engine (zerostack's or DeepSpeed's); its ``module`` is profiled and the
    printed summary adds its world, data-parallel, model-parallel and micro-batch sizes and the
    flops of a whole training step. ``recompute_fwd_factor``: the share of the forward run again
    in the backward (1.0 with full activation checkpointing); a step is (3 + it) x the forward.
    """

    def __init__(self, model: nn.Module | None, ds_engine: Any = None, recompute_fwd_factor=0.0):
        model = ds_engine.module if ds_engine is not None else model
        if not isinstance(model, nn.Module):
            raise TypeError(f"FlopsProfiler: model must be a torch.nn.Module, got {type(model)}")
        if recompute_fwd_factor < 0:
            raise ValueError(
                f"FlopsProfiler: recompute_fwd_factor must be >= 0, got {recompute_fwd_factor}"
            )
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self.profiles: dict[nn.Module, ModuleProfile] = {}
        self._handles: list[Any] = []
        self._depth = 0  # nesting of the model's own forward (0: outside it, nothing counts)
        self._counter: FlopCounterMode | None = None

    # --- DeepSpeed's life cycle ---------------------------------------------------------------

    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        """Zero the figures and hook every module but those whose type is in ``ignore_list``
        (those show their children's sums, and their own work counts in their parent's)."""
        self.stop_profile()
        self.reset_profile()
        _warm_up_counting()
        ignore = tuple(ignore_list or ())
        for module in self.model.modules():
            if module is not self.model and type(module) in ignore:
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre))
            self._handles.append(module.register_forward_hook(self._post, always_call=True))
        self.started = True

    def stop_profile(self) -> None:
        """Remove the hooks; the figures stay readable until :meth:`end_profile`."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._counter is not None:  # a forward that never returned
            self._counter.__exit__(None, None, None)
            self._counter = None
        self._depth = 0

    def reset_profile(self) -> None:
        """Zero every module's flops and latency; count its parameters."""
        self.profiles = {m: ModuleProfile(params=param_count(m)) for m in self.model.modules()}

    def end_profile(self) -> None:
        """Remove the hooks and drop the figures."""
        self.stop_profile()
        self.profiles = {}
        self.started = False

    # --- hooks ----------------------------------------------------------------------------------

    def _pre(self, module: nn.Module, args: Any) -> None:
        if module is self.model:
            if self._depth == 0:
                self._counter = FlopCounterMode(display=False, custom_mapping=flop_formulas())
                self._counter.__enter__()
            self._depth += 1
        if self._depth == 0:
            return  # outside the model's forward: a recomputation during backward
        _synchronize()
        self.profiles[module].open_calls.append(
            (time.perf_counter(), self._counter.get_total_flops())
        )

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        prof = self.profiles[module]
        if not prof.open_calls:
            return
        t0, flops0 = prof.open_calls.pop()
        _synchronize()
        prof.duration += time.perf_counter() - t0
        prof.flops += self._counter.get_total_flops() - flops0
        prof.ncalls += 1
        if module is self.model:
            self._depth -= 1
            if self._depth == 0:
                self._counter.__exit__(None, None, None)
                self._counter = None

    # --- figures --------------------------------------------------------------------------------

    def profile_of(self, module: nn.Module, what: str = "profile_of") -> ModuleProfile:
        if not self.profiles:
            raise RuntimeError(
                f"FlopsProfiler.{what}: no profile; call start_profile() and run the model's "
                "forward, and read the figures before end_profile()"
            )
        return self.profiles[module]

    def flops_of(self, module: nn.Module) -> int:
        """Forward flops; a module never called itself (a ModuleList) sums its children's."""
        prof = self.profile_of(module)
        if prof.ncalls:
            return prof.flops
        return sum(self.flops_of(child) for child in module.children())

    def duration_of(self, module: nn.Module) -> float:
        """Forward latency; a module never called itself (a ModuleList) sums its children's."""
        prof = self.profile_of(module)
        if prof.ncalls:
            return prof.duration
        return sum(self.duration_of(child) for child in module.children())

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Flops of the profiled forward(s)."""
        self.profile_of(self.model, "get_total_flops")
        flops = self.flops_of(self.model)
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Multiply-accumulates of the profiled forward(s): the flops / 2."""
        self.profile_of(self.model, "get_total_macs")
        macs = self.flops_of(self.model) // 2
        return macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Seconds spent in the model's forward(s), hooks included."""
        self.profile_of(self.model, "get_total_duration")
        duration = self.duration_of(self.model)
        return duration_to_string(duration) if as_string else duration

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters of the model on this rank, each counted once (stage-3 shards in full)."""
        params = self.profile_of(self.model, "get_total_params").params
        return params_to_string(params) if as_string else params

    def get_step_flops(self, as_string: bool = False) -> int | str:
        """Flops of a training step: the forward x (3 + recompute_fwd_factor), the backward
        being twice the forward (DeepSpeed's "fwd+bwd" factor)."""
        self.profile_of(self.model, "get_step_flops")
        fwd = self.flops_of(self.model)
        flops = round(fwd * (3 + self.recompute_fwd_factor))
        return number_to_string(flops) if as_string else flops

    # --- printing -------------------------------------------------------------------------------

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | os.PathLike | None = None,
    ) -> None:
        """Print the summary, the top modules per depth and (``detailed``) the module tree with
        each module's figures; to ``output_file`` instead of stdout when given."""
        self.profile_of(self.model, "print_model_profile")
        text = report.model_profile(
            self,
            profile_step=profile_step,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
        )
        _emit(text, output_file)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """Print the ``top_modules`` module types by params, MACs and latency at each depth up
        to ``module_depth`` (-1: every depth)."""
        self.profile_of(self.model, "print_model_aggregated_profile")
        print(report.aggregated_profile(self, module_depth=module_depth, top_modules=top_modules))


def _emit(text: str, output_file: str | os.PathLike | None) -> None:
    if not output_file:
        print(text)
        return
    directory = os.path.dirname(os.path.abspath(output_file))
    os.makedirs(directory, exist_ok=True)
    with open(output_file, "w") as f:
        f.write(text + "\n")


def get_model_profile(
    model: nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | os.PathLike | None = None,
    ignore_modules: Sequence[type] | None = None,
    mode: str = "forward",
) -> tuple[Any, Any, Any]:
    """``(flops, macs, params)`` of one forward of ``model`` in eval mode, after ``warm_up``
    unprofiled forwards; strings such as ``('15.73 M', '7.86 MMACs', '120.58 K')`` when
    ``as_string``. The input is ``model(*args, **kwargs)``, or, given ``input_shape``, one
    uninitialised tensor of that shape with the dtype and device of the model's first parameter
    (as DeepSpeed; only shapes matter to the count). A token model takes ``args=[idx]``.
    The model's train/eval mode is restored afterwards."""
    if mode != "forward":
        raise ValueError(f"get_model_profile: mode {mode!r} is not supported (only 'forward')")
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module, got {type(model)}")
    kwargs = dict(kwargs or {})
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(
                f"get_model_profile: input_shape must be a non-empty tuple, got {input_shape!r}"
            )
        first = next(model.parameters(), None)
        like = {} if first is None else {"dtype": first.dtype, "device": first.device}
        args = (torch.empty(input_shape, **like),)
    if not args and not kwargs:
        raise ValueError("get_model_profile: no input; give input_shape, args or kwargs")

    was_training = model.training
    model.eval()
    try:
        for _ in range(warm_up):
            model(*args, **kwargs)
        prof = FlopsProfiler(model)
        prof.start_profile(ignore_list=ignore_modules)
        model(*args, **kwargs)
        prof.stop_profile()
        flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
        if print_profile:
            prof.print_model_profile(
                profile_step=warm_up,
                module_depth=module_depth,
                top_modules=top_modules,
                detailed=detailed,
                output_file=output_file,
            )
        prof.end_profile()
    finally:
        model.train(was_training)
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
