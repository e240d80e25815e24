"""Profiling: DeepSpeed's flops profiler and the analytic transformer flops behind MFU.

from zerostack.profiling import FlopsProfiler, get_model_profile   # or, as in DeepSpeed,
from zerostack.profiling.flops_profiler import get_model_profile
from zerostack.profiling import transformer_flops, model_flops_utilization
"""

from .flops import model_flops_utilization, transformer_flops
from .flops_profiler import FlopsProfiler, get_model_profile

__all__ = ["FlopsProfiler", "get_model_profile", "model_flops_utilization", "transformer_flops"]
