"""Elastic restart with exact resume (the config's ``checkpoint`` block): real torchrun jobs
(tests/jobs/resume_job.py) in which one rank SIGKILLs itself on the first attempt, in the forward,
in the optimizer step or while writing a checkpoint, or SIGSTOPs itself (the watchdog ends the
others); torchrun restarts the job, ``initialize``
loads ``latest``, and the run ends with the weights of an uninterrupted run, bit for bit, having
trained on the same samples at every step. A relaunch on fewer ranks resumes on the new layout
with the same global batch. Every job is bounded in time and leaves no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed import TCPStore

from tests.support.models import max_rel_diff
from tests.support.ranks import job, job_env, session

pytestmark = pytest.mark.distributed  # every test here starts ranks

JOB = job("resume_job.py")
STEPS = 8  # 40 samples, a global batch of 8: 5 steps an epoch, so step 6 starts epoch 1
BOUND_S = 240.0


def torchrun(out, nproc: int, restarts: int, *args: str) -> tuple[int, str, float]:
    """``torchrun --standalone`` of the job in its own session; (exit code, output, seconds).
    Whatever the outcome, nothing of the session may outlive it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", f"--max-restarts={restarts}", JOB, str(out), *args]
    # torch 2.13's c10d rendezvous keeps one store for every restart, without the per-attempt
    # prefix its workers assume (pytorch/pytorch#135712): zerostack.init_distributed adds one,
    # so these restarts run with torchrun's defaults.
    [(code, output)], seconds = sessions(out, [cmd])
    return code, output, seconds


def sessions(out, cmds: list[list[str]]) -> tuple[list[tuple[int, str]], float]:
    """Run each command in a session of its own, all at once; ([(exit code, output)], seconds).
    Each must end within the bound, and nothing of any session may outlive it."""
    os.makedirs(out, exist_ok=True)
    env = job_env()
    t0 = time.monotonic()
    procs = [session(cmd, env) for cmd in cmds]
    results = []
    for proc in procs:
        try:
            output = proc.communicate(timeout=max(1.0, BOUND_S - (time.monotonic() - t0)))[0]
        except subprocess.TimeoutExpired:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            output = proc.communicate()[0]
            pytest.fail(f"the job outlived {BOUND_S:g} s:\n{output[-3000:]}")
        results.append((proc.returncode, output))
    seconds = time.monotonic() - t0
    time.sleep(0.2)
    for proc, (_, output) in zip(procs, results, strict=True):
        try:  # a process left in the job's session (a worker torchrun did not reap)
            os.killpg(proc.pid, 0)
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"processes of the job were left behind:\n{output[-3000:]}")
        except ProcessLookupError:
            pass
    return results, seconds


def rows(out, rank: int) -> list[dict]:
    with open(os.path.join(out, f"rank{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


def by_step(rows_: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in rows_}


_REFERENCE: dict = {}


def reference(tmp_path_factory, stage: int) -> str:
    """An uninterrupted run (same checkpoints, no kill), once per stage."""
    if stage not in _REFERENCE:
        out = tmp_path_factory.mktemp(f"reference{stage}")
        code, output, _ = torchrun(out, 2, 0, "--stage", str(stage), "--steps", str(STEPS))
        assert code == 0, output[-3000:]
        _REFERENCE[stage] = str(out)
    return _REFERENCE[stage]


@pytest.mark.parametrize(
    "stage, kill, extra, resumed_from",
    [
        # mid-epoch: step 5's forward, after the save of step 4
        pytest.param(2, "forward:4", (), (4,), marks=pytest.mark.slow),
        (2, "step:5", ("--async-save",), (2, 4)),  # step 6's update; background saves
        # while writing step 4's checkpoint: step 2's is latest
        pytest.param(3, "save:4", (), (2,), marks=pytest.mark.slow),
        # the same in the writer thread, training on
        pytest.param(2, "save:4", ("--async-save",), (2,), marks=pytest.mark.slow),
        # SIGSTOP in step 5's forward: the watchdog ends rank 0 within its 3 s; torchrun's agent
        # kills the stopped rank (SIGTERM waits while it is stopped: SIGKILL after 30 s)
        pytest.param(2, "freeze:4", ("--watchdog-timeout", "3"), (4,), marks=pytest.mark.slow),
    ],
    ids=[
        "stage2-forward",
        "stage2-step-async",
        "stage3-save",
        "stage2-save-async",
        "stage2-freeze",
    ],
)
def test_a_killed_rank_restarts_and_resumes_exactly(
    tmp_path, tmp_path_factory, stage, kill, extra, resumed_from
):
    ref = reference(tmp_path_factory, stage)
    code, output, seconds = torchrun(
        tmp_path, 2, 1, "--stage", str(stage), "--steps", str(STEPS), "--kill", kill, *extra
    )
    assert code == 0, output[-4000:]
    assert "KILLED" in output and output.count("resumed from") == 1, output[-4000:]
    if kill.startswith("freeze"):  # the watchdog, not a gloo error, ended the live rank
        assert "rank 1 stopped answering" in output, output[-4000:]
    resumed_at = json.loads((tmp_path / "times1.json").read_text())["resumed_at"]
    assert resumed_at in resumed_from, output[-4000:]
    want, got = (
        load_file(os.path.join(ref, "final.safetensors")),
        load_file(tmp_path / "final.safetensors"),
    )
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs from the uninterrupted run"
    for rank in (0, 1):
        expected = by_step(rows(ref, rank))
        mine = rows(tmp_path, rank)
        second = [r for r in mine if r["attempt"] == 1]
        assert [r["step"] for r in second] == list(range(resumed_at + 1, STEPS + 1))
        for r in mine:  # the same samples, in the same order, the same loss, at every step
            assert r["ids"] == expected[r["step"]]["ids"], (rank, r)
            assert r["loss"] == expected[r["step"]]["loss"], (rank, r)
    kept = sorted(os.listdir(tmp_path / "ckpt"))
    assert kept == ["global_step6", "global_step8", "latest"], kept  # keep_last 2


@pytest.mark.slow
def test_a_relaunch_on_fewer_ranks_resumes_on_the_new_layout(tmp_path, tmp_path_factory):
    """dp 2 -> dp 1: train_batch_size 8 with micro-batch 2 is kept (accumulation 2 -> 4); the
    sampler's position (samples consumed, over all ranks) makes the one rank start at the first
    sample neither had trained on, so every step sees the same 8 samples as the dp 2 run. The
    sum over them is taken in another order: equal to fp32 round-off, not bit for bit."""
    ref = reference(tmp_path_factory, 2)
    code, output, _ = torchrun(tmp_path, 2, 0, "--steps", str(STEPS), "--kill", "forward:4")
    assert code != 0 and "KILLED" in output, output[-3000:]
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step4"
    code, output, _ = torchrun(tmp_path, 1, 0, "--steps", str(STEPS))
    assert code == 0, output[-3000:]
    assert "saved on dp=2 with a global batch of 8; now dp=1, global batch 8" in output
    resumed = [r for r in rows(tmp_path, 0) if r["attempt"] == 0][4:]  # the relaunch's rows
    worst = same_global_batches(ref, resumed, tmp_path / "final.safetensors")
    print(f"dp 2 -> 1: largest relative difference {worst:.2e}")  # README quotes it


def same_global_batches(ref, resumed: list[dict], final) -> float:
    """The resumed dp 1 rows train steps 5.. on the reference dp 2 run's global batches, sample
    for sample, to its mean loss, and end at its weights to fp32 round-off (the gradient is
    summed in another order); the largest relative difference of a weight."""
    expected = [by_step(rows(ref, r)) for r in (0, 1)]
    assert [r["step"] for r in resumed] == list(range(5, STEPS + 1))
    for r in resumed:
        both = expected[0][r["step"]]["ids"] + expected[1][r["step"]]["ids"]
        assert sorted(r["ids"]) == sorted(both), r  # the same global batch, sample for sample
        mean = (expected[0][r["step"]]["loss"] + expected[1][r["step"]]["loss"]) / 2
        assert abs(r["loss"] - mean) <= 1e-5 * abs(mean), (r, mean)
    want = load_file(os.path.join(ref, "final.safetensors"))
    worst, name = max_rel_diff(load_file(final), want)
    assert worst < 1e-5, f"{name}: {worst:.2e} from the uninterrupted dp 2 run"
    return worst


@pytest.mark.slow
def test_an_elastic_job_that_loses_a_node_resumes_on_the_one_left(tmp_path, tmp_path_factory):
    """torchrun's elastic ``--nnodes 1:2``: two node agents (one rank each) join a rendezvous
    whose store this test holds, as a job's would live apart from its nodes. Node 1's rank
    SIGKILLs its agent and itself in step 5's forward; node 0's rank fails on the reset
    connection, its agent restarts it, the rendezvous closes with the one node left after
    ``last_call_timeout``, and the rank resumes step 4's checkpoint at dp 1 with the global
    batch kept (accumulation 2 -> 4)."""
    ref = reference(tmp_path_factory, 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True)  # noqa: F841
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1"]
    agent += ["--max-restarts=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}"]
    agent += ["--rdzv_id=elastic", "--rdzv_conf=is_host=false,last_call_timeout=2"]
    agent += [JOB, str(tmp_path), "--steps", str(STEPS), "--kill", "node:4"]
    results, seconds = sessions(tmp_path, [agent, agent])
    # the rendezvous orders the nodes as they join: either agent may be rank 1's, the victim's
    (code0, out0), (code1, out1) = sorted(results, key=lambda r: r[0] != 0)
    last = out1.strip().splitlines()[-1]  # the victim's agent died with it, saying nothing
    assert code1 == -signal.SIGKILL and last.startswith("KILLED ") and last.endswith(" node"), out1
    assert code0 == 0, out0[-4000:]
    assert "saved on dp=2 with a global batch of 8; now dp=1, global batch 8" in out0, out0[-3000:]
    resumed = [r for r in rows(tmp_path, 0) if r["attempt"] == 1]
    worst = same_global_batches(ref, resumed, tmp_path / "final.safetensors")
    print(f"elastic 2 -> 1 nodes in {seconds:.1f} s: largest relative difference {worst:.2e}")


@pytest.mark.slow
def test_zerostack_train_auto_resume_keep_last_and_async_save(tmp_path):
    """``zerostack train --auto-resume``: the config's checkpoint block; a second run of the same
    command with more steps continues after the first one's last step, and keep_last 1 leaves
    the newest tag only (written in the background)."""
    ckpt = tmp_path / "ckpt"
    base = [sys.executable, "-m", "zerostack.cli", "train", "--nproc", "2", "--n-layer", "1"]
    base += ["--d-model", "32", "--n-head", "2", "--block-size", "32", "--micro-batch", "4"]
    base += ["--no-progress", "--save-dir", str(ckpt), "--save-every", "2", "--auto-resume"]
    base += ["--keep-last", "1", "--async-save"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for steps, out in (("4", "a"), ("7", "b")):
        proc = subprocess.run(
            [*base, "--steps", steps, "--out", str(tmp_path / out)],
            env=env, capture_output=True, text=True, timeout=BOUND_S,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    logged = (tmp_path / "b" / "train_log.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in logged[1:]] == ["5", "6", "7"]
    assert sorted(os.listdir(ckpt)) == ["global_step7", "latest"]
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["checkpoint"] == str(ckpt / "global_step7")
