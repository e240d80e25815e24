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


def test_save_resume_and_consolidate(tmp_path):
    """--save-every writes checkpoints, --resume continues (on another ZeRO stage) from the
    latest, and `zerostack consolidate` turns it into one safetensors file."""
    base = [sys.executable, "-m", "zerostack.cli", "train", "--nproc", "2", "--n-layer", "1"]
    base += ["--d-model", "32", "--n-head", "2", "--block-size", "32", "--micro-batch", "4"]
    base += ["--no-progress", "--save-dir", str(tmp_path / "ckpt")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = base + ["--steps", "6", "--save-every", "3", "--zero-stage", "2"]
    proc = subprocess.run(
        first + ["--out", str(tmp_path / "a")], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["global_step3", "global_step6", "latest"]
    second = base + ["--steps", "9", "--resume", "--zero-stage", "1", "--out", str(tmp_path / "b")]
    proc = subprocess.run(second, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = list(csv.DictReader((tmp_path / "b" / "train_log.csv").open()))
    assert [int(r["step"]) for r in rows] == [7, 8, 9]
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["checkpoint"] == str(tmp_path / "ckpt" / "global_step9")
    out = tmp_path / "model.safetensors"
    cmd = [sys.executable, "-m", "zerostack.cli", "consolidate", str(tmp_path / "ckpt"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == f"wrote {out}\n", proc.stderr
    bad = subprocess.run(
        cmd[:-2] + [str(tmp_path / "nope"), str(out)], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2
    assert (
        bad.stderr == f"CheckpointError: {tmp_path / 'nope' / 'latest'}: no such file (no "
        "complete checkpoint; pass tag=)\n"
    )
