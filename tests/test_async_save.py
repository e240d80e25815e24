"""Background checkpoint writes (zerostack.checkpoint.async_save) on real gloo ranks: the save is
a snapshot (training that goes on at once does not change what is written), it loads back into
an exact resume, ``latest`` moves only once every rank's file is written and verified, a failed
write on one rank is every rank's error, a second save waits for the first, and a pending write
is finished when the interpreter exits. ``keep_last`` pruning, without processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import zerostack
from zerostack.checkpoint import CheckpointError, async_save
from zerostack.checkpoint.tags import prune

from tests.support.models import batch, tiny_gpt
from tests.support.ranks import run_distributed

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(stage: int, **checkpoint) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
        "checkpoint": checkpoint,
    }


def _train(engine, rank: int, steps, world: int = 2) -> None:
    for step in steps:
        x, y = batch(step, 2 * world)
        engine.backward(engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
        engine.step()


def _state(engine) -> dict[str, torch.Tensor]:
    out = {f"param/{k}": v for k, v in engine.full_state_dict().items()}
    for i, m in enumerate(engine.zero.masters()):
        for k, v in engine.zero.read_master(m, engine.optimizer).items():
            out[f"master{i}/{k}"] = v.clone()
    return out


def _gated_writes():
    """Hold every background write until the returned event is set (the test decides when)."""
    gate, write = threading.Event(), async_save._write_file

    def held(*args):
        assert gate.wait(60), "the gate was never opened"
        return write(*args)

    async_save._write_file = held
    return gate


def _snapshot_and_resume(rank, world, root, stage):
    torch.manual_seed(0)
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(stage))
    _train(engine, rank, range(2))
    want = _state(engine)
    gate = _gated_writes()
    path = engine.save_checkpoint(root, tag="snap", async_save=True)
    returned_pending = engine.checkpoints._saver.pending
    _train(engine, rank, range(2, 4))  # masters and moments change while the write is held
    changed = not torch.equal(_state(engine)["param/wte.weight"], want["param/wte.weight"])
    latest_before = os.path.exists(os.path.join(root, "latest"))
    gate.set()
    engine.wait_for_checkpoint()
    after = _state(engine)
    engine.destroy()
    fresh, *_ = zerostack.initialize(model=tiny_gpt(seed=1), config=_config(stage))
    fresh.load_checkpoint(root)
    got = _state(fresh)
    _train(fresh, rank, range(2, 4))  # the same two steps from the loaded state
    resumed = _state(fresh)
    fresh.destroy()
    return dict(
        path=path,
        pending=returned_pending,
        changed=changed,
        latest_before=latest_before,
        latest=open(os.path.join(root, "latest")).read(),
        equal=[k for k in want if not torch.equal(got[k], want[k])],
        resumed=[k for k in after if not torch.equal(resumed[k], after[k])],
    )


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_async_save_is_a_snapshot_and_resumes_exactly(tmp_path, stage):
    for out in run_distributed(_snapshot_and_resume, 2, args=(str(tmp_path), stage)):
        assert out["pending"] and out["changed"], out  # returned at once; training went on
        assert not out["latest_before"], "latest moved before the files were written"
        assert out["latest"] == "snap" and out["path"] == str(tmp_path / "snap")
        assert out["equal"] == [], f"not the values at the save: {out['equal']}"
        assert out["resumed"] == [], f"resumed training differs: {out['resumed']}"
    manifest = json.loads((tmp_path / "snap" / "manifest.json").read_text())
    assert [f["file"] for f in manifest["files"]] == [
        "rank00000.safetensors",
        "rank00001.safetensors",
    ]
    assert manifest["counters"]["global_steps"] == 2  # the counters at the save, too
    assert not list(tmp_path.glob(".*")), "an incomplete folder was left"


def _failing_rank(rank, world, root):
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(2))
    _train(engine, rank, range(1))
    engine.save_checkpoint(root, tag="good")  # synchronous: latest = good
    if rank == 1:

        def broken(*args):
            raise OSError(28, "No space left on device (injected)")

        async_save._write_file = broken
    out = {}
    for how in ("wait", "step"):
        engine.save_checkpoint(root, tag=f"bad_{how}", async_save=True)
        try:
            if how == "wait":
                engine.wait_for_checkpoint()
            else:  # the verdict is in: the next optimizer step raises it
                while engine.checkpoints._saver.pending:
                    time.sleep(0.01)
                _train(engine, rank, range(1, 2))
            out[how] = None
        except CheckpointError as exc:
            out[how] = str(exc)
        out[f"latest_{how}"] = open(os.path.join(root, "latest")).read()
    engine.wait_for_checkpoint()  # raised once: nothing left to raise
    engine.destroy()
    return out


@pytest.mark.distributed
def test_a_failed_write_on_one_rank_leaves_latest_and_fails_every_rank(tmp_path):
    for out in run_distributed(_failing_rank, 2, args=(str(tmp_path),)):
        for how in ("wait", "step"):
            assert out[how] == (
                f"{tmp_path / f'bad_{how}'}: not saved (rank 1: OSError: [Errno 28] No space left "
                "on device (injected)); latest is unchanged"
            ), out
            assert out[f"latest_{how}"] == "good"
    assert not (tmp_path / "bad_wait").exists() and not (tmp_path / "bad_step").exists()
    assert (tmp_path / "good" / "manifest.json").exists()
    assert not list(tmp_path.glob(".*")), "the failed save's folder was left"


def _second_waits(rank, world, root):
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(1, async_save=True))
    _train(engine, rank, range(1))
    write = async_save._write_file

    def slow(*args):
        time.sleep(1.0)
        return write(*args)

    async_save._write_file = slow
    engine.save_checkpoint(root, tag="first")  # the config's async_save
    first_pending = engine.checkpoints._saver.pending
    engine.save_checkpoint(root, tag="second")
    first_done = os.path.exists(os.path.join(root, "first", "manifest.json"))
    engine.wait_for_checkpoint()
    engine.destroy()
    return first_pending, first_done, open(os.path.join(root, "latest")).read()


@pytest.mark.distributed
@pytest.mark.slow
def test_a_second_save_waits_for_the_first(tmp_path):
    for first_pending, first_done, latest in run_distributed(
        _second_waits, 2, args=(str(tmp_path),)
    ):
        assert first_pending and first_done and latest == "second"


def _interval_and_keep_last(rank, world, root):
    cfg = _config(2, save_dir=root, save_interval=1, keep_last=2, async_save=True)
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
    _train(engine, rank, range(5))
    engine.wait_for_checkpoint()
    engine.destroy()


@pytest.mark.distributed
def test_save_interval_and_keep_last_in_the_background(tmp_path):
    run_distributed(_interval_and_keep_last, 2, args=(str(tmp_path),))
    assert sorted(os.listdir(tmp_path)) == ["global_step4", "global_step5", "latest"]
    assert (tmp_path / "latest").read_text() == "global_step5"


EXIT_SCRIPT = """
import sys, torch
sys.path.insert(0, {checkout!r})
from tests.support.models import batch, tiny_gpt
import zerostack
engine, *_ = zerostack.initialize(model=tiny_gpt(), config={config!r})
x, y = batch(0, 2)
engine.backward(engine(x, y)); engine.step()
engine.save_checkpoint({root!r}, tag="at_exit", async_save=True)
print("pending", engine.checkpoints._saver.pending, flush=True)
"""


@pytest.mark.slow
def test_a_pending_write_is_finished_at_interpreter_exit(tmp_path):
    """No wait, no destroy: the script ends right after the call, and the checkpoint is whole."""
    script = EXIT_SCRIPT.format(checkout=CHECKOUT, config=_config(2), root=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "pending True" in done.stdout
    assert (tmp_path / "latest").read_text() == "at_exit"
    assert (tmp_path / "at_exit" / "manifest.json").exists()


# ------------------------------------------------------------------ keep_last, in process
def _fake_tag(root, tag: str) -> None:
    os.makedirs(os.path.join(root, tag))
    open(os.path.join(root, tag, "manifest.json"), "w").write("{}")


def test_keep_last_never_removes_latest_nor_other_tags(tmp_path):
    for tag in ["global_step2", "global_step10", "global_step4", "global_step6", "best"]:
        _fake_tag(tmp_path, tag)
    os.makedirs(tmp_path / "global_step8")  # no manifest: not a checkpoint, not counted
    (tmp_path / "latest").write_text("global_step4")  # e.g. step 6 and 10 saved without latest
    removed = prune(str(tmp_path), 1)
    assert removed == ["global_step2", "global_step6"]
    assert sorted(os.listdir(tmp_path)) == [
        "best",
        "global_step10",
        "global_step4",
        "global_step8",
        "latest",
    ]


def test_waiting_for_the_other_ranks_asks_the_store_ever_less_often():
    """The agreement's wait polls the store with pauses that double (20 ms up to 1 s): waiting
    2 s for a slow writer takes a dozen looks, not a hundred (at a thousand ranks, every look
    of every rank is two requests to one TCPStore)."""
    class Counting:
        def __init__(self) -> None:
            self.store, self.checks = torch.distributed.HashStore(), 0

        def check(self, keys):
            self.checks += 1
            return self.store.check(keys)

        def __getattr__(self, name):
            return getattr(self.store, name)

    store = Counting()
    threading.Timer(2.0, lambda: store.set("job/rank1", "done")).start()
    assert async_save._wait(store, ["job/rank1"]) == ["done"]
    assert store.checks <= 2 * 9 + 1, store.checks  # 20, 40, ..., 640 ms, 1 s, 1 s: 9 looks
