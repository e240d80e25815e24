"""ZeRO: partition math, the data-parallel strategies built on it, and stage-3 model building.

``zerostack.zero.Init`` and ``zerostack.zero.GatheredParameters`` have DeepSpeed's names and use.
"""

from .init import GatheredParameters, Init
from .stage3.module_hooks import register_external_parameter, unregister_external_parameter
from .stage3.params import StorageMeter

__all__ = [
    "GatheredParameters",
    "Init",
    "StorageMeter",
    "register_external_parameter",
    "unregister_external_parameter",
]
