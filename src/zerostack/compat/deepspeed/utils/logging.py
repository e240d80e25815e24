"""``deepspeed.utils.logging``: ``logger`` is zerostack's logger (a level set on it, as
Transformers and Lightning do, applies to zerostack's messages) and ``log_dist``."""

from __future__ import annotations

import logging

import torch.distributed as dist

logger = logging.getLogger("zerostack")


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """Log ``message`` on the ranks listed (all when ``ranks`` holds -1; rank 0 when None)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    ranks = [0] if ranks is None else list(ranks)
    if -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


__all__ = ["log_dist", "logger"]
