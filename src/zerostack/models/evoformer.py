"""Evoformer attention (AlphaFold's MSA and triangle attention) with up to two additive biases:
DeepSpeed4Science's ``DS4Sci_EvoformerAttention`` in plain torch.

DeepSpeed runs a CUTLASS kernel; this runs :func:`torch.nn.functional.scaled_dot_product_attention`
with the biases as a float ``attn_mask``, so on a GPU torch's memory-efficient kernel does the
work (it keeps no ``L x L`` softmax for the backward) and on a CPU its own kernels do. Autograd
gives gradients to Q, K, V and to each bias that requires them, as DeepSpeed's backward does
(it returns ``dB1`` and ``dB2`` whenever they are asked for)::

    # Q, K, V: [Batch, N_seq, N_res, Head, Dim]; mask: [Batch, N_seq, 1, 1, N_res];
    # pair_bias: [Batch, 1, Head, N_res, N_res]
    out = DS4Sci_EvoformerAttention(Q, K, V, [mask, pair_bias])

The math, for each batch ``b``, row ``n`` and head ``h``::

    out[b, n, :, h] = softmax(Q[b, n, :, h] @ K[b, n, :, h].T / sqrt(D)
                              + bias1[b, n, 0, 0] + bias2[b, 0, h]) @ V[b, n, :, h]

Where it differs from DeepSpeed 0.19.8: fp32 is accepted on the CPU (the kernel takes fp16 and
bf16 only, on CUDA only); the ``biases`` list passed in is left as it is (DeepSpeed appends
``None`` to it); with two biases their sum, ``[B, N, H, L, L]``, is made (the kernel reads them
apart). DeepSpeed's shape rules are kept, its kernel's limits included, so what runs here runs
there: at most two biases of those shapes, more than 16 positions, and a head size of at most
64 when a gradient is to be taken (DeepSpeed refuses that in the backward; here the forward).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

MIN_SEQ = 16
"""DeepSpeed's kernel needs more positions than this (``Q.shape[-3] > 16``)."""
MAX_HEAD_DIM = 64
"""The largest head size DeepSpeed's backward kernel takes (its ``kMax``)."""


class EvoformerShapeError(ValueError, AssertionError):
    """Shapes DeepSpeed's ``DS4Sci_EvoformerAttention`` refuses (with an ``assert``: this is an
    ``AssertionError`` too, so code written against DeepSpeed catches it the same way)."""


def _check_dtypes(q: torch.Tensor, tensors: Sequence[tuple[str, torch.Tensor | None]]) -> None:
    """fp16 or bf16 as DeepSpeed's kernel; fp32 also on the CPU, where there is no kernel to
    match. Every operand in Q's dtype: the kernel reads them all as Q's element type."""
    allowed = (torch.float16, torch.bfloat16)
    if q.dtype not in allowed and not (q.dtype == torch.float32 and q.device.type == "cpu"):
        raise RuntimeError(
            f"DS4Sci_EvoformerAttention: Q is {q.dtype} on {q.device.type}: only fp16 and bf16 "
            "are supported (and fp32 on the CPU)"
        )
    for name, t in tensors:
        if t is not None and t.dtype != q.dtype:
            raise RuntimeError(
                f"DS4Sci_EvoformerAttention: {name} is {t.dtype}, Q is {q.dtype}: all operands "
                "must share Q's dtype"
            )


def _check_shapes(q, k, v, bias1, bias2) -> None:
    """DeepSpeed's asserts on the bias shapes and the sequence length, and what its kernel
    assumes without checking (K and V shaped as Q; Q five-dimensional when a bias is given,
    since the bias shapes are read from ``Q.shape[0:4]`` as batch, rows, positions, heads)."""
    if q.dim() < 3:
        raise EvoformerShapeError(f"Q must be [*, L, H, D]; got shape {tuple(q.shape)}")
    for name, t in (("K", k), ("V", v)):
        if t.shape != q.shape:
            raise EvoformerShapeError(
                f"{name} shape {tuple(t.shape)} must equal Q's {tuple(q.shape)}"
            )
    if q.shape[-3] <= MIN_SEQ:
        raise EvoformerShapeError(
            f"seq_len must be greater than {MIN_SEQ}: Q.shape[-3] is {q.shape[-3]}"
        )
    if (bias1 is not None or bias2 is not None) and q.dim() != 5:
        raise EvoformerShapeError(
            f"with biases Q must be [B, N, L, H, D]; got shape {tuple(q.shape)}"
        )
    if bias1 is not None:
        want = (q.shape[0], q.shape[1], 1, 1, q.shape[2])
        if tuple(bias1.shape) != want:
            raise EvoformerShapeError(
                f"bias1 shape is incorrect: {tuple(bias1.shape)}, expected {want} [B, N, 1, 1, L]"
            )
    if bias2 is not None:
        want = (q.shape[0], 1, q.shape[3], q.shape[2], q.shape[2])
        if tuple(bias2.shape) != want:
            raise EvoformerShapeError(
                f"bias2 shape is incorrect: {tuple(bias2.shape)}, expected {want} [B, 1, H, L, L]"
            )


def _batched_mask(q: torch.Tensor, bias1, bias2) -> torch.Tensor | None:
    """The biases as one ``attn_mask`` over the flattened batch ``[B * N, H|1, L|1, L]``.
    A single bias stays broadcast (a view when the batch is 1); two are summed once."""
    if bias1 is None and bias2 is None:
        return None
    b, n, seq, heads, _ = q.shape
    if bias2 is None:
        return bias1.reshape(b * n, 1, 1, seq)
    full = bias2 if bias1 is None else bias1 + bias2
    return full.expand(b, n, heads, seq, seq).reshape(b * n, heads, seq, seq)


def evoformer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias1: torch.Tensor | None = None,
    bias2: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over ``[*, L, H, D]`` tensors with scale ``1/sqrt(D)``, softmax over the keys,
    and the optional biases ``bias1`` ``[B, N, 1, 1, L]`` and ``bias2`` ``[B, 1, H, L, L]``
    added to the logits. Returns a contiguous tensor shaped as ``q``."""
    _check_shapes(q, k, v, bias1, bias2)
    _check_dtypes(q, (("K", k), ("V", v), ("bias1", bias1), ("bias2", bias2)))
    grads = any(t is not None and t.requires_grad for t in (q, k, v, bias1, bias2))
    if grads and torch.is_grad_enabled() and q.shape[-1] > MAX_HEAD_DIM:
        raise EvoformerShapeError(
            f"Hidden size is too large ({q.shape[-1]} > {MAX_HEAD_DIM}): DeepSpeed's backward "
            "kernel takes head sizes up to 64"
        )
    seq, heads, dim = q.shape[-3:]

    def heads_first(t: torch.Tensor) -> torch.Tensor:  # [*, L, H, D] -> [batch, H, L, D]
        return t.reshape(-1, seq, heads, dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(
        heads_first(q),
        heads_first(k),
        heads_first(v),
        attn_mask=_batched_mask(q, bias1, bias2),
        scale=1.0 / math.sqrt(dim),
    )
    return out.transpose(1, 2).reshape(q.shape).contiguous()


def DS4Sci_EvoformerAttention(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    biases: Sequence[torch.Tensor | None],
) -> torch.Tensor:
    """DeepSpeed's ``DS4Sci_EvoformerAttention(Q, K, V, biases)``: ``biases`` holds at most two
    tensors, ``[bias1]`` or ``[bias1, bias2]``, either of which may be None (``[None, bias2]``
    for a pair bias alone). See the module's docstring for the shapes and the math."""
    if len(biases) > 2:
        raise EvoformerShapeError(f"at most two biases; got {len(biases)}")
    bias1, bias2 = (list(biases) + [None, None])[:2]
    return evoformer_attention(Q, K, V, bias1, bias2)


__all__ = ["DS4Sci_EvoformerAttention", "EvoformerShapeError", "evoformer_attention"]
