"""``deepspeed.runtime.data_pipeline.data_sampling``: ``variable_batch_size_and_lr``, samples of
different lengths packed under a token budget, the learning rate scaled by each batch's size."""

from . import variable_batch_size_and_lr

__all__ = ["variable_batch_size_and_lr"]
