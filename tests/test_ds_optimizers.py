"""DeepSpeed's CPU Lion and Adagrad, which Accelerate builds when the optimizer is offloaded
(``deepspeed.ops.lion.DeepSpeedCPULion``, ``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad``), served
as torch code: after each of 4 steps on two param groups, the parameters equal DeepSpeed
0.19.8's compiled kernels' (tests/golden/deepspeed_optimizers.json, from
scripts/deepspeed_optimizers.py) within 1e-6, and Lion equals its formula written out here."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from zerostack.compat.deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
from zerostack.compat.deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from deepspeed_optimizers import CASES, problem, run  # noqa: E402

GOLDEN = json.load(open(os.path.join(ROOT, "tests", "golden", "deepspeed_optimizers.json")))
CLASSES = {"DeepSpeedCPULion": DeepSpeedCPULion, "DeepSpeedCPUAdagrad": DeepSpeedCPUAdagrad}


@pytest.mark.parametrize("name", list(CASES))
def test_each_step_equals_deepspeeds_kernel(name):
    assert GOLDEN["versions"]["deepspeed"] == "0.19.8"
    got, want = run(CLASSES[name], CASES[name]), GOLDEN["results"][name]
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for a, b in zip(g, w, strict=True):
            torch.testing.assert_close(
                torch.tensor(a), torch.tensor(b), rtol=1e-6, atol=1e-6, msg=f"step {step}"
            )


def test_lion_is_the_papers_update():
    start, grads = problem()
    lr, (b1, b2), wd = 0.05, (0.9, 0.99), 0.1
    p = torch.nn.Parameter(start[0].clone())
    opt = FusedLion([p], lr=lr, betas=(b1, b2), weight_decay=wd)
    want, m = start[0].clone(), torch.zeros_like(start[0])
    for step in grads:
        p.grad = step[0].clone()
        opt.step()
        want = want * (1 - lr * wd) - lr * torch.sign(b1 * m + (1 - b1) * step[0])
        m = b2 * m + (1 - b2) * step[0]
        assert torch.equal(p.detach(), want)


def test_adagrad_refuses_amsgrad():
    with pytest.raises(ValueError, match=r"amsgrad=True\): Adagrad has no amsgrad variant"):
        DeepSpeedCPUAdagrad([torch.nn.Parameter(torch.zeros(2))], amsgrad=True)
