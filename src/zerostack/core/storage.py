"""Whether two tensors share their storage, for the tensors of a dry run too.

``a.data_ptr() == b.data_ptr()`` answers it for tensors with data; on the meta device (a dry run,
:mod:`zerostack.dryrun`) every pointer is 0 and every pair would look shared. The storage
object itself tells them apart on every device."""

from __future__ import annotations

import torch


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of one storage (wherever in it they start)."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata
