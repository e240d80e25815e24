"""``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``."""

from __future__ import annotations

import torch

_CPU = torch.device("cpu")


def clone_tensors_for_torch_save(item, device=_CPU):
    """``item`` with every tensor replaced by a detached copy on ``device`` (lists, tuples and
    dicts walked): a view saved alone would carry its whole base storage into the file."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list | tuple):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
