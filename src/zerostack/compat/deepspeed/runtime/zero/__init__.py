"""``deepspeed.runtime.zero``: ``Init`` and ``GatheredParameters`` (zerostack's), the
``partition_parameters`` module Transformers enters around ZeRO-3 model construction, and
``parameter_offload``, stage 3's hooks as TRL takes them off and puts them back."""

from zerostack.zero import GatheredParameters, Init

from . import parameter_offload, partition_parameters

__all__ = ["GatheredParameters", "Init", "parameter_offload", "partition_parameters"]
