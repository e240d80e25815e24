"""``deepspeed.runtime.data_pipeline.data_routing.scheduler``: random-LTD's kept-token schedule."""

from zerostack.data.token_drop import RandomLTDScheduler

__all__ = ["RandomLTDScheduler"]
