"""Loss-spike rollback (the config's ``loss_spike`` block, zerostack.checkpoint.loss_spike) on two
real gloo ranks: a regression model whose targets are poisoned on one rank for two steps spikes
its dp-mean loss; the engine rolls back to the last checkpoint before the spike (the automatic
save inside the spike held back) and goes on with the data after it. The run ends with the
weights, Adam moments and LR schedule of a run that never saw the skipped batches, bit for bit
(AdamW and WarmupLR, so a moment or a schedule left at the spike's values shows; no clipping).
Also: the two errors on every rank, and the refusals."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, DistributedSampler

import zerostack
from zerostack.checkpoint.loss_spike import LossSpikeError
from zerostack.config import ConfigError, load_config

from tests.support.ranks import run_distributed

SAMPLES, BATCH, MICRO, SEED = 128, 8, 2, 5  # dp 2: accumulation 2; 16 steps an epoch, one epoch
POISONED_STEPS = (6, 7)  # 1-based steps whose data spikes the loss (on rank 0 only)
STEPS = 10


class Regression(Dataset):
    def __init__(self, poisoned: set[int]) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 8, generator=g)
        self.y = torch.sin(self.x.sum(1, keepdim=True))
        self.poisoned = poisoned

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        return self.x[i], self.y[i] + (100.0 if i in self.poisoned else 0.0)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x, y):
        return nn.functional.mse_loss(self.body(x), y)


def poisoned_ids(world: int) -> set[int]:
    """The samples rank 0 trains on in POISONED_STEPS (DistributedSampler's order: the engine
    loader's)."""
    order = list(DistributedSampler(range(SAMPLES), world, 0, shuffle=True, seed=SEED))
    per_step = BATCH // world
    return {i for s in POISONED_STEPS for i in order[(s - 1) * per_step : s * per_step]}


def config(save_dir: str, **spike) -> dict:
    return {
        "train_batch_size": BATCH,
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 20}},
        "zero_optimization": {"stage": 2},
        "seed": SEED,
        "steps_per_print": 1000,
        "checkpoint": {"save_dir": save_dir, "save_interval": 2},
        "loss_spike": spike,
    }


def _state(engine) -> dict:
    out = {f"param/{k}": v for k, v in engine.full_state_dict().items()}
    for i, m in enumerate(engine.zero.masters()):
        for k, v in engine.zero.read_master(m, engine.optimizer).items():
            out[f"master{i}/{k}"] = v.clone()
    out["lr"] = torch.tensor(engine.get_lr()[0], dtype=torch.float64)
    position = engine.training_dataloader.sampler.state_dict()  # what the next save records
    out["data"] = torch.tensor([position["epoch"], position["consumed_samples"]])
    return out


def _rollback_and_skip(rank, world, root):
    data = Regression(poisoned_ids(world))
    # the reference: 4 steps, the data of steps 5-7 drawn and dropped, then 6 steps
    ref, *_ = zerostack.initialize(
        model=Net(), training_data=data, config=config(os.path.join(root, "ref"))
    )
    for _ in range(4):
        ref.train_batch()
    it = ref.state.batches()  # the engine loader, repeated
    for _ in range(3 * ref.gradient_accumulation_steps()):
        next(it)
    while ref.global_steps < STEPS:
        ref.train_batch()
    want = _state(ref)
    ref.destroy()
    # the guarded run: steps 6 and 7 spike; step 6's save is held back, so step 7 rolls back
    # to step 4's checkpoint and goes on with step 8's data
    save_dir = os.path.join(root, "guarded")
    cfg = config(save_dir, factor=4.0, window=3, patience=2)
    engine, *_ = zerostack.initialize(model=Net(), training_data=data, config=cfg)
    losses = []
    while engine.global_steps < STEPS:
        losses.append(float(engine.train_batch()))
    got = _state(engine)
    rollbacks = engine.loss_spike.rollbacks
    engine.destroy()
    return want, got, rollbacks, losses


@pytest.mark.distributed
def test_a_spike_rolls_back_to_the_last_good_checkpoint_and_skips_it(tmp_path):
    results = run_distributed(_rollback_and_skip, world=2, args=(str(tmp_path),))
    for want, got, rollbacks, losses in results:
        # step 4's checkpoint, not step 6's: the save inside the spike was held back
        assert [(r.step, r.tag, r.resumed_at) for r in rollbacks] == [(7, "global_step4", 4)]
        spike = rollbacks[0]
        assert spike.loss > 4.0 * spike.median and spike.loss == losses[6], (spike, losses)
        assert max(losses[:5] + losses[7:]) < 4.0 * spike.median  # the rest were not spikes
        assert len(losses) == STEPS + 3  # steps 5-7 again, on new data
        assert want.keys() == got.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), f"{k} differs from the run without the spike"
    assert results[0][1]["param/body.0.weight"].isfinite().all()


def _errors(rank, world, root):
    data = Regression(poisoned_ids(world))
    out = []
    for name, spike, every in (
        ("none-left", {"factor": 4.0, "window": 3, "max_rollbacks": 0}, 2),
        ("no-checkpoint", {"factor": 4.0, "window": 3}, 100),
    ):
        cfg = config(os.path.join(root, name), **spike)
        cfg["checkpoint"]["save_interval"] = every
        engine, *_ = zerostack.initialize(model=Net(), training_data=data, config=cfg)
        try:
            while engine.global_steps < STEPS:
                engine.train_batch()
            out.append(None)
        except LossSpikeError as e:
            out.append((engine.global_steps, str(e)))
        engine.destroy()
    return out


@pytest.mark.distributed
def test_a_spike_that_cannot_roll_back_is_every_ranks_error(tmp_path):
    for (at0, none_left), (at1, no_checkpoint) in run_distributed(
        _errors, world=2, args=(str(tmp_path),)
    ):
        assert at0 == at1 == 6
        assert none_left.startswith("loss_spike: step 6's loss ") and none_left.endswith(
            " after 0 rollbacks (loss_spike.max_rollbacks)"
        ), none_left
        assert no_checkpoint.endswith(
            f", and {tmp_path / 'no-checkpoint'} has no checkpoint to roll back to"
        ), no_checkpoint


def test_the_guard_is_refused_without_a_checkpoint_to_roll_back_to():
    with pytest.raises(ConfigError, match=r"^loss_spike.factor: must be above 1, or 0 for off"):
        load_config({"train_batch_size": 8, "loss_spike": {"factor": 1.0}})
    with pytest.raises(
        ConfigError,
        match=r"^loss_spike.factor: needs checkpoint.save_dir and checkpoint.save_interval ",
    ):
        load_config({"train_batch_size": 8, "loss_spike": {"factor": 3.0}})
    ok = load_config(
        {
            "train_batch_size": 8,
            "loss_spike": {"factor": 3.0},
            "checkpoint": {"save_dir": "ckpt", "save_interval": 10},
        }
    )
    assert (ok.loss_spike.window, ok.loss_spike.patience, ok.loss_spike.max_rollbacks) == (20, 1, 3)
