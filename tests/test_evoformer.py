"""``DS4Sci_EvoformerAttention`` (DeepSpeed4Science's Evoformer attention, served at
``deepspeed.ops.deepspeed4science``) against an independent float64 reference, for the
tutorial's MSA row attention and triangle attention; and DeepSpeed's shape rules.

fp32 to 1e-5: the reference is float64, the op fp32 over at most 24 keys, so the error is a few
fp32 ulps of values of order one (the masked logits, -1e9, contribute exact zeros)."""

from __future__ import annotations

import pytest
import torch

import zerostack.compat.deepspeed as deepspeed
from zerostack.compat.deepspeed.ops.deepspeed4science import DS4Sci_EvoformerAttention
from zerostack.models.evoformer import EvoformerShapeError


def reference(q, k, v, biases):
    """Attention spelled out in float64: logits = Q K^T / sqrt(D) + biases, softmax over the
    keys, times V; inputs [B, N, L, H, D], biases broadcast to [B, N, H, L, L]."""
    q, k, v = (t.double() for t in (q, k, v))
    logits = torch.einsum("bnqhd,bnkhd->bnhqk", q, k) / q.shape[-1] ** 0.5
    for b in biases:
        if b is not None:
            logits = logits + b.double()
    probs = torch.softmax(logits, dim=-1)
    return torch.einsum("bnhqk,bnkhd->bnqhd", probs, v)


def _leaf(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).requires_grad_()


def _mask_bias(*shape, dtype=torch.float32):
    """DeepSpeed's test's mask: 0 where kept, -1e9 where masked; the first key always kept."""
    mask = torch.randint(0, 2, shape).to(dtype)
    mask[..., 0] = 1
    return (1e9 * (mask - 1)).requires_grad_()


def _check_against_reference(q, k, v, biases, tol):
    """Output and every input's gradient against the float64 reference, run on float64 copies
    of the inputs so that its gradients are float64 too."""
    out = DS4Sci_EvoformerAttention(q, k, v, list(biases))
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    q64, k64, v64, *b64 = (
        None if t is None else t.detach().double().requires_grad_() for t in [q, k, v, *biases]
    )
    ref = reference(q64, k64, v64, b64)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    grad_out = torch.randn_like(out)
    named = [("Q", q, q64), ("K", k, k64), ("V", v, v64)]
    named += [(f"bias{i + 1}", b, b_) for i, (b, b_) in enumerate(zip(biases, b64, strict=True))]
    named = [(n, t, t64) for n, t, t64 in named if t is not None]
    got = torch.autograd.grad(out, [t for _, t, _ in named], grad_out)
    want = torch.autograd.grad(ref, [t for _, _, t in named], grad_out.double())
    for (name, _, _), g, w in zip(named, got, want, strict=True):
        msg = lambda m, n=name: f"{n}: {m}"
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol, msg=msg)


def test_msa_row_attention_with_mask_and_pair_bias():
    # (a) Q, K, V: [Batch, N_seq, N_res, Head, Dim]; res_mask: [Batch, N_seq, 1, 1, N_res];
    # pair_bias: [Batch, 1, Head, N_res, N_res]
    torch.manual_seed(0)
    batch, n_seq, n_res, heads, dim = 2, 3, 20, 4, 8
    q, k, v = (_leaf(batch, n_seq, n_res, heads, dim) for _ in range(3))
    res_mask = _mask_bias(batch, n_seq, 1, 1, n_res)
    pair_bias = _leaf(batch, 1, heads, n_res, n_res)
    _check_against_reference(q, k, v, [res_mask, pair_bias], 1e-5)


def test_triangle_attention_around_starting_node():
    # (c) Q, K, V: [Batch, N_res, N_res, Head, Dim]; res_mask: [Batch, N_res, 1, 1, N_res];
    # right_edges: [Batch, 1, Head, N_res, N_res]
    torch.manual_seed(1)
    batch, n_res, heads, dim = 1, 17, 2, 16
    q, k, v = (_leaf(batch, n_res, n_res, heads, dim) for _ in range(3))
    res_mask = _leaf(batch, n_res, 1, 1, n_res)  # a float bias, so its gradient is all nonzero
    right_edges = _leaf(batch, 1, heads, n_res, n_res)
    _check_against_reference(q, k, v, [res_mask, right_edges], 1e-5)


@pytest.mark.parametrize("which", ["none", "bias1", "bias2"])
def test_one_bias_or_none(which):
    # (b) MSA column-wise: one mask bias; and a pair bias alone as [None, bias2]
    torch.manual_seed(2)
    batch, n, seq, heads, dim = 2, 2, 18, 3, 8
    q, k, v = (_leaf(batch, n, seq, heads, dim) for _ in range(3))
    biases = {
        "none": [],
        "bias1": [_mask_bias(batch, n, 1, 1, seq)],
        "bias2": [None, _leaf(batch, 1, heads, seq, seq)],
    }[which]
    _check_against_reference(q, k, v, biases, 1e-5)


def test_bias_without_grad_gets_none_and_others_still_do():
    torch.manual_seed(3)
    q, k, v = (_leaf(1, 2, 17, 2, 8) for _ in range(3))
    mask = torch.zeros(1, 2, 1, 1, 17)
    pair = _leaf(1, 1, 2, 17, 17)
    DS4Sci_EvoformerAttention(q, k, v, [mask, pair]).sum().backward()
    assert mask.grad is None and pair.grad is not None and pair.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_as_deepspeeds_test(dtype):
    """DeepSpeed's own test's tolerances: 1e-2 for fp16, 5e-2 for bf16 (max abs error)."""
    torch.manual_seed(4)
    q, k, v = (_leaf(1, 2, 24, 2, 8, dtype=dtype) for _ in range(3))
    mask, pair = _mask_bias(1, 2, 1, 1, 24, dtype=dtype), _leaf(1, 1, 2, 24, 24, dtype=dtype)
    out = DS4Sci_EvoformerAttention(q, k, v, [mask, pair])
    eps = 1e-2 if dtype == torch.float16 else 5e-2
    assert out.dtype == dtype
    assert (out.double() - reference(q, k, v, [mask, pair])).abs().max() < eps


def test_served_at_deepspeeds_path():
    assert deepspeed.ops.deepspeed4science.DS4Sci_EvoformerAttention is DS4Sci_EvoformerAttention


def _qkv(shape=(1, 2, 17, 2, 8), dtype=torch.float32):
    return [torch.randn(shape, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize(
    "biases, match",
    [
        ([None, None, None], "at most two biases"),
        ([torch.zeros(1, 2, 1, 1, 16)], "bias1 shape is incorrect"),
        ([torch.zeros(1, 2, 17, 1, 1)], "bias1 shape is incorrect"),
        ([None, torch.zeros(1, 2, 2, 17, 17)], "bias2 shape is incorrect"),
        ([None, torch.zeros(1, 1, 1, 17, 17)], "bias2 shape is incorrect"),
    ],
)
def test_deepspeeds_bias_rules(biases, match):
    with pytest.raises(AssertionError, match=match):
        DS4Sci_EvoformerAttention(*_qkv(), biases)


def test_deepspeeds_length_and_head_size_limits():
    with pytest.raises(EvoformerShapeError, match="seq_len must be greater than 16"):
        DS4Sci_EvoformerAttention(*_qkv((1, 2, 16, 2, 8)), [])
    q, k, v = _qkv((1, 1, 17, 1, 65))
    assert DS4Sci_EvoformerAttention(q, k, v, []).shape == q.shape  # forward only: allowed
    with pytest.raises(EvoformerShapeError, match="Hidden size is too large"):
        DS4Sci_EvoformerAttention(q.requires_grad_(), k, v, [])


def test_mismatched_operands_refused():
    q, k, v = _qkv()
    with pytest.raises(EvoformerShapeError, match="K shape"):
        DS4Sci_EvoformerAttention(q, k[:, :, :-1], v, [])
    with pytest.raises(RuntimeError, match="only fp16 and bf16"):
        DS4Sci_EvoformerAttention(*_qkv(dtype=torch.float64), [])
    with pytest.raises(RuntimeError, match="bias1 is torch.float64"):
        DS4Sci_EvoformerAttention(q, k, v, [torch.zeros(1, 2, 1, 1, 17, dtype=torch.float64)])
    with pytest.raises(EvoformerShapeError, match=r"with biases Q must be \[B, N, L, H, D\]"):
        DS4Sci_EvoformerAttention(q[0], k[0], v[0], [None, torch.zeros(2, 1, 2, 17, 17)])
