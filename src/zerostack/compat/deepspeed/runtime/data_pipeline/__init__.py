"""``deepspeed.runtime.data_pipeline``: of DeepSpeed's data efficiency pipeline, the data
sampling's dynamic batching (variable batch size and learning rate) and the data routing's
random-LTD (random layer-wise token dropping)."""

from . import data_routing, data_sampling

__all__ = ["data_routing", "data_sampling"]
