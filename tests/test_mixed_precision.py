"""16-bit parity: fp16 and bf16 training against a single-process mixed-precision reference.

The reference (tests/support/parity.py ``mixed_reference``) is written in the test, not taken from
the library: the model computes in 16 bits, the loss is scaled by the same static loss scale (fp16),
gradients accumulate in 16 bits, are unscaled in fp32 and step fp32 master weights. The engine
differs from it only in where sums are rounded to 16 bits (per-rank means, the reduction over
dp, tp slices, pipeline stages), so the two agree to a few units of the 16-bit rounding error
u (2**-8 in bf16, 2**-11 in fp16) and no better.

What is compared, per step: the update of the fp32 masters (after minus before, all parameters
as one vector; with SGD it is -lr times the gradient, so it carries every factor of the gradient)
and the gradient norm. Tolerance ``TOL[dtype]`` is 8 u: a gradient element goes through about
four 16-bit roundings (activations, its own product, accumulation, the reduction), each at most u,
and we leave a factor of two. A x2 (or x1/2) error in the gradient makes the relative error of
either figure 0.5 or more, far above 8 u = 0.03 (bf16) / 0.004 (fp16); each test also checks
that the tolerance would reject the engine's own numbers scaled by 2.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.parity import _model, describe, merge_stages, mixed_reference, run_cases
from tests.support.ranks import run_distributed

pytestmark = pytest.mark.distributed  # every test here starts ranks

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
U = {"fp16": 2.0**-11, "bf16": 2.0**-8}
TOL = {name: 8 * u for name, u in U.items()}
LOSS_SCALE = 1024.0
OPT_GAS = [("sgd", 1), ("sgd", 2), ("adamw", 2)]


def _flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state[k].float().reshape(-1) for k in sorted(state)])


def _rel(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm())


def _errors(steps, ref, start) -> list[tuple[float, float, float, float]]:
    """Per step: relative error of the update and of the norm, and the same for the engine's
    figures doubled (what a x2 scale error would give)."""
    out = []
    before, ref_before = start, start
    for (state, norm), (ref_state, ref_norm) in zip(steps, ref, strict=True):
        upd, ref_upd = _flat(state) - before, _flat(ref_state) - ref_before
        out.append(
            (
                _rel(upd, ref_upd),
                _rel(norm, ref_norm),
                _rel(2 * upd, ref_upd),
                _rel(2 * norm, ref_norm),
            )
        )
        before, ref_before = _flat(state), _flat(ref_state)
    return out


FAMILIES = {
    "dp2": (2, [{"stage": s} for s in (0, 1, 2, 3)]),
    "tp2": (2, [{"stage": 0, "tp": 2}]),
    "pp2": (2, [{"stage": 0, "pp": 2}]),
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_matches_mixed_precision_reference(precision, family):
    world, layouts = FAMILIES[family]
    cases = [
        {**layout, "optimizer": opt, "gas": gas, "precision": precision, "loss_scale": LOSS_SCALE}
        for layout in layouts
        for opt, gas in OPT_GAS
    ]
    results = merge_stages(run_distributed(run_cases, world, args=(cases,), timeout=300))
    start = _flat({k: v.detach() for k, v in _model().named_parameters()})
    tol = TOL[precision]
    failures = []
    for case, steps in zip(cases, results, strict=True):
        ref = mixed_reference(case["optimizer"], case["gas"], DTYPES[precision], LOSS_SCALE)
        for step, (upd, norm, upd2, norm2) in enumerate(_errors(steps, ref, start)):
            assert norm2 > tol and (upd2 > tol or case["optimizer"] == "adamw")
            if (upd > tol and case["optimizer"] == "sgd") or norm > tol:
                failures.append(
                    f"{describe(case)}, step {step}: update off by {upd:.2e}, "
                    f"norm by {norm:.2e} (tolerance {tol:.1e})"
                )
    assert not failures, "\n".join(failures)
