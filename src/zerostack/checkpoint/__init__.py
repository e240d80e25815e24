"""Training checkpoints: sharded, atomic, verified, and loadable on another ZeRO stage / dp size.

``engine.save_checkpoint(dir)`` / ``engine.load_checkpoint(dir)`` call :func:`.state.save` and
:func:`.restore.load`; see :mod:`.state` for the format.
"""

from .consolidate import consolidate, full_state_dict, read_client_state
from .errors import CheckpointError
from .restore import load, read_manifest
from .state import save

__all__ = [
    "CheckpointError",
    "consolidate",
    "full_state_dict",
    "load",
    "read_client_state",
    "read_manifest",
    "save",
]
