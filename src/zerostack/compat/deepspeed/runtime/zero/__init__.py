"""``deepspeed.runtime.zero``: ``Init`` and ``GatheredParameters`` (zerostack's), the
``partition_parameters`` module Transformers enters around ZeRO-3 model construction,
``parameter_offload`` (stage 3's hooks as TRL takes them off and puts them back) and
``offload_config``'s enums for ``engine.offload_states()``."""

from zerostack.zero import GatheredParameters, Init

from . import offload_config, parameter_offload, partition_parameters

__all__ = [
    "GatheredParameters",
    "Init",
    "offload_config",
    "parameter_offload",
    "partition_parameters",
]
