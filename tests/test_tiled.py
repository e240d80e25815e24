"""Tiled compute over the sequence (DeepSpeed ALST's TiledMLP, SequenceTiledCompute,
sequence_tiled_compute, TiledFusedLogitsLoss) against the untiled computation.

Tolerance: 1e-6 of the reference's largest magnitude in fp32. Tiling changes only the order of
the sums that make a parameter's gradient (tile by tile instead of in one matmul), a few fp32
roundings on values of order one. bf16 outputs are held to a few bf16 roundings (2**-8 each).

The memory proofs do not trust the code under test: a TorchDispatchMode records the shape of
every tensor an aten op returns during forward and during backward, and a saved-tensor hook
records what autograd keeps between them.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zerostack.sequence import (
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)

H, FFN, V, B, S = 16, 64, 50, 2, 24


class GatedMLP(nn.Module):
    """A Llama MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(H, FFN, bias=False)
        self.up_proj = nn.Linear(H, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, H, bias=False)
        self.act_fn = nn.SiLU()


def mlp_forward(self, x):
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(H, V)  # with a bias: compute_params below names only the weight


def loss_fn(self, x, y):
    return F.cross_entropy(self.lm_head(x).view(-1, V), y.view(-1))


def sum_loss_fn(self, x, y):
    return F.cross_entropy(self.lm_head(x).view(-1, V), y.view(-1), reduction="sum")


def close(got, ref, tol=1e-6):
    scale = ref.detach().abs().max().clamp_min(1e-30)
    err = (got.detach().float() - ref.detach().float()).abs().max()
    assert err <= tol * scale, f"max error {err:.3g} > {tol:g} * {scale:.3g}"


def grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def setup(seed=0):
    torch.manual_seed(seed)
    mlp = GatedMLP()
    x = torch.randn(B, S, H)
    w = torch.randn(B, S, H)
    return mlp, x, w


def mlp_run(mlp, x0, w, tiled, shards=4, params=True):
    """Output, and gradients of (out * w).sum() by x and the parameters; x is made inside the
    graph (x0 * 2), so its gradient must come back through the Function."""
    mlp.zero_grad(set_to_none=True)
    leaf = x0.clone().requires_grad_(True)
    x = leaf * 2
    if tiled:
        out = TiledMLP.apply(
            mlp_forward, mlp, x, shards, list(mlp.parameters()) if params else None
        )
    else:
        out = mlp_forward(mlp, x)
    (out * w).sum().backward()
    return out, leaf.grad, grads(mlp)


@pytest.mark.parametrize("shards", [1, 4, 5, 24])
@pytest.mark.parametrize("params", [True, False])
def test_tiled_mlp_matches_untiled(shards, params):
    mlp, x, w = setup()
    ref_out, ref_gx, ref_gp = mlp_run(mlp, x, w, tiled=False)
    out, gx, gp = mlp_run(mlp, x, w, tiled=True, shards=shards, params=params)
    close(out, ref_out)
    close(gx, ref_gx)
    for n in ref_gp:
        close(gp[n], ref_gp[n])


def test_tiled_mlp_two_dim_input():
    mlp, x, w = setup()
    x2 = x[0].clone().requires_grad_(True)
    ref = mlp_forward(mlp, x2)
    out = TiledMLP.apply(mlp_forward, mlp, x2, 5, None)
    close(out, ref)


def test_grads_accumulate_once_per_backward_with_two_calls():
    """Two calls of one module, one backward: .grad is summed into (not overwritten), and a
    post-accumulate-grad hook (zerostack's ZeRO reducers use one) fires once, not per tile."""
    mlp, x, w = setup()
    x1, x2 = x, x.flip(1)
    mlp.zero_grad(set_to_none=True)
    (((mlp_forward(mlp, x1) + mlp_forward(mlp, x2)) * w).sum()).backward()
    ref = grads(mlp)
    fired = {n: 0 for n, _ in mlp.named_parameters()}
    for n, p in mlp.named_parameters():
        p.grad = torch.ones_like(p)
        p.register_post_accumulate_grad_hook(lambda p, n=n: fired.__setitem__(n, fired[n] + 1))
    out = TiledMLP.apply(mlp_forward, mlp, x1, 4, None) + TiledMLP.apply(
        mlp_forward, mlp, x2, 5, None
    )
    (out * w).sum().backward()
    for n, p in mlp.named_parameters():
        close(p.grad, ref[n] + 1)
        assert fired[n] == 1, f"{n}: hook fired {fired[n]} times"


def test_no_grad_forward_and_frozen_input():
    mlp, x, w = setup()
    ref = mlp_forward(mlp, x)
    with torch.no_grad():
        out = TiledMLP.apply(mlp_forward, mlp, x.requires_grad_(True), 4, None)
    assert not out.requires_grad
    close(out, ref)
    assert all(p.grad is None for p in mlp.parameters())
    # x without grad: the parameters still get theirs (DeepSpeed's returns no graph here)
    x = x.detach()
    mlp.zero_grad(set_to_none=True)
    (mlp_forward(mlp, x) * w).sum().backward()
    ref_gp = grads(mlp)
    mlp.zero_grad(set_to_none=True)
    (TiledMLP.apply(mlp_forward, mlp, x, 5, None) * w).sum().backward()
    for n, p in mlp.named_parameters():
        close(p.grad, ref_gp[n])


def test_bf16_output_within_bf16_rounding():
    mlp, x, w = setup()
    ref = mlp_forward(mlp, x)
    mlp = mlp.to(torch.bfloat16)
    xb = x.to(torch.bfloat16).requires_grad_(True)
    out = TiledMLP.apply(mlp_forward, mlp, xb, 5, None)
    assert out.dtype == torch.bfloat16
    close(out, ref, tol=8 * 2**-8)
    (out * w.bfloat16()).sum().backward()
    assert xb.grad.dtype == torch.bfloat16
    assert mlp.down_proj.weight.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("reduction", [None, "mean", "sum"])
def test_sequence_tiled_compute_mlp(reduction):
    """DeepSpeed's test wraps the MLP with kwargs_to_pass=dict(self=mlp); here also a passed
    tensor that requires grad (a scale) gets its gradient, and mean/sum reduce the output."""
    mlp, x, w = setup()
    scale0 = torch.randn(H)

    def fn(self, x, w, scale):
        return mlp_forward(self, x) * w * scale

    def run(tiled, shards=5):
        mlp.zero_grad(set_to_none=True)
        xl, scale = x.clone().requires_grad_(True), scale0.clone().requires_grad_(True)
        if tiled:
            out = sequence_tiled_compute(
                fn,
                S,
                shards,
                dict(x=xl, w=w),
                dict(self=mlp, scale=scale),
                "x",
                None,
                output_reduction=reduction,
            )
        else:
            out = fn(mlp, xl, w, scale)
            out = {None: out, "mean": out.mean(), "sum": out.sum()}[reduction]
        (out if reduction else out * w).sum().backward()
        return out, xl.grad, scale.grad, grads(mlp)

    ref = run(False)
    for shards in (1, 4, 5):
        got = run(True, shards)
        for a, b in zip(got[:3], ref[:3], strict=True):
            close(a, b)
        for n in ref[3]:
            close(got[3][n], ref[3][n])


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_sequence_tiled_compute_loss_per_tile(reduction):
    """The tutorial's use: fn returns a tile's summed loss, output_unshard_dimension=0 stacks
    them, "sum" adds them ("mean" divides by the 5 tiles), the caller divides by the count."""
    torch.manual_seed(1)
    head = Head()
    h = torch.randn(B, S, H)
    y = torch.randint(0, V, (B, S))
    y[:, :7] = -100

    def tile_loss(hidden_states, shift_labels, model, vocab_size):
        logits = model.lm_head(hidden_states).view(-1, vocab_size)
        return F.cross_entropy(logits, shift_labels.reshape(-1), reduction="sum")

    hr = h.clone().requires_grad_(True)
    ref = F.cross_entropy(head.lm_head(hr).view(-1, V), y.view(-1))
    ref = ref if reduction == "sum" else ref / 5
    ref.backward()
    ref_w = head.lm_head.weight.grad.clone()
    head.zero_grad(set_to_none=True)
    ht = h.clone().requires_grad_(True)
    kw = dict(hidden_states=ht, shift_labels=y)
    passed = dict(model=head, vocab_size=V)
    total = sequence_tiled_compute(
        tile_loss, S, 5, kw, passed, "hidden_states", [head.lm_head.weight], 0, reduction
    )
    loss = total / (y != -100).sum()
    loss.backward()
    close(loss, ref)
    close(ht.grad, hr.grad)
    close(head.lm_head.weight.grad, ref_w)


def test_deepspeed_style_model_stack():
    """DeepSpeed's own test shape: two tiled MLPs, then the fused loss with ``self`` the whole
    model and compute_params its lm_head weight; every parameter's gradient matches."""
    torch.manual_seed(4)
    mlps, head = nn.ModuleList([GatedMLP(), GatedMLP()]), Head()
    model = nn.ModuleDict(dict(mlps=mlps, head=head))
    x0, y = torch.randn(B, S, H), labels()

    def run(tiled):
        model.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        h = x
        for m in mlps:
            h = (
                TiledMLP.apply(mlp_forward, m, h, 5, list(m.parameters()))
                if tiled
                else mlp_forward(m, h)
            )
        if tiled:
            fn = lambda self, x, y: loss_fn(self["head"], x, y)
            loss = TiledFusedLogitsLoss.apply(
                fn, model, h, y, None, 7, [head.lm_head.weight], "mean"
            )
        else:
            loss = loss_fn(head, h, y)
        loss.backward()
        return loss, x.grad, grads(model)

    ref, got = run(False), run(True)
    close(got[0], ref[0])
    close(got[1], ref[1])
    for n in ref[2]:
        close(got[2][n], ref[2][n])


def labels(first_tile_ignored=True, seed=2):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, V, (B, S), generator=g)
    y[torch.rand(B, S, generator=g) < 0.3] = -100
    if first_tile_ignored:
        y[0, :12] = -100  # the first tile of every tiling below holds no counted label
    return y


def loss_run(head, h0, y, tiled, shards=4, reduction="mean", scale=1.0, mask=None):
    head.zero_grad(set_to_none=True)
    h = h0.clone().requires_grad_(True)
    if tiled:
        fn = loss_fn if reduction == "mean" else sum_loss_fn
        loss = TiledFusedLogitsLoss.apply(
            fn, head, h, y, mask, shards, [head.lm_head.weight], reduction
        )
    else:
        loss = F.cross_entropy(
            head.lm_head(h).view(-1, V),
            y.view(-1),
            reduction="mean" if reduction == "mean" else "sum",
        )
    (loss * scale).backward()
    return loss, h.grad, grads(head)


@pytest.mark.parametrize("shards", [1, 4, 5, 7])
@pytest.mark.parametrize("first_tile_ignored", [False, True])
def test_fused_logits_loss_matches_untiled(shards, first_tile_ignored):
    torch.manual_seed(3)
    head, h, y = Head(), torch.randn(B, S, H), labels(first_tile_ignored)
    ref = loss_run(head, h, y, tiled=False)
    got = loss_run(head, h, y, tiled=True, shards=shards)
    assert torch.isfinite(got[0])
    close(got[0], ref[0])
    close(got[1], ref[1])
    for n in ref[2]:
        close(got[2][n], ref[2][n])


def test_fused_logits_loss_mean_is_over_labels_not_tiles():
    """With tiles holding different label counts, the equal-weight mean of tile means (what
    DeepSpeed's "mean" computes) is measurably different; ours is the token mean."""
    torch.manual_seed(3)
    head, h, y = Head(), torch.randn(B, S, H), labels(False)
    y[0, :10] = -100  # at most 2 counted labels in the first of 4 tiles
    ref = F.cross_entropy(head.lm_head(h).view(-1, V), y.view(-1))
    tiles = [
        F.cross_entropy(head.lm_head(t), u)
        for t, u in zip(h.view(-1, H).tensor_split(4), y.view(-1).tensor_split(4), strict=True)
    ]
    assert (torch.stack(tiles).mean() - ref).abs() > 1e-2
    close(TiledFusedLogitsLoss.apply(loss_fn, head, h, y, None, 4, None, "mean"), ref)


def test_fused_logits_loss_sum_and_scaled_backward():
    """The parameters' gradients follow the incoming gradient (loss / count, loss / GAS); the
    reported ~63x inflation of lm_head's gradient was their ignoring it."""
    torch.manual_seed(3)
    head, h, y = Head(), torch.randn(B, S, H), labels()
    ref = loss_run(head, h, y, tiled=False, reduction="sum", scale=1 / 37)
    got = loss_run(head, h, y, tiled=True, shards=5, reduction="sum", scale=1 / 37)
    for a, b in zip(got[:2], ref[:2], strict=True):
        close(a, b)
    for n in ref[2]:
        close(got[2][n], ref[2][n])


def test_fused_logits_loss_mask_all_ignored_no_grad_and_once():
    torch.manual_seed(3)
    head, h, y = Head(), torch.randn(B, S, H), labels(False)
    mask = torch.rand(B, S) < 0.6

    def masked_fn(self, x, y, m):
        return F.cross_entropy(self.lm_head(x)[m], y[m])

    keep = mask & (y != -100)
    ref = F.cross_entropy(head.lm_head(h)[keep], y[keep])
    close(TiledFusedLogitsLoss.apply(masked_fn, head, h, y, mask, 5, None, "mean"), ref)
    # every label ignored: 0, not nan, and no gradient
    loss = TiledFusedLogitsLoss.apply(
        loss_fn, head, h.requires_grad_(True), torch.full_like(y, -100), None, 4, None, "mean"
    )
    assert loss.item() == 0.0
    # no_grad: the loss only, nothing written to .grad
    head.zero_grad(set_to_none=True)
    with torch.no_grad():
        loss = TiledFusedLogitsLoss.apply(loss_fn, head, h, y, None, 4, None, "mean")
    close(loss, F.cross_entropy(head.lm_head(h).view(-1, V), y.view(-1)))
    assert not loss.requires_grad and head.lm_head.weight.grad is None
    # forward alone writes no .grad; two losses, one backward: summed into .grad once
    ref = loss_run(head, h.detach(), y, tiled=False)[2]
    for p in head.parameters():
        p.grad = torch.ones_like(p)
    a = TiledFusedLogitsLoss.apply(loss_fn, head, h.detach(), y, None, 4, None, "mean")
    b = TiledFusedLogitsLoss.apply(loss_fn, head, h.detach(), y, None, 5, None, "mean")
    assert all((p.grad == 1).all() for p in head.parameters())
    (a + b).backward()
    for n, p in head.named_parameters():
        close(p.grad, 2 * ref[n] + 1)


def test_fused_logits_loss_bf16():
    torch.manual_seed(3)
    head, h, y = Head(), torch.randn(B, S, H), labels()
    ref = F.cross_entropy(head.lm_head(h).view(-1, V), y.view(-1))
    head = head.to(torch.bfloat16)
    loss = TiledFusedLogitsLoss.apply(
        loss_fn, head, h.bfloat16().requires_grad_(True), y, None, 5, None, "mean"
    )
    assert loss.dtype == torch.bfloat16
    close(loss, ref, tol=4 * 2**-8)
    loss.backward()


# ----------------------------------------------------------------------------- memory


class Census(TorchDispatchMode):
    """The shape of every tensor an aten op returns while active."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def widest(shapes, width, weight_shapes):
    """The most elements of any tensor with a dimension ``width``, weights left out."""
    return max((math.prod(s) for s in shapes if width in s and s not in weight_shapes), default=0)


def census(forward):
    fwd, bwd = Census(), Census()
    with fwd:
        out = forward()
    with bwd:
        out.sum().backward()
    return fwd.shapes, bwd.shapes


def test_tiled_mlp_hidden_exists_one_tile_at_a_time():
    mlp, x, _ = setup()
    weights = {(FFN, H), (H, FFN)}
    x = x.requires_grad_(True)
    full, tile = B * S * FFN, B * (S // 4) * FFN
    ref = census(lambda: mlp_forward(mlp, x))
    assert widest(ref[0], FFN, weights) == full and widest(ref[1], FFN, weights) == full
    got = census(lambda: TiledMLP.apply(mlp_forward, mlp, x, 4, None))
    assert widest(got[0], FFN, weights) == tile and widest(got[1], FFN, weights) == tile
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel()) or t, lambda t: t
    ):
        TiledMLP.apply(mlp_forward, mlp, x, 4, None)
    assert saved == [B * S * H]  # x alone, no hidden


def test_fused_logits_loss_never_makes_full_logits():
    torch.manual_seed(3)
    head, y = Head(), labels(False)
    h = torch.randn(B, S, H, requires_grad=True)
    weights = {(V, H), (H, V)}
    ref = census(lambda: F.cross_entropy(head.lm_head(h).view(-1, V), y.view(-1)))
    assert widest(ref[0], V, weights) == B * S * V and widest(ref[1], V, weights) == B * S * V
    got = census(lambda: TiledFusedLogitsLoss.apply(loss_fn, head, h, y, None, 4, None, "mean"))
    tile = math.ceil(B * S / 4) * V
    assert widest(got[0], V, weights) == tile and widest(got[1], V, weights) <= tile
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.shape) or t, lambda t: t
    ):
        TiledFusedLogitsLoss.apply(loss_fn, head, h, y, None, 4, None, "mean")
    assert max(math.prod(s) for s in saved if V in s and s not in weights) <= tile


# ----------------------------------------------------------------------------- errors


def test_bad_input_errors():
    mlp, x, _ = setup()
    with pytest.raises(ValueError, match="shards=25 must be between 1 and the 24"):
        TiledMLP.apply(mlp_forward, mlp, x, 25, None)
    with pytest.raises(ValueError, match="shards=0"):
        TiledMLP.apply(mlp_forward, mlp, x, 0, None)
    head, y = Head(), labels()
    with pytest.raises(ValueError, match="shards=49 must be between 1 and the 48"):
        TiledFusedLogitsLoss.apply(loss_fn, head, x, y, None, 49, None, "mean")
    with pytest.raises(ValueError, match="output_reduction 'avg'"):
        TiledFusedLogitsLoss.apply(loss_fn, head, x, y, None, 2, None, "avg")
    with pytest.raises(ValueError, match="differ in batch/seq"):
        TiledFusedLogitsLoss.apply(loss_fn, head, x, y[:, :5], None, 2, None, "mean")
    with pytest.raises(ValueError, match="mask must be"):
        TiledFusedLogitsLoss.apply(loss_fn, head, x, y, y[:, :5], 2, None, "mean")
    with pytest.raises(ValueError, match="grad_requiring_tensor_key 'h'"):
        sequence_tiled_compute(mlp_forward, S, 2, dict(x=x), dict(self=mlp), "h")
    with pytest.raises(ValueError, match=r"kwargs_to_shard\['x'\] must be \[b, seqlen=23"):
        sequence_tiled_compute(mlp_forward, 23, 2, dict(x=x), dict(self=mlp), "x")
    with pytest.raises(ValueError, match="output_reduction 'max'"):
        SequenceTiledCompute.apply(mlp_forward, S, 2, ["x"], ["self"], "x", None, 1, "max", x, mlp)
