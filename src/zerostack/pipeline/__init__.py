"""Pipeline parallelism: DeepSpeed's ``PipelineModule`` API, pure schedules, and their executor.

* :mod:`.module`: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``, partitioning.
* :mod:`.schedule`: GPipe, 1F1B and interleaved 1F1B as per-stage instruction streams.
* :mod:`.simulate`: runs them together without processes: deadlock check, bubble, memory.
* :mod:`.executor`: runs a stream with batched point-to-point ops.
* :mod:`.runner`: the engine's runner for a pipeline (``train_batch`` / ``eval_batch``), and
  DeepSpeed's name ``PipelineEngine`` for an engine that has one.
"""

from .module import LayerSpec, PipelineModule, TiedLayerSpec, partition_layers
from .runner import PipelineEngine, PipelineRunner

__all__ = [
    "LayerSpec",
    "PipelineEngine",
    "PipelineModule",
    "PipelineRunner",
    "TiedLayerSpec",
    "partition_layers",
]
