"""``deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset``: the ``.idx`` / ``.bin``
indexed dataset Megatron and DeepSpeed's data analyzer write (zerostack's reader and builder,
:mod:`zerostack.data.indexed_dataset`: DeepSpeed's bytes, read-only memory-mapped items)."""

from zerostack.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder

__all__ = ["MMapIndexedDataset", "MMapIndexedDatasetBuilder"]
