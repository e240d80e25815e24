"""``deepspeed.runtime.data_pipeline.data_sampling``: ``variable_batch_size_and_lr``, samples of
different lengths packed under a token budget, the learning rate scaled by each batch's size;
``data_analyzer``, the per-sample metric files; ``indexed_dataset``, their format."""

from . import data_analyzer, indexed_dataset, variable_batch_size_and_lr

__all__ = ["data_analyzer", "indexed_dataset", "variable_batch_size_and_lr"]
