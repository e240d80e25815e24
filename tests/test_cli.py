"""`zerostack train`: the demo runs end to end (2 ranks under torchrun) and its loss falls."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "grid,banner",
    [
        ([], "2 ranks, ZeRO"),
        (["--tp", "2", "--sequence-parallel"], "2 ranks (tp 2 x dp 1, seq"),
        (["--pp", "2", "--schedule", "interleaved", "--grad-accum", "2"], "2 ranks (pp 2 (inter"),
        (
            ["--zero-stage", "3", "--offload", "cpu", "--activation-checkpointing"],
            "2 ranks, ZeRO stage 3 + cpu offload + activation checkpointing",
        ),
    ],
)
def test_train_runs_and_loss_falls(tmp_path, grid, banner):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "zerostack.cli", "train", "--nproc", "2", "--steps", "20"]
    cmd += ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--block-size", "32"]
    cmd += ["--micro-batch", "4", "--out", str(out), "--no-progress", *grid]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"zerostack train: {banner}" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 20
    assert summary["final_loss"] < summary["first_loss"] - 0.5, summary
    assert set(summary["bytes_per_rank"]) == {"params", "grads", "master", "optimizer"}
    rows = list(csv.DictReader((out / "train_log.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(1, 21))
    assert (out / "loss.png").stat().st_size > 1000


def test_help_explains_every_option():
    proc = subprocess.run(
        [sys.executable, "-m", "zerostack.cli", "train", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0
    for opt in ("--nproc", "--steps", "--config", "--zero-stage", "--bf16", "--fp16", "--out"):
        assert opt in proc.stdout
    assert "default" in proc.stdout


def test_bad_config_is_one_clear_line(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"train_batch_size": 8, "gradient_clippng": 1.0}))
    cmd = [sys.executable, "-m", "zerostack.cli", "train", "--nproc", "1", "--config", str(bad)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == (
        "ConfigError: gradient_clippng: unknown key (did you mean 'gradient_clipping'?)\n"
    )


def test_grid_that_does_not_fit_is_one_clear_line():
    cmd = [sys.executable, "-m", "zerostack.cli", "train", "--nproc", "2", "--tp", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == "ValueError: --tp 4 does not divide --nproc 2\n"


def test_example_script_runs_under_torchrun():
    """examples/train_gpt.py: a DeepSpeed script with the import changed, ZeRO-3 from a JSON."""
    root = os.path.dirname(os.path.dirname(__file__))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [os.path.join(root, "examples", "train_gpt.py"), "--steps", "3", "--deepspeed_config"]
    cmd += [os.path.join(root, "examples", "ds_config_zero3.json")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 3: loss" in proc.stdout
    assert proc.stdout.count("'params'") == 2  # both ranks report their (sharded) bytes
