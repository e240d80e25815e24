"""``deepspeed.utils.groups``: Transformers and Accelerate ask it for the sequence-parallel group
when Hugging Face sequence parallelism (DeepSpeed's ALST, ``UlyssesSPAttentionHF``) is on.

zerostack keeps no global group registry (``engine.topology`` holds every group), and does not
serve ALST yet, so these getters say so instead of answering for a group that does not exist.
"""

from __future__ import annotations


def _no_registry(name: str):
    def getter(*args, **kwargs):
        raise RuntimeError(
            f"deepspeed.utils.groups.{name}: zerostack keeps no global group registry and does "
            f"not serve Hugging Face sequence parallelism (ALST) yet; its groups are on "
            f"engine.topology"
        )

    getter.__name__ = name
    return getter


_get_sequence_parallel_group = _no_registry("_get_sequence_parallel_group")
_get_sequence_parallel_world_size = _no_registry("_get_sequence_parallel_world_size")
_get_sequence_parallel_rank = _no_registry("_get_sequence_parallel_rank")
