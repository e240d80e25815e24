"""Checkpoints of offloaded training (issue 15, item 4), on real gloo ranks.

- Exact resume in fresh processes: train K steps, save, train K more (one set of processes) equals
  load in new processes and train K (bit for bit: parameters, fp32 masters, moments, steps), with
  the parameters offloaded to host memory or files, the optimizer in files, or both.
- A checkpoint of offloaded training reloads on a layout without offload (stage 3 at dp 2, stage
  1 at dp 1): every parameter's fp32 value and Adam moments equal the saver's, bit for bit, and
  training on from it at stage 3 without offload is the offloaded run bit for bit (offload runs
  the same arithmetic, tests/test_offload.py).
- A save streams one sub-group at a time: the process's peak resident memory during the save
  (the kernel's VmHWM, reset just before through /proc/self/clear_refs: nothing the code under
  test reports) stays within a couple of sub-groups plus a constant, well under the state it
  writes.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import zerostack
from zerostack.checkpoint.stream import Entry, ShardWriter, sha256
from zerostack.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

from tests.support.models import batch, tiny_gpt
from tests.support.ranks import run_distributed

K, B = 3, 8
NVME = {"device": "nvme", "buffer_count": 3}
CASES = {
    "stage 3, offload_param cpu": dict(stage=3, offload_param={"device": "cpu"}),
    "stage 3, offload_param nvme": dict(stage=3, offload_param=NVME),
    "stage 3, offload_param nvme, offload_optimizer nvme": dict(
        stage=3, offload_param=NVME, offload_optimizer=NVME
    ),
    "stage 2, offload_optimizer nvme": dict(stage=2, offload_optimizer=NVME),
    "stage 1, offload_optimizer nvme": dict(stage=1, offload_optimizer=NVME),
}
BOTH = "stage 3, offload_param nvme, offload_optimizer nvme"


def _config(world: int, stage: int, nvme: str, **offload) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 5000, "stage3_param_persistence_threshold": 0}
    for key, value in offload.items():
        zero[key] = {**value, "nvme_path": nvme} if value["device"] == "nvme" else value
        zero["sub_group_size"] = 3000  # a few sub-groups, each read and written on its own
    return {
        "train_micro_batch_size_per_gpu": B // world,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-3}},
        "zero_optimization": zero,
    }


def _train(engine, rank: int, world: int, first: int, count: int) -> None:
    per = B // world
    for step in range(first, first + count):
        x, y = batch(step, B)
        engine.backward(engine(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
        engine.step()


def _state(engine) -> dict[str, torch.Tensor]:
    """Every parameter's full fp32 value and Adam moments (whatever the layout), and the step."""
    out = {}
    for name, p in engine.module.named_parameters():
        out[f"fp32/{name}"] = safe_get_full_fp32_param(p).clone()
        for kind in ("exp_avg", "exp_avg_sq"):
            out[f"{kind}/{name}"] = safe_get_full_optimizer_state(p, kind).clone()
    out["global_steps"] = torch.tensor(engine.global_steps)
    return out


def _first_half(rank, world, root):
    """Per case: K steps, save, (the state then), K more steps (the state after)."""
    out = {}
    for i, (name, case) in enumerate(CASES.items()):
        cfg = _config(world, case["stage"], os.path.join(root, "nvme"), **_offload(case))
        engine, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
        _train(engine, rank, world, 0, K)
        engine.save_checkpoint(os.path.join(root, f"case{i}"))
        at_save = _state(engine)
        _train(engine, rank, world, K, K)
        out[name] = at_save, _state(engine)
        engine.destroy()
    return out


def _offload(case: dict) -> dict:
    return {k: v for k, v in case.items() if k.startswith("offload")}


def _resumed(rank, world, root):
    """Per case, in processes that never trained: another model, load, K steps."""
    out = {}
    for i, (name, case) in enumerate(CASES.items()):
        cfg = _config(world, case["stage"], os.path.join(root, "nvme"), **_offload(case))
        engine, *_ = zerostack.initialize(model=tiny_gpt(seed=7), config=cfg)
        engine.load_checkpoint(os.path.join(root, f"case{i}"))
        _train(engine, rank, world, K, K)
        out[name] = _state(engine)
        engine.destroy()
    return out


def _without_offload(rank, world, root, stage):
    """BOTH's checkpoint loaded with nothing offloaded: the state right after the load, and (at
    the saver's layout) after K more steps."""
    folder = os.path.join(root, f"case{list(CASES).index(BOTH)}")
    engine, *_ = zerostack.initialize(model=tiny_gpt(seed=7), config=_config(world, stage, ""))
    engine.load_checkpoint(folder)
    loaded = _state(engine)
    after = None
    if world == 2:
        _train(engine, rank, world, K, K)
        after = _state(engine)
    engine.destroy()
    return loaded, after


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        assert torch.equal(got[k], want[k]), f"{what}: {k} differs"


@pytest.mark.distributed
@pytest.mark.slow
def test_exact_resume_in_fresh_processes_and_without_offload(tmp_path):
    root = str(tmp_path)
    os.makedirs(os.path.join(root, "nvme"))
    first = run_distributed(_first_half, 2, args=(root,))
    resumed = run_distributed(_resumed, 2, args=(root,))
    for r in range(2):
        for name in CASES:
            _assert_equal(resumed[r][name], first[r][name][1], f"rank {r}, {name}: resumed")
    # the offloaded checkpoint on layouts without offload
    for loaded, after in run_distributed(_without_offload, 2, args=(root, 3)):
        _assert_equal(loaded, first[0][BOTH][0], "stage 3 without offload, after the load")
        _assert_equal(after, first[0][BOTH][1], "stage 3 without offload, K steps on")
    loaded, _ = run_distributed(_without_offload, 1, args=(root, 1))[0]
    _assert_equal(loaded, first[0][BOTH][0], "stage 1 at dp 1, after the load")
    assert os.listdir(os.path.join(root, "nvme")) == []  # every swap file removed


# ------------------------------------------------------------------ host memory during a save
WIDTH, DEPTH = 512, 16  # 4.2 M parameters: 25 MB of fp32 masters and moments on each of 2 ranks
SUB = 2**17  # elements per sub-group: 1.5 MB of master and moments


def _big() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH)])


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _save_peak(rank, world, root, stage, offload):
    nvme = {"device": "nvme", "nvme_path": os.path.join(root, "nvme"), "buffer_count": 2}
    zero = {"stage": stage, "sub_group_size": SUB, "reduce_bucket_size": SUB * world}
    zero.update({k: nvme for k in offload})
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
    }
    engine, *_ = zerostack.initialize(model=_big(), config=cfg)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        engine.backward(engine(x).square().mean())
        engine.step()
    engine.save_checkpoint(os.path.join(root, "warm"))  # first-call costs (imports, pools)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident size (VmHWM) starts again from the size now
    before = _rss_kib("VmHWM")
    path = engine.save_checkpoint(os.path.join(root, "measured"))
    peak = _rss_kib("VmHWM") - before
    written = os.path.getsize(os.path.join(path, f"rank{rank:05d}.safetensors"))
    engine.destroy()
    return peak * 1024, written


@pytest.mark.distributed
def test_a_save_holds_one_sub_group_at_a_time(tmp_path):
    """Stage 1 with the optimizer on NVMe, and stage 3 with parameters and optimizer on NVMe:
    the save's extra peak resident memory is under 2 sub-groups (master + 2 moments, 1.5 MB
    each) + 6 MB, and under a quarter of what the rank writes (25 MB; a save that held the whole
    shard, as ``safetensors.save_file`` does, needs all of it)."""
    os.makedirs(tmp_path / "nvme")
    sub_group = SUB * 4 * 3
    for stage, offload in ((1, ["offload_optimizer"]), (3, ["offload_param", "offload_optimizer"])):
        results = run_distributed(_save_peak, 2, args=(str(tmp_path), stage, offload))
        for rank, (peak, written) in enumerate(results):
            print(
                f"stage {stage}, {'+'.join(offload)}, rank {rank}: wrote {written / 2**20:.2f} "
                f"MiB, peak extra RSS during the save {peak / 2**20:.2f} MiB"
            )
            assert written > 23 * 2**20
            assert peak < 2 * sub_group + 6 * 2**20, (stage, rank, peak)
            assert peak < written / 4, (stage, rank, peak, written)


# ------------------------------------------------------------------ the streamed file format
def test_a_streamed_file_is_plain_safetensors(tmp_path):
    """What ShardWriter writes loads with safetensors' own load_file (every dtype a checkpoint
    holds, a scalar, an empty tensor); a tensor other than the planned one, or one missing at
    close, is an error rather than a file whose header lies."""
    tensors = {
        "step": torch.tensor(5),
        "bf16": torch.randn(3, 4).bfloat16(),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0),
        "rng": torch.get_rng_state(),
        "fp32": torch.randn(10),
    }
    plan = [Entry(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    out = ShardWriter(str(tmp_path / "a.safetensors"), plan)
    for k, t in tensors.items():
        out.put(k, t)
    out.close()
    got = load_file(str(tmp_path / "a.safetensors"))
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t)
        assert out.hashes[k] == sha256(t)
    out = ShardWriter(str(tmp_path / "b.safetensors"), plan)
    with pytest.raises(ValueError, match="the plan has step"):
        out.put("bf16", tensors["bf16"])
    out.put("step", tensors["step"])
    with pytest.raises(ValueError, match="bf16 and after were never written"):
        out.close()
