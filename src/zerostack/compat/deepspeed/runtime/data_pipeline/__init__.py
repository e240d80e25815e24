"""``deepspeed.runtime.data_pipeline``: of DeepSpeed's data efficiency pipeline, the data
sampling's dynamic batching (variable batch size and learning rate)."""

from . import data_sampling

__all__ = ["data_sampling"]
