"""The engine's ``flops_profiler`` config block: profile the forwards of one training step.

As DeepSpeed does: when the engine has completed ``profile_step`` steps, the next step's forwards
(every micro-batch of it) are profiled; on its accumulation boundary the profile is printed (by
rank 0, or to ``output_file``) and the hooks are removed. ``last_step_flops`` keeps that step's
flops (forward x (3 + ``recompute_fwd_factor``)) for throughput reports (each later
:class:`~zerostack.core.steps.StepReport`'s ``flops``).
"""

from __future__ import annotations

from typing import Any

from ...core.steps import StepReport
from .profiler import FlopsProfiler


class StepProfile:
    """A step callback driving a :class:`FlopsProfiler`: a forward pre-hook on the engine's
    module starts it at the first forward once ``state.global_steps`` reaches ``profile_step``;
    the step's report ends it. ``ds_engine``: what the printed summary takes its sizes from."""

    def __init__(self, state: Any, rank: int, config, ds_engine: Any) -> None:
        self.state, self.rank, self.config = state, rank, config
        self.profiler = FlopsProfiler(
            None, ds_engine=ds_engine, recompute_fwd_factor=config.recompute_fwd_factor
        )
        self.active = False
        self.last_step_flops: int | None = None
        self.profiler.model.register_forward_pre_hook(self._forward_begins)

    def _forward_begins(self, module, args) -> None:
        if not self.active and self.state.global_steps == self.config.profile_step:
            self.profiler.start_profile()
            # torch runs the pre-hooks registered when the call began: the profiler's own one
            # on the model, just added, runs for this forward from here
            self.profiler._pre(module, args)
            self.active = True

    def after_step(self, report: StepReport) -> None:
        """After a boundary's update: print and drop the profile of the step just done; every
        report from then on carries its flops."""
        if self.active:
            self._end()
        report.flops = self.last_step_flops

    def _end(self) -> None:
        self.profiler.stop_profile()
        self.last_step_flops = self.profiler.get_step_flops()
        if self.rank == 0:
            self.profiler.print_model_profile(
                profile_step=self.config.profile_step,
                module_depth=self.config.module_depth,
                top_modules=self.config.top_modules,
                detailed=self.config.detailed,
                output_file=self.config.output_file,
            )
        self.profiler.end_profile()
        self.active = False
