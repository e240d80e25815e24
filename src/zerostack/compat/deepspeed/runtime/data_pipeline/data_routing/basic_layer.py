"""``deepspeed.runtime.data_pipeline.data_routing.basic_layer``: the random-LTD layer wrapper."""

from zerostack.data.token_drop import RandomLayerTokenDrop

__all__ = ["RandomLayerTokenDrop"]
