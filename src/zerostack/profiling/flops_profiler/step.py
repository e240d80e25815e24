"""The engine's ``flops_profiler`` config block: profile the forwards of one training step.

As DeepSpeed does: when the engine has completed ``profile_step`` steps, the next step's forwards
(every micro-batch of it) are profiled; on its accumulation boundary the profile is printed (by
rank 0, or to ``output_file``) and the hooks are removed. ``last_step_flops`` keeps that step's
flops (forward x (3 + ``recompute_fwd_factor``)) for throughput reports.
"""

from __future__ import annotations

from typing import Any

from .profiler import FlopsProfiler


class StepProfile:
    """Drives a :class:`FlopsProfiler` from an engine's forward and step."""

    def __init__(self, engine: Any, config) -> None:
        self.engine, self.config = engine, config
        self.profiler = FlopsProfiler(
            None, ds_engine=engine, recompute_fwd_factor=config.recompute_fwd_factor
        )
        self.active = False
        self.last_step_flops: int | None = None

    def forward_begins(self) -> None:
        if not self.active and self.engine.global_steps == self.config.profile_step:
            self.profiler.start_profile()
            self.active = True

    def step_ends(self) -> None:
        """After a boundary's update: print and drop the profile of the step just done."""
        if not self.active:
            return
        self.profiler.stop_profile()
        self.last_step_flops = self.profiler.get_step_flops()
        if self.engine.global_rank == 0:
            self.profiler.print_model_profile(
                profile_step=self.config.profile_step,
                module_depth=self.config.module_depth,
                top_modules=self.config.top_modules,
                detailed=self.config.detailed,
                output_file=self.config.output_file,
            )
        self.profiler.end_profile()
        self.active = False
