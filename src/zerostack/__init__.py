"""zerostack: ZeRO, tensor and pipeline parallelism on torch.distributed, with DeepSpeed's API.

Switching from DeepSpeed is one import::

    import zerostack as deepspeed
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), training_data=dataset, config="ds.json"
    )
    for x, y in loader:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
"""

from __future__ import annotations

from . import activation_checkpointing, checkpointing, utils, zero
from .comm import Comm, CommLog

# DeepSpeed's call and engine accessors; unknown keys refused (deepspeed.initialize warns)
from .compat.deepspeed import native_initialize as initialize
from .config import ConfigError, ZeroStackConfig, load_config
from .core.version import __version__ as __version__
from .engine import Engine
from .topology import Topology
from .world import init_distributed, shutdown

__all__ = [
    "Comm",
    "CommLog",
    "ConfigError",
    "Engine",
    "Topology",
    "ZeroStackConfig",
    "activation_checkpointing",
    "checkpointing",
    "init_distributed",
    "initialize",
    "load_config",
    "shutdown",
    "utils",
    "zero",
]
