"""Mixture of experts, as DeepSpeed-MoE defines it: :class:`~zerostack.moe.layer.MoE` (top-1 /
top-2 gating with capacity, token dropping and the auxiliary loss; Residual MoE) and
:func:`~zerostack.moe.utils.split_params_into_different_moe_groups_for_optimizer`. Expert
parallelism (``ep_size > 1``) is not built yet."""

from .layer import MoE
from .utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

__all__ = ["MoE", "is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]
