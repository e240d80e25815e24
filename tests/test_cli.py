"""`zerostack train`: the demo runs end to end (2 ranks under torchrun) and its loss falls."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from zerostack.cli import _build_config, _parser, main
from zerostack.config import load_config
from zerostack.profiling.flops import transformer_flops

from tests.support.ranks import run_distributed

CLI = [sys.executable, "-m", "zerostack.cli"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``cmd`` in a process group of its own, so that a timeout (or any failure here) kills it
    with everything it started, torchrun's ranks included, instead of leaving them running."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)}: still running after {timeout}s; killed\n{out}{err}")
    finally:
        if proc.poll() is None:  # interrupted: take the group down with us
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


GRIDS = [
    (["--tp", "2", "--sequence-parallel"], "2 ranks (tp 2 x dp 1, seq"),
    (["--sp", "2", "--zero-stage", "3"], "2 ranks (tp 1 x dp 1 x sp 2), ZeRO stage 3"),
    (["--moe-every", "1", "--ep", "2", "--zero-stage", "2"], "2 ranks (tp 1 x dp 2, ep 2)"),
    # one micro-batch a step: this hung before the first step (issue 11)
    (["--pp", "2", "--schedule", "interleaved"], "2 ranks (pp 2 (inter"),
    (
        ["--zero-stage", "3", "--offload", "cpu", "--activation-checkpointing"],
        "2 ranks, ZeRO stage 3 + cpu offload + activation checkpointing",
    ),
]


def _train_argv(out, grid: list[str]) -> list[str]:
    argv = ["train", "--nproc", "2", "--steps", "20"]
    argv += ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--block-size", "32"]
    return argv + ["--micro-batch", "4", "--out", str(out), "--no-progress", *grid]


def _check_run(out, stdout: str, grid: list[str], banner: str) -> None:
    """What a `zerostack train` run leaves: its banner, summary, CSV, plot and MFU."""
    assert f"zerostack train: {banner}" in stdout, stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 20
    assert summary["final_loss"] < summary["first_loss"] - 0.5, summary
    assert set(summary["bytes_per_rank"]) == {"params", "grads", "master", "scratch", "optimizer"}
    rows = list(csv.DictReader((out / "train_log.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(1, 21))
    assert (out / "loss.png").stat().st_size > 1000
    # MFU: the model's flops per step (Narayanan's count, the recomputed forward included with
    # activation checkpointing) at the measured token rate, over each rank's measured peak
    recompute = "--activation-checkpointing" in grid
    sequences = 4 * summary["dp"]  # the global batch: micro-batch 4 on each dp rank
    flops = transformer_flops(1, 32, 2, 256, 32, sequences, recompute=recompute)
    assert summary["model_flops_per_step"] == flops and summary["peak_source"] == "measured"
    steps_per_s = summary["tokens_per_s"] / (sequences * 32)
    mfu = flops * steps_per_s / (summary["peak_flops_per_rank"] * 2)
    assert summary["mfu"] == pytest.approx(mfu, rel=1e-9) and 0 < mfu < 1
    assert f"MFU {mfu:.1%} of" in stdout


@pytest.mark.distributed
@pytest.mark.slow
def test_train_runs_under_torchrun_and_loss_falls(tmp_path):
    """The whole command: it checks the grid, starts torchrun with 2 ranks, each trains."""
    out = tmp_path / "run"
    proc = _run([*CLI, *_train_argv(out, [])])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_run(out, proc.stdout, [], "2 ranks, ZeRO")


def _train_each_grid(rank, world, root: str) -> list[str]:
    """Every grid's run, one after another on these two ranks: what `zerostack train` runs on
    each rank once torchrun has started it (the test above starts one); rank 0's output."""
    from zerostack.demo.train import train

    printed = []
    for i, (grid, _) in enumerate(GRIDS):
        args = _parser().parse_args(_train_argv(os.path.join(root, str(i)), grid))
        with contextlib.redirect_stdout(io.StringIO()) as stdout:
            train(args, _build_config(args))
        printed.append(stdout.getvalue())
    return printed


@pytest.mark.distributed
@pytest.mark.slow
def test_every_grid_trains_and_its_loss_falls(tmp_path):
    printed = run_distributed(_train_each_grid, 2, args=(str(tmp_path),), timeout=400)[0]
    for i, ((grid, banner), stdout) in enumerate(zip(GRIDS, printed, strict=True)):
        _check_run(tmp_path / str(i), stdout, grid, banner)


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--nproc", "--steps", "--config", "--zero-stage", "--bf16", "--fp16", "--out"):
        assert opt in out
    assert "default" in out


@pytest.mark.distributed
def test_bad_config_is_one_clear_line(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"train_batch_size": 8, "gradient_clippng": 1.0}))
    proc = _run([*CLI, "train", "--nproc", "1", "--config", str(bad)], timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == (
        "ConfigError: gradient_clippng: unknown key (did you mean 'gradient_clipping'?)\n"
    )


def test_grid_that_does_not_fit_is_one_clear_line(capsys):
    """Refused before torchrun starts (test_bad_config_is_one_clear_line runs the command)."""
    for argv, line in [
        (["--tp", "4"], "ValueError: --tp 4 does not divide --nproc 2\n"),
        (
            ["--sp", "2", "--n-head", "3"],
            "ValueError: --n-head 3 does not split into --tp x --sp heads\n",
        ),
        (["--ep", "2"], "ValueError: --ep needs --moe-every > 0 (experts to split)\n"),
    ]:
        assert main(["train", "--nproc", "2", *argv]) == 2
        assert capsys.readouterr().err == line


@pytest.mark.distributed
@pytest.mark.slow
def test_example_script_runs_under_torchrun():
    """examples/train_gpt.py: a DeepSpeed script with the import changed, ZeRO-3 from a JSON."""
    root = os.path.dirname(os.path.dirname(__file__))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [os.path.join(root, "examples", "train_gpt.py"), "--steps", "3", "--deepspeed_config"]
    cmd += [os.path.join(root, "examples", "ds_config_zero3.json")]
    proc = _run(cmd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 3: loss" in proc.stdout
    assert proc.stdout.count("'params'") == 2  # both ranks report their (sharded) bytes


@pytest.mark.distributed
@pytest.mark.slow
def test_save_resume_and_consolidate(tmp_path):
    """--save-every writes checkpoints, --resume continues (on another ZeRO stage) from the
    latest, and `zerostack consolidate` turns it into one safetensors file."""
    base = [*CLI, "train", "--nproc", "2", "--n-layer", "1"]
    base += ["--d-model", "32", "--n-head", "2", "--block-size", "32", "--micro-batch", "4"]
    base += ["--no-progress", "--save-dir", str(tmp_path / "ckpt")]
    first = base + ["--steps", "6", "--save-every", "3", "--zero-stage", "2"]
    proc = _run(first + ["--out", str(tmp_path / "a")])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["global_step3", "global_step6", "latest"]
    second = base + ["--steps", "9", "--resume", "--zero-stage", "1", "--out", str(tmp_path / "b")]
    proc = _run(second)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = list(csv.DictReader((tmp_path / "b" / "train_log.csv").open()))
    assert [int(r["step"]) for r in rows] == [7, 8, 9]
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["checkpoint"] == str(tmp_path / "ckpt" / "global_step9")
    out = tmp_path / "model.safetensors"
    cmd = [*CLI, "consolidate", str(tmp_path / "ckpt"), str(out)]
    proc = _run(cmd, timeout=120)
    assert proc.returncode == 0 and proc.stdout == f"wrote {out}\n", proc.stderr
    bad = _run(cmd[:-2] + [str(tmp_path / "nope"), str(out)], timeout=120)
    assert bad.returncode == 2
    assert (
        bad.stderr == f"CheckpointError: {tmp_path / 'nope' / 'latest'}: no such file (no "
        "complete checkpoint; pass tag=)\n"
    )


@pytest.mark.parametrize(
    "argv,batch",
    [
        ([], (16, 8, 1)),  # (train_batch_size, micro, gas) on 2 data-parallel ranks
        (["--grad-accum", "4"], (64, 8, 4)),  # the default micro-batch still applies
        (["--micro-batch", "2"], (4, 2, 1)),
        (["--micro-batch", "2", "--grad-accum", "3"], (12, 2, 3)),
    ],
)
def test_batch_options_fill_in_the_default_micro_batch(argv, batch):
    cfg = _build_config(_parser().parse_args(["train", *argv]))
    assert load_config(cfg).resolve_batch(2) == batch


def test_batch_options_override_a_config_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 32}))
    args = ["train", "--config", str(path)]
    assert load_config(_build_config(_parser().parse_args(args))).resolve_batch(2) == (32, 16, 1)
    cfg = _build_config(_parser().parse_args([*args, "--grad-accum", "4"]))
    assert load_config(cfg).resolve_batch(2) == (64, 8, 4)


def test_bf16_on_the_command_line_keeps_the_files_other_bf16_keys(tmp_path):
    path = tmp_path / "ds.json"
    block = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    path.write_text(json.dumps({"bf16": block}))
    cfg = _build_config(_parser().parse_args(["train", "--config", str(path), "--bf16"]))
    assert cfg["bf16"] == {**block, "enabled": True}


@pytest.mark.slow
def test_a_timed_out_command_is_killed_with_everything_it_started():
    child = "import time; time.sleep(120)"  # stands in for torchrun's ranks
    parent = (
        "import subprocess, sys, time; "
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}]); "
        "print(p.pid, flush=True); time.sleep(120)"
    )
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="still running after 2s; killed") as info:
        _run([sys.executable, "-c", parent], timeout=2)
    assert time.monotonic() - t0 < 30
    pid = int(str(info.value).splitlines()[1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                gone = f.read().split(")")[-1].split()[0] == "Z"  # killed, not yet reaped
        except FileNotFoundError:
            gone = True
        if gone:
            break
        time.sleep(0.1)
    assert gone, f"the grandchild {pid} outlived the timeout"
