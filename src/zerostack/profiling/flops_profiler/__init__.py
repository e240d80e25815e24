"""DeepSpeed's ``deepspeed.profiling.flops_profiler``: ``FlopsProfiler`` and ``get_model_profile``
over ``torch.utils.flop_counter.FlopCounterMode`` (see :mod:`.profiler` for what is counted)."""

from .profiler import FlopsProfiler, ModuleProfile, flop_formulas, get_model_profile, param_count
from .units import (
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "FlopsProfiler",
    "ModuleProfile",
    "bytes_to_string",
    "duration_to_string",
    "flop_formulas",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "param_count",
    "params_to_string",
]
