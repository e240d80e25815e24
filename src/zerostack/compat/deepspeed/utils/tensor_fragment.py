"""``deepspeed.utils.tensor_fragment``: ``fragment_address`` (``numel``, ``start``), a parameter's
slice of a rank's flat partition as DeepSpeed's stage 1-2 checkpoint files hold it
(``param_slice_mappings``)."""

from zerostack.checkpoint.deepspeed_read import _FragmentAddress as fragment_address

__all__ = ["fragment_address"]
