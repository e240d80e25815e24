"""Mixture of experts, as DeepSpeed-MoE defines it: :class:`~zerostack.moe.layer.MoE` (top-1 /
top-2 gating with capacity, token dropping and the auxiliary loss; Residual MoE; with
``ep_size > 1`` the experts split over the grid's ep axis) and
:func:`~zerostack.moe.utils.split_params_into_different_moe_groups_for_optimizer`; and
:mod:`~zerostack.moe.routing` and :mod:`~zerostack.moe.hf_experts`, Hugging Face MoE blocks'
top-k routing and their experts run expert-parallel inside the model's own block (issue 53's
AutoEP; not yet reached from ``initialize``'s config)."""

from .layer import MoE
from .utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

__all__ = ["MoE", "is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]
