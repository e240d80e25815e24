"""``deepspeed.runtime.data_pipeline.data_routing.helper``: wrap a model's layers for random-LTD
and save its state dict without the wrappers."""

from zerostack.data.token_drop import (
    convert_to_random_ltd,
    remove_random_ltd_state_dict,
    save_without_random_ltd,
)

__all__ = ["convert_to_random_ltd", "remove_random_ltd_state_dict", "save_without_random_ltd"]
