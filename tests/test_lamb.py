"""The config's ``"optimizer": {"type": "Lamb"}``: zerostack's :class:`~zerostack.optim.Lamb`
against the arithmetic of DeepSpeed's FusedLamb kernel (``ops/csrc/lamb/
fused_lamb_cuda_kernel.cu``: parts 1-3), written out here element by element. DeepSpeed's
kernel is CUDA only (no CPU build), so no golden run of it exists on this machine; the update
is held to the kernel's formula, and the sharded update to one process's in test_parity.py
(families ``lamb-*``: at ZeRO 0-3 each parameter's trust ratio, where DeepSpeed's ZeRO takes
one per flat partition)."""

from __future__ import annotations

import math

import pytest
import torch

from zerostack.config import ConfigError, load_config
from zerostack.optim import Lamb, build_optimizer


def kernel_step(w, m, v, g, t, *, lr, b1, b2, eps, eps_inside_sqrt, decay, max_c, min_c, bc):
    """One FusedLamb step on flat lists of floats, as the kernel computes it; returns
    ``(w, m, v, coefficient)``."""
    m = [b1 * mj + (1 - b1) * gj for mj, gj in zip(m, g, strict=True)]
    v = [b2 * vj + (1 - b2) * gj * gj for vj, gj in zip(v, g, strict=True)]

    def update(j):
        denom = math.sqrt(v[j] + eps) if eps_inside_sqrt else math.sqrt(v[j]) + eps
        return m[j] / denom + decay * w[j]

    reg_w = math.sqrt(sum(x * x for x in w))
    reg_u = math.sqrt(sum(update(j) ** 2 for j in range(len(w))))
    coeff = 1.0
    if reg_w != 0 and reg_u != 0:
        coeff = min(max(reg_w / reg_u, min_c), max_c)
    step_size = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if bc else lr
    w = [w[j] - step_size * coeff * update(j) for j in range(len(w))]
    return w, m, v, coeff


CASES = {
    "defaults": dict(),
    "decay-eps-inside": dict(weight_decay=0.1, eps_inside_sqrt=True, eps=1e-3),
    "no-bias-correction": dict(bias_correction=False, betas=(0.8, 0.9)),
    "clamped-high": dict(max_coeff=0.05, lr=0.1),  # ||w|| / ||u|| is about 0.3 here
    "clamped-low": dict(min_coeff=3.0, max_coeff=10.0, lr=0.01),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_step_is_fusedlambs_kernel_arithmetic(name):
    kw = CASES[name]
    opts = dict(lr=1e-2, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                eps_inside_sqrt=False, max_coeff=10.0, min_coeff=0.01)  # fmt: skip
    opts.update(kw)
    gen = torch.Generator().manual_seed(5)
    shapes = [(6, 4), (5,), (3, 3)]
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in shapes
    ]
    opt = Lamb(params, **opts)
    ref = [(p.detach().reshape(-1).tolist(), [0.0] * p.numel(), [0.0] * p.numel()) for p in params]
    coeffs_seen = set()
    for t in range(1, 4):
        grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        new_ref = []
        for (w, m, v), g, c in zip(ref, grads, opt.get_lamb_coeffs(), strict=True):
            w, m, v, coeff = kernel_step(
                w, m, v, g.reshape(-1).tolist(), t, lr=opts["lr"], b1=opts["betas"][0],
                b2=opts["betas"][1], eps=opts["eps"], eps_inside_sqrt=opts["eps_inside_sqrt"],
                decay=opts["weight_decay"], max_c=opts["max_coeff"], min_c=opts["min_coeff"],
                bc=opts["bias_correction"],
            )  # fmt: skip
            assert c == pytest.approx(coeff, rel=1e-12)
            coeffs_seen.add(round(coeff, 12))
            new_ref.append((w, m, v))
        ref = new_ref
        for p, (w, _, _) in zip(params, ref, strict=True):
            assert torch.allclose(p.detach().reshape(-1), torch.tensor(w, dtype=torch.float64),
                                  rtol=1e-12, atol=1e-14), (name, t)  # fmt: skip
    if name == "clamped-high":
        assert coeffs_seen == {0.05}
    if name == "clamped-low":
        assert coeffs_seen == {3.0}


def test_a_zero_weight_takes_a_coefficient_of_one():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    p.grad = torch.ones(4, dtype=torch.float64)
    opt = Lamb([p], lr=0.1)
    opt.step()
    assert opt.get_lamb_coeffs() == [1.0]
    # m = 0.1, v = 0.001: the step is 0.1 * sqrt(0.001) / 0.1 * 0.1 / (sqrt(0.001) + 1e-8), 0.1
    assert torch.allclose(p.detach(), torch.full((4,), -0.1, dtype=torch.float64), rtol=1e-6)


def test_the_configs_keys_reach_the_optimizer():
    spec = {"type": "lamb", "params": {"lr": 0.01, "bias_correction": False, "betas": [0.8, 0.9],
                                       "eps": 1e-6, "eps_inside_sqrt": True, "weight_decay": 0.1,
                                       "max_coeff": 5.0, "min_coeff": 0.1}}  # fmt: skip
    p = [torch.nn.Parameter(torch.zeros(3))]
    got = build_optimizer(load_config({"optimizer": spec}).optimizer, [{"params": p}])
    assert isinstance(got, Lamb)
    assert got.defaults == {"lr": 0.01, "bias_correction": False, "betas": (0.8, 0.9),
                            "eps": 1e-6, "eps_inside_sqrt": True, "weight_decay": 0.1,
                            "max_coeff": 5.0, "min_coeff": 0.1}  # fmt: skip


@pytest.mark.parametrize(
    "params,key,message",
    [
        ({"amsgrad": True}, "amsgrad", "FusedLamb does not support the AMSGrad variant"),
        ({"max_grad_norm": 1.0}, "max_grad_norm", "unknown key"),
        ({"min_coeff": 2.0, "max_coeff": 1.0}, "min_coeff", "2.0 is above max_coeff 1.0"),
    ],
)
def test_bad_params_are_refused_naming_the_key(params, key, message):
    with pytest.raises(ConfigError, match=rf"optimizer\.params\.{key}: {message}"):
        load_config({"optimizer": {"type": "Lamb", "params": params}})


def test_deepspeeds_fusedlamb_is_served_with_its_arguments():
    from zerostack.compat.deepspeed.ops.lamb import FusedLamb

    p = [torch.nn.Parameter(torch.zeros(3))]
    opt = FusedLamb(p, lr=0.5, eps_inside_sqrt=True, max_coeff=3.0)
    assert isinstance(opt, Lamb) and opt.defaults["eps_inside_sqrt"] is True
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedLamb(p, amsgrad=True)
    with pytest.raises(ValueError, match="gradient_clipping"):
        FusedLamb(p, max_grad_norm=1.0)
