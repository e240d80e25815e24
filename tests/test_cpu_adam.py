"""CPUAdam against torch's Adam/AdamW (their default single-tensor loops) and a written-out Adam.

Tolerance: 1e-6 relative to the largest magnitude of each tensor, after 20 steps. Both sides
compute in fp32 but in different operation orders (the fused kernel uses a lerp/FMA for
exp_avg), so they differ by a few ulps per step; a wrong formula (a missing bias correction, the
weight decay in the wrong place, a stale lr) is off by 1e-3 or more.
"""

from __future__ import annotations

import copy

import pytest
import torch

from zerostack.optim import CPUAdam

REL = 1e-6
STEPS = 20
# Odd sizes (kernel vector tails), a scalar-like param and a transposed (non-contiguous) one.
SHAPES = [(7,), (3, 5), (1,), (129,), (4, 33), "transposed"]


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in SHAPES:
        if shape == "transposed":
            t = torch.randn(5, 6, generator=g).t()
        else:
            t = torch.randn(*shape, generator=g)
        out.append(torch.nn.Parameter(t))
    return out


def groups(params, weight_decay: float) -> list[dict]:
    # Two groups with different options, so per-group values are honoured.
    return [
        {"params": params[:3], "lr": 1e-2, "weight_decay": weight_decay},
        {
            "params": params[3:],
            "lr": 3e-3,
            "betas": (0.8, 0.99),
            "eps": 1e-6,
            "weight_decay": weight_decay / 2,
        },
    ]


def set_grads(params, step: int, skip=()) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        grad = torch.randn(p.shape, generator=g)
        p.grad = None if i in skip else grad


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = rel_err(a.detach(), b.detach())
    assert err <= REL, f"{what}: relative error {err:.3g} > {REL}"


def train(opt, params, steps: int = STEPS, lr_at=None, skip_at=None, start: int = 0):
    for k in range(start, start + steps):
        set_grads(params, k, skip=skip_at(k) if skip_at else ())
        if lr_at is not None:
            for i, group in enumerate(opt.param_groups):
                group["lr"] = lr_at(k, i)
        opt.step()


def assert_same_run(ours, ref, params_ours, params_ref) -> None:
    for i, (a, b) in enumerate(zip(params_ours, params_ref, strict=True)):
        assert_close(a, b, f"param {i}")
        if b not in ref.state:
            assert a not in ours.state
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(ours.state[a][key], ref.state[b][key], f"param {i} {key}")
        assert ours.state[a]["step"].item() == ref.state[b]["step"].item()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_matches_torch(adamw_mode, weight_decay):
    ours_p, ref_p = make_params(), make_params()
    ours = CPUAdam(groups(ours_p, weight_decay), adamw_mode=adamw_mode)
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref = torch_cls(groups(ref_p, weight_decay), foreach=False)
    train(ours, ours_p)
    train(ref, ref_p)
    assert_same_run(ours, ref, ours_p, ref_p)
    start = make_params()
    moved = max(rel_err(a.detach(), b.detach()) for a, b in zip(ours_p, start, strict=True))
    assert moved > 1e-3  # the comparison is not vacuous


def reference_adam(params, hyper, steps, bias_correction, adamw_mode, skip_at=None):
    """Adam written out in fp32: returns the final params (list of tensors)."""
    ps = [p.detach().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    counts = [0] * len(ps)
    probe = [torch.nn.Parameter(torch.empty(p.shape)) for p in ps]
    for k in range(steps):
        set_grads(probe, k, skip=skip_at(k) if skip_at else ())
        for i, (p, m, v) in enumerate(zip(ps, ms, vs, strict=True)):
            if probe[i].grad is None:
                continue
            lr, (b1, b2), eps, wd = hyper[i]
            g = probe[i].grad.clone()
            counts[i] += 1
            if adamw_mode:
                p.mul_(1 - lr * wd)
            else:
                g = g + wd * p
            m.copy_(b1 * m + (1 - b1) * g)
            v.copy_(b2 * v + (1 - b2) * g * g)
            if bias_correction:
                t = counts[i]
                update = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
            else:
                update = m / (v.sqrt() + eps)
            p.sub_(lr * update)
    return ps


def hyper_of(opt) -> list[tuple]:
    return [
        (g["lr"], g["betas"], g["eps"], g["weight_decay"])
        for g in opt.param_groups
        for _ in g["params"]
    ]


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_matches_written_out_adam(bias_correction, adamw_mode):
    params = make_params()
    opt = CPUAdam(
        groups(params, weight_decay=0.1), bias_correction=bias_correction, adamw_mode=adamw_mode
    )
    expected = reference_adam(params, hyper_of(opt), STEPS, bias_correction, adamw_mode)
    train(opt, params)
    for i, (a, b) in enumerate(zip(params, expected, strict=True)):
        assert_close(a, b, f"param {i}")


def test_without_bias_correction_differs_from_with():
    # Guards the test above: the two modes must be told apart at this tolerance.
    a, b = make_params(), make_params()
    train(CPUAdam(groups(a, 0.0), bias_correction=False), a, steps=3)
    train(CPUAdam(groups(b, 0.0), bias_correction=True), b, steps=3)
    assert max(rel_err(x.detach(), y.detach()) for x, y in zip(a, b, strict=True)) > 1e-3


def test_lr_changed_between_steps_is_used():
    ours_p, ref_p = make_params(), make_params()
    ours = CPUAdam(groups(ours_p, 0.05))
    ref = torch.optim.AdamW(groups(ref_p, 0.05), foreach=False)
    lr_at = lambda k, i: (1e-2, 3e-3)[i] * 0.8**k  # noqa: E731
    train(ours, ours_p, lr_at=lr_at)
    train(ref, ref_p, lr_at=lr_at)
    assert_same_run(ours, ref, ours_p, ref_p)


def test_params_without_grad_are_untouched_and_stateless():
    ours_p, ref_p, start = make_params(), make_params(), make_params()
    ours = CPUAdam(groups(ours_p, 0.1))
    ref = torch.optim.AdamW(groups(ref_p, 0.1), foreach=False)
    # Param 1 never has a gradient; param 4 only on even steps.
    skip_at = lambda k: {1} if k % 2 == 0 else {1, 4}  # noqa: E731
    train(ours, ours_p, skip_at=skip_at)
    train(ref, ref_p, skip_at=skip_at)
    assert torch.equal(ours_p[1], start[1])
    assert ours_p[1] not in ours.state
    assert ours.state[ours_p[4]]["step"].item() == STEPS // 2
    assert_same_run(ours, ref, ours_p, ref_p)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_copy_to_receives_updated_values(dtype):
    params, plain = make_params(), make_params()
    opt = CPUAdam(groups(params, 0.1))
    ref = CPUAdam(groups(plain, 0.1))
    copies = {p: torch.full(p.shape, float("nan"), dtype=dtype) for p in params[1:]}
    for k in range(5):
        set_grads(params, k)
        set_grads(plain, k)
        opt.step(copy_to=copies)
        ref.step()
        for i, p in enumerate(params[1:], start=1):
            assert torch.equal(copies[p], p.detach().to(dtype)), f"step {k} param {i}"
    for i, (a, b) in enumerate(zip(params, plain, strict=True)):
        assert_close(a, b, f"param {i} with copy-out vs without")


def test_copy_to_rejects_strangers_and_bad_shapes():
    params = make_params()
    opt = CPUAdam(groups(params, 0.0))
    set_grads(params, 0)
    with pytest.raises(ValueError, match="not params of this optimizer"):
        opt.step(copy_to={torch.zeros(7): torch.zeros(7, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match=r"group 0, param 0: .* shape \(7,\)"):
        opt.step(copy_to={params[0]: torch.zeros(8, dtype=torch.bfloat16)})
    assert not opt.state  # rejected before anything changed


def test_state_dict_round_trip_continues_identically():
    params = make_params()
    opt = CPUAdam(groups(params, 0.1), bias_correction=False)
    train(opt, params, steps=10)
    saved = copy.deepcopy(opt.state_dict())
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert saved["state"][0]["step"].dtype == torch.float32

    resumed_p = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = CPUAdam(groups(resumed_p, 0.0))  # options come from the state dict
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["bias_correction"] is False
    train(opt, params, steps=10, start=10)
    train(resumed, resumed_p, steps=10, start=10)
    for i, (a, b) in enumerate(zip(resumed_p, params, strict=True)):
        assert torch.equal(a, b), f"param {i}"


def test_loads_torch_adamw_state_dict():
    ours_p, ref_p = make_params(), make_params()
    ref = torch.optim.AdamW(groups(ref_p, 0.1), foreach=False)
    train(ref, ref_p, steps=10)
    ours_p = [torch.nn.Parameter(p.detach().clone()) for p in ref_p]
    ours = CPUAdam(groups(ours_p, 0.0))
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))
    train(ref, ref_p, steps=10, start=10)
    train(ours, ours_p, steps=10, start=10)
    assert_same_run(ours, ref, ours_p, ref_p)


def test_rejects_amsgrad_other_dtypes_and_bad_betas():
    with pytest.raises(ValueError, match="amsgrad"):
        CPUAdam(make_params(), amsgrad=True)
    double = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="torch.float64"):
        CPUAdam([double])
    opt = CPUAdam(make_params())
    with pytest.raises(ValueError, match="torch.float64"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2).double())]})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match=r"betas\[1\]"):
        CPUAdam(make_params(), betas=(0.9, 1.0))


def test_loads_int_steps_as_deepspeed_saves_them():
    params = make_params()
    opt = CPUAdam(groups(params, 0.1))
    train(opt, params, steps=5)
    saved = copy.deepcopy(opt.state_dict())
    for state in saved["state"].values():
        state["step"] = int(state["step"].item())  # DeepSpeedCPUAdam's representation
    resumed_p = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = CPUAdam(groups(resumed_p, 0.1))
    resumed.load_state_dict(saved)
    train(opt, params, steps=5, start=5)
    train(resumed, resumed_p, steps=5, start=5)
    for i, (a, b) in enumerate(zip(resumed_p, params, strict=True)):
        assert torch.equal(a, b), f"param {i}"
    assert resumed.state[resumed_p[0]]["step"].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_param_steps_in_fp32_with_fp32_moments_and_is_rounded(dtype):
    """DeepSpeed's CPU Adam on 16-bit masters (``*_master_weights_and_grads``): the moments in
    fp32, the step in fp32 from the 16-bit value, the result rounded into the param; bit for
    bit torch's AdamW on an fp32 copy rounded after each step."""
    gen = torch.Generator().manual_seed(3)
    start = torch.randn(33, generator=gen).to(dtype)
    ours = torch.nn.Parameter(start.clone())
    ref = torch.nn.Parameter(start.float())
    opt = CPUAdam([ours], lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, fused=True)
    for _ in range(5):
        g = torch.randn(33, generator=gen)
        ours.grad, ref.grad = g.to(dtype), g.to(dtype).float()
        opt.step()
        ref_opt.step()
        with torch.no_grad():
            ref.copy_(ref.to(dtype).float())
        assert torch.equal(ours.detach().float(), ref.detach())
    assert opt.state[ours]["exp_avg"].dtype == torch.float32
    assert torch.equal(opt.state[ours]["exp_avg_sq"], ref_opt.state[ref]["exp_avg_sq"])


def test_without_fp32_optimizer_states_the_moments_are_the_params_dtype():
    gen = torch.Generator().manual_seed(4)
    start = torch.randn(17, generator=gen).bfloat16()
    ours, ref = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt = CPUAdam([ours], lr=1e-2, fp32_optimizer_states=False)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.0, fused=True)
    for _ in range(4):
        g = torch.randn(17, generator=gen).bfloat16()
        ours.grad, ref.grad = g, g.clone()
        opt.step()
        ref_opt.step()
        assert torch.equal(ours.detach(), ref.detach())
    assert opt.state[ours]["exp_avg"].dtype == torch.bfloat16
