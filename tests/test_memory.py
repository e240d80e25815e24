"""Bytes per rank from engine.memory_breakdown() against the ZeRO paper's formulas.

psi parameters, N data-parallel ranks, Adam (two fp32 moments, 8 psi). Mixed precision keeps an
fp32 master (4 psi) beside the 16-bit parameters and gradients; fp32 training updates the
parameters in place (no master). Stage 2 keeps its gradient pieces in fp32, so its gradient term
is 4 psi / N in both precisions (DESIGN.md's table writes 2 psi / N for mixed precision; the
issue asks for fp32 pieces, which also keeps accumulation over micro-steps exact).
"""

from __future__ import annotations

import pytest
from common import batch, tiny_gpt
from distributed import run_distributed

import zerostack


def expected(stage: int, precision: str, psi: float, n: int) -> dict[str, float]:
    """Bytes per rank: (parameters, gradients, fp32 master, Adam moments) for each stage."""
    p = 4 if precision == "fp32" else 2  # parameter and (stages 0-1) gradient bytes
    m = 0 if precision == "fp32" else 4  # a separate fp32 master only in mixed precision
    table = {
        0: (p, p, m, 8),
        1: (p, p, m / n, 8 / n),
        2: (p, 4 / n, m / n, 8 / n),
        3: (p / n, 4 / n, m / n, 8 / n),
    }[stage]
    keys = ("params", "grads", "master", "optimizer")
    return {k: v * psi for k, v in zip(keys, table, strict=True)}


def _breakdown(rank, world, stage, precision):
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    model = tiny_gpt()
    psi = sum(p.numel() for p in model.parameters())
    engine, *_ = zerostack.initialize(model=model, config=cfg)
    engine.backward(engine(*batch(0, 1)))
    engine.step()  # optimizer state exists after the first step
    return psi, engine.memory_breakdown()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [2, 4])
def test_bytes_per_rank_match_the_zero_formulas(stage, precision, world):
    for psi, got in run_distributed(_breakdown, world, args=(stage, precision)):
        want = expected(stage, precision, psi, world)
        assert set(got) == set(want)
        for key, value in want.items():
            # Padding aside: at most world - 1 elements per bucket (one bucket here) at stages
            # 0-2, per parameter at stage 3.
            slack = 4 * world * (30 if stage == 3 else 1)
            assert value <= got[key] <= value * 1.02 + slack, f"{key}: {got[key]} vs {value:.0f}"
