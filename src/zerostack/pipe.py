"""DeepSpeed's ``deepspeed.pipe`` names: ``from zerostack.pipe import PipelineModule``."""

from .pipeline import LayerSpec, PipelineEngine, PipelineModule, TiedLayerSpec, partition_layers

__all__ = ["LayerSpec", "PipelineEngine", "PipelineModule", "TiedLayerSpec", "partition_layers"]
