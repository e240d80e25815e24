"""``deepspeed.module_inject``: of DeepSpeed's layer injection, what training scripts reach
for: :class:`~.layers.GatherReplacedLayerParams` (OpenRLHF's weight sync under AutoTP)."""

from . import layers
from .layers import GatherReplacedLayerParams

__all__ = ["GatherReplacedLayerParams", "layers"]
