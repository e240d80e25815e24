"""ZeRO: partition math, the data-parallel strategies built on it, and stage-3 model building.

``zerostack.zero.Init`` and ``zerostack.zero.GatheredParameters`` have DeepSpeed's names and use.
"""

from .init import GatheredParameters, Init
from .params import StorageMeter

__all__ = ["GatheredParameters", "Init", "StorageMeter"]
