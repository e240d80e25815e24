"""The parts that act once per optimizer step, registered on the engine by ``initialize`` in the
order they run (each gets the step's :class:`~zerostack.core.steps.StepReport`, not the engine):

1. the flops profile (``flops_profiler``): profiles one step's forwards, then sets every report's
   ``flops``;
2. the monitors (``tensorboard``, ``csv_monitor``, ``wandb``): each step's events, on rank 0;
3. the step log (``steps_per_print``, ``wall_clock_breakdown``, ``memory_breakdown``);
4. the loss-spike guard (``loss_spike``): rolls back to ``latest`` when the loss spikes, and holds
   the automatic save back while a spike lasts;
5. the automatic checkpoint (``checkpoint.save_interval``), and a background save's error.

The watchdog (``watchdog``) follows the engine's collectives rather than its steps; ``initialize``
starts it beside these.
"""

from __future__ import annotations

from ..checkpoint.loss_spike import LossSpikeGuard
from ..config import ZeroStackConfig
from ..monitor.progress import ProgressPrint
from ..monitor.training import StepMonitor
from ..profiling.flops_profiler.step import StepProfile


def register_step_callbacks(
    engine, config: ZeroStackConfig
) -> tuple[StepProfile | None, StepMonitor, LossSpikeGuard | None]:
    """Add the configured step callbacks to ``engine`` (see the module); return the ones a user
    reads, as ``engine.flops_profile``, ``engine.monitor`` and ``engine.loss_spike`` (None when
    their block is off; the monitors always)."""
    rank = engine.topology.global_rank
    profile = None
    if config.flops_profiler.enabled:
        profile = engine.add_callback(
            StepProfile(engine.state, rank, config.flops_profiler, engine)
        )
    # the monitors open their files on rank 0 now: a bad path or a missing package fails here
    monitor = engine.add_callback(StepMonitor(config, engine.topology, engine.comm))
    engine.add_callback(ProgressPrint(config, rank))
    guard = None
    if config.loss_spike.factor:
        guard = engine.add_callback(LossSpikeGuard(config.loss_spike, engine.checkpoints))
    engine.add_callback(engine.checkpoints)
    return profile, monitor, guard
