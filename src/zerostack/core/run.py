"""The run: the parts of one engine that its other parts are given, never the engine itself
(the update, the footprint and the step count read it; checkpoints read and write through it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class Run:
    """What of one engine its parts and checkpoints touch: the module and the ZeRO strategy
    holding its parameters (``zero``, a :class:`~zerostack.zero.strategy.CheckpointView`), the
    optimizer and LR schedule (None when forward only, or without a schedule), the train state
    (counters, loss scaler, loader position), the grid (``topology``, ``comm``), the config, the
    precision, the per-parameter full values (``full_params``: tp slices joined) and which
    parameters another rank also holds (``replicated_elsewhere()``)."""

    module: nn.Module
    zero: Any
    optimizer: Any
    lr_scheduler: Any
    state: Any  # zerostack.engine.train_state.TrainState
    topology: Any  # zerostack.topology.Topology
    comm: Any  # zerostack.comm.Comm
    config: Any  # zerostack.config.view.ConfigView
    precision: Any  # zerostack.core.precision.Precision
    full_params: Any  # zerostack.engine.full_params.FullParams
    replicated_elsewhere: Callable[[], set[nn.Parameter]]

    @property
    def global_rank(self) -> int:
        return self.topology.global_rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def device(self) -> torch.device:
        return self.topology.device

    @property
    def global_steps(self) -> int:
        return self.state.global_steps

    def optimizer_groups(self) -> list[dict]:
        """The optimizer's parameter groups (none for a forward-only engine)."""
        return self.optimizer.param_groups if self.optimizer is not None else []
