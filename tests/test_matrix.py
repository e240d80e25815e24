"""The composition matrix (tests/support/matrix.py): every combination of pp, dp, ep, tp (with and
without Megatron's sequence parallelism), sp (Ulysses and ring attention), the pipeline's
schedule, ZeRO stage 0-3, fp32 / bf16 and CPU offload that fits in 4 ranks either trains as one
process does or is refused before any work in one line naming two of its settings;
docs/reference/matrix.md is this run's table."""

from __future__ import annotations

import os
import sys

import pytest

from tests.support.matrix import TOL, Combo, judge, measure, reference, render, summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from _pages import between  # noqa: E402
from matrix_table import BEGIN, END, PAGE  # noqa: E402


@pytest.mark.distributed
@pytest.mark.slow
def test_every_combination_works_or_is_refused_by_name():
    combos, verdicts = measure()
    print(summary(verdicts))
    other = [f"{c}: {why}" for c, (v, why) in zip(combos, verdicts, strict=True) if v == "other"]
    assert not other, "\n".join(other)
    works = sum(v == "works" for v, _ in verdicts)
    assert works >= 0.8 * len(combos), summary(verdicts)  # issue 35's bar: four in five work
    assert between(PAGE, BEGIN, END) == render(combos, verdicts), (
        "docs/reference/matrix.md differs from this run: python scripts/matrix_table.py --write"
    )


COMBO = Combo(pp=1, dp=2, ep=1, tp=2, sp=1, megatron_sp=False, schedule="", stage=2,
              precision="fp32", offload="none")  # fmt: skip


def _ranks(combo: Combo, scale: float = 1.0, drop: str = "") -> list:
    """Two ranks' results as the runner sends them, made from the reference itself: each
    parameter off by ``scale`` times the tolerance (1: at it), ``drop`` held by no rank."""
    ref = reference(False, 1, 1, combo.gas, combo.precision)
    tol = TOL[combo.precision]
    steps = []
    for state, norm in ref:
        stats = {n: (scale * tol, 0.0, 1.0) for n in state if n != drop}
        steps.append((stats, norm))
    return [("ok", steps), ("ok", steps)]


def test_the_verdict_takes_parity_at_the_tolerance_and_nothing_worse():
    ref = reference(False, 1, 1, COMBO.gas, COMBO.precision)
    assert judge(COMBO, _ranks(COMBO, 1.0), ref) == ("works", "")
    verdict, why = judge(COMBO, _ranks(COMBO, 1.5), ref)
    assert verdict == "other" and "differs by" in why
    verdict, why = judge(COMBO, _ranks(COMBO, 0.0, drop="wpe.weight"), ref)
    assert verdict == "other" and "wpe.weight" in why
    doubled = [("ok", [(s, 2 * n) for s, n in _ranks(COMBO)[0][1]])] * 2
    assert judge(COMBO, doubled, ref)[0] == "other"  # a x2 gradient norm


def test_a_refusal_must_name_two_settings_alike_on_every_rank():
    ref = reference(False, 1, 1, COMBO.gas, COMBO.precision)
    named = "zero_optimization.stage: 2 with tp 2 is refused here"
    assert judge(COMBO, [("refused", named)] * 2, ref) == ("refused", named)
    assert judge(COMBO, [("refused", "tp 2 is refused here")] * 2, ref)[0] == "other"
    assert judge(COMBO, [("refused", named), ("refused", named + "!")], ref)[0] == "other"
    assert judge(COMBO, [("refused", named), ("ok", [])], ref)[0] == "other"
    assert judge(COMBO, [("error", "ValueError: x")] * 2, ref)[0] == "other"


def test_bf16_is_judged_on_the_update_of_all_parameters():
    combo = Combo(**{**COMBO.__dict__, "precision": "bf16"})
    ref = reference(False, 1, 1, combo.gas, "bf16")
    tol = TOL["bf16"]

    def ranks(err):
        steps = [({n: (1.0, err**2 / len(s), 1.0 / len(s)) for n in s}, norm) for s, norm in ref]
        return [("ok", steps)] * 2

    assert judge(combo, ranks(0.9 * tol), ref)[0] == "works"
    assert judge(combo, ranks(1.1 * tol), ref)[0] == "other"
