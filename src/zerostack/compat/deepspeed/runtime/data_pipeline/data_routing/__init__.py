"""``deepspeed.runtime.data_pipeline.data_routing``: random-LTD, random layer-wise token
dropping (:mod:`zerostack.data.token_drop`)."""

from . import basic_layer, helper, scheduler

__all__ = ["basic_layer", "helper", "scheduler"]
