"""Cross-entropy over vocabulary-split logits, without gathering them.

Each tp rank holds the logits of its ``V / tp`` vocabulary entries. The loss needs, per token, the
maximum logit (for a stable exponent), the sum of exponentials and the target's logit: two
all-reduces of ``tokens`` and ``2 x tokens`` numbers, instead of an all-gather of
``tokens x V``. The gradient, ``softmax - onehot``, is computed locally.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm import Comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, comm):
        rank = comm.topo.rank("tp")
        local_v = logits.shape[-1]
        lo = rank * local_v
        z = logits.float()
        zmax = z.max(dim=-1).values
        comm.all_reduce(zmax, axis="tp", op=dist.ReduceOp.MAX)
        z = z - zmax.unsqueeze(-1)
        outside = (targets < lo) | (targets >= lo + local_v)
        local = (targets - lo).masked_fill(outside, 0)
        target_z = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = z.exp()
        both = torch.stack([exp.sum(dim=-1), target_z])  # one all-reduce for the two sums
        comm.all_reduce(both, axis="tp")
        sum_exp, target_z = both[0], both[1]
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)
        ctx.in_dtype = logits.dtype
        return sum_exp.log() - target_z

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), (outside.float() - 1.0).unsqueeze(-1))
        g.mul_(grad.unsqueeze(-1))
        return g.to(ctx.in_dtype), None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, comm: Comm
) -> torch.Tensor:
    """Per-token cross-entropy (fp32, shape of ``targets``) of vocabulary-split ``logits``.

    ``logits[..., v]`` is entry ``tp_rank * V/tp + v`` of the vocabulary. Equal to
    ``F.cross_entropy(full_logits, targets, reduction="none")``; ``.mean()`` is the usual loss.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} do not match "
            f"targets {tuple(targets.shape)} (expected logits of shape targets + [V / tp])"
        )
    if comm.topo.tp == 1:
        flat = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
        )
        return flat.view(targets.shape)
    return _VocabParallelCrossEntropy.apply(logits, targets, comm)
