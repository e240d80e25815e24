"""DeepSpeed warmup schedulers: lr sequences against the formulas, written out independently."""

from __future__ import annotations

import json
import math

import pytest
import torch

from zerostack.optim.lr_schedules import (
    SCHEDULERS,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_lr_scheduler,
    warmup_fraction,
)

REL = 1e-12


def make_opt(lrs=(0.1,)):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def group_lrs(opt):
    return [g["lr"] for g in opt.param_groups]


def warmup_gamma(it, n, kind):
    n = max(2, n)
    if it >= n:
        return 1.0
    return math.log(it + 1) / math.log(n) if kind == "log" else it / n


def decay_gamma(it, n, total):
    n = max(2, n)
    if it < n:
        return math.log(it + 1) / math.log(n)
    return max(0.0, (total - it) / max(1.0, total - n))


def cosine_ratio(it, n, total, min_ratio, cos_min, kind):
    n = max(2, n)
    if it < 0:
        return 0.0
    if it < n:
        r = math.log(it + 1) / math.log(n) if kind == "log" else it / n
        return min_ratio + r * (1 - min_ratio)
    c = (1 + math.cos(math.pi * (it - n + 1) / (total - n))) / 2
    return max(0.0, cos_min + (1 - cos_min) * c)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_sequence(kind):
    opt = make_opt()
    s = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.5, warmup_num_steps=10, warmup_type=kind)
    assert s.last_batch_iteration == -1 and s.optimizer is opt
    assert group_lrs(opt) == [0.01] and s.get_last_lr() == [0.01]
    for it in range(15):
        s.step()
        want = 0.01 + (0.5 - 0.01) * warmup_gamma(it, 10, kind)
        assert s.last_batch_iteration == it
        assert group_lrs(opt) == pytest.approx([want], rel=REL)
        assert s.get_last_lr() == group_lrs(opt) == s.get_lr()
    assert group_lrs(opt) == [0.5]  # held at max after warmup


def test_warmup_fraction_and_tiny_warmup():
    assert warmup_fraction(0, 10, "log") == 0.0
    assert warmup_fraction(4, 10, "linear") == 0.4
    assert warmup_fraction(9, 10, "log") == pytest.approx(1.0, rel=REL)
    # warmup_num_steps is clamped to 2 so the log warmup never divides by log(1)
    s = WarmupLR(make_opt(), warmup_max_lr=1.0, warmup_num_steps=1)
    assert s.warmup_num_steps == 2
    s.step()
    assert s.get_last_lr() == [0.0]
    s.step()
    assert s.get_last_lr() == [1.0]


def test_warmup_lr_per_group_lists():
    opt = make_opt((0.1, 0.2))
    s = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=(1.0, 2.0), warmup_num_steps=8)
    assert group_lrs(opt) == [0.0, 0.1]
    for it in range(12):
        s.step()
        g = warmup_gamma(it, 8, "log")
        assert group_lrs(opt) == pytest.approx([1.0 * g, 0.1 + 1.9 * g], rel=REL)


def test_warmup_lr_without_a_max_warms_up_to_each_groups_own_lr():
    """DeepSpeed's WarmupLR: warmup_max_lr None is the optimizer's lr, per group; WarmupDecayLR
    keeps its 0.001."""
    opt = make_opt((0.1, 0.3))
    s = WarmupLR(opt, warmup_num_steps=4)
    assert group_lrs(opt) == [0.0, 0.0]
    for it in range(6):
        s.step()
        g = warmup_gamma(it, 4, "log")
        assert group_lrs(opt) == pytest.approx([0.1 * g, 0.3 * g], rel=REL)
    assert group_lrs(opt) == [0.1, 0.3]
    d = WarmupDecayLR(make_opt((0.1,)), 100, warmup_num_steps=2)
    d.step()
    d.step()
    assert group_lrs(d.optimizer) == pytest.approx([0.001], rel=REL)  # warmed up, not decayed


def test_warmup_decay_sequence_reaches_zero():
    opt = make_opt((0.1, 0.3))
    total, n = 20, 5
    s = WarmupDecayLR(opt, total, warmup_min_lr=0.0, warmup_max_lr=[1.0, 2.0], warmup_num_steps=n)
    assert isinstance(s, WarmupLR)
    assert group_lrs(opt) == [0.0, 0.0]
    for it in range(total + 5):
        s.step()
        g = decay_gamma(it, n, total)
        assert group_lrs(opt) == pytest.approx([g, 2.0 * g], rel=REL, abs=0.0)
        if it >= total:
            assert group_lrs(opt) == [0.0, 0.0]


def test_warmup_decay_warns_when_total_below_warmup():
    with pytest.warns(UserWarning, match="total_num_steps"):
        WarmupDecayLR(make_opt(), total_num_steps=3, warmup_num_steps=10)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_sequence(kind):
    opt = make_opt((0.1, 0.4))
    total, n, min_ratio, cos_min = 15, 6, 0.1, 0.05
    s = WarmupCosineLR(
        opt,
        total,
        warmup_min_ratio=min_ratio,
        warmup_num_steps=n,
        cos_min_ratio=cos_min,
        warmup_type=kind,
    )
    assert s.org_lrs == [0.1, 0.4]
    assert group_lrs(opt) == [0.0, 0.0] and s.get_last_lr() == [0.0, 0.0]
    for it in range(total):
        s.step()
        r = cosine_ratio(it, n, total, min_ratio, cos_min, kind)
        assert group_lrs(opt) == pytest.approx([0.1 * r, 0.4 * r], rel=REL)
    # after total_num_steps steps (last_batch_iteration == total - 1) the cosine is at its floor
    assert s.last_batch_iteration == total - 1
    assert group_lrs(opt) == pytest.approx([0.1 * cos_min, 0.4 * cos_min], rel=REL)


def test_explicit_iteration_and_resume_without_write():
    s = WarmupCosineLR(make_opt((0.2,)), 100, warmup_num_steps=10, last_batch_iteration=49)
    assert s.get_last_lr() == [0.2]  # nothing written yet: the optimizer's own lr
    s.step(70)
    assert s.last_batch_iteration == 70
    assert s.get_last_lr() == pytest.approx([0.2 * cosine_ratio(70, 10, 100, 0.0, 1e-4, "log")])


@pytest.mark.parametrize(
    "name, params",
    [
        ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.2, "warmup_num_steps": 7}),
        ("WarmupDecayLR", {"total_num_steps": 30, "warmup_max_lr": 0.2, "warmup_num_steps": 7}),
        ("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 7, "cos_min_ratio": 0.1}),
    ],
)
def test_state_dict_round_trip(name, params):
    opt = make_opt((0.1, 0.2))
    s = build_lr_scheduler(opt, name, params)
    assert isinstance(s, SCHEDULERS[name])
    for _ in range(11):
        s.step()
    sd = json.loads(json.dumps(s.state_dict()))
    assert sd["last_batch_iteration"] == 10

    # a fresh run: new optimizer (original lrs), new scheduler, then load
    opt2 = make_opt((0.1, 0.2))
    s2 = build_lr_scheduler(opt2, name, params)
    s2.load_state_dict(sd)
    assert s2.last_batch_iteration == 10
    assert group_lrs(opt2) == group_lrs(opt) and s2.get_last_lr() == s.get_last_lr()
    for _ in range(25):
        s.step()
        s2.step()
        assert group_lrs(opt2) == group_lrs(opt)


def test_cosine_resume_with_decayed_optimizer_keeps_org_lrs():
    opt = make_opt((0.1,))
    s = WarmupCosineLR(opt, 30, warmup_num_steps=5)
    for _ in range(20):
        s.step()
    sd = s.state_dict()
    # the optimizer (its state restored first) now holds a decayed lr, not the original one
    s2 = WarmupCosineLR(make_opt((group_lrs(opt)[0],)), 30, warmup_num_steps=5)
    s2.load_state_dict(sd)
    assert s2.org_lrs == [0.1] and s2.get_last_lr() == s.get_last_lr()
    # DeepSpeed's checkpoints hold only last_batch_iteration; that loads too
    s3 = WarmupCosineLR(make_opt((0.1,)), 30, warmup_num_steps=5)
    s3.load_state_dict({"last_batch_iteration": 19})
    assert s3.get_last_lr() == s.get_last_lr()


@pytest.mark.parametrize("cls", [WarmupLR, WarmupDecayLR, WarmupCosineLR])
def test_bad_warmup_type(cls):
    args = () if cls is WarmupLR else (100,)
    with pytest.raises(ValueError, match="warmup_type.*'log'.*'linear'.*'cosine'"):
        cls(make_opt(), *args, warmup_type="cosine")


@pytest.mark.parametrize("arg", ["warmup_min_lr", "warmup_max_lr"])
def test_wrong_length_list(arg):
    with pytest.raises(ValueError, match=rf"{arg} has 3 values for 2 optimizer param groups"):
        WarmupLR(make_opt((0.1, 0.2)), **{arg: [0.1, 0.2, 0.3]})


def test_unknown_type():
    with pytest.raises(ValueError, match="CyclicLR.*LRRangeTest.*OneCycle.*WarmupCosineLR"):
        build_lr_scheduler(make_opt(), "CyclicLR", {})
