"""``deepspeed.runtime.sequence_parallel``: DeepSpeed ALST's Ulysses for Hugging Face models
(``ulysses_sp``), served by :mod:`zerostack.sequence.hf_ulysses`."""

from . import ulysses_sp

__all__ = ["ulysses_sp"]
