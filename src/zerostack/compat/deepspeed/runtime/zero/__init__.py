"""``deepspeed.runtime.zero``: ``Init`` and ``GatheredParameters`` (zerostack's), and the
``partition_parameters`` module Transformers enters around ZeRO-3 model construction."""

from zerostack.zero import GatheredParameters, Init

from . import partition_parameters

__all__ = ["GatheredParameters", "Init", "partition_parameters"]
