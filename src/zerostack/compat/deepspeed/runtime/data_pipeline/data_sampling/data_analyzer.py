"""``deepspeed.runtime.data_pipeline.data_sampling.data_analyzer``: per-sample metrics of a
dataset mapped and reduced into DeepSpeed's indexed-dataset files
(:mod:`zerostack.data.analyzer`)."""

from zerostack.data.analyzer import DataAnalyzer

__all__ = ["DataAnalyzer"]
