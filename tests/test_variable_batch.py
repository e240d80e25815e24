"""Dynamic batching (variable batch size and LR) equals DeepSpeed 0.19.8's, case by case.

tests/golden/variable_batch.json holds DeepSpeed's own results (scripts/variable_batch_golden.py,
run in the DeepSpeed venv): the micro-batches, batch sizes and batch max lengths of
``batch_by_seqlens`` for each picking order, size bound and filter; ``scale_lr``; the learning
rates ``VariableBatchSizeLR`` sets over constant, LambdaLR, StepLR and MultiplicativeLR bases,
with a ``step(0)`` reset; what each of 2 replicas' loaders yields, padded and collated. zerostack's
:mod:`zerostack.data.variable_batch` must give exactly the same (floats compared with ``==``:
the arithmetic is the same operations in the same order). Then the refusals, and the DeepSpeed
entry point on a real 2-rank engine (and on a stand-in with a pipeline), whose loaders and
learning rates must be the golden ones for the same settings.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from zerostack.compat.deepspeed.runtime.data_pipeline.data_sampling import (
    variable_batch_size_and_lr as ds_path,
)
from zerostack.config.load import load_config
from zerostack.data.variable_batch import (
    VariableBatchSizeLR,
    batch_by_seqlens,
    dataloader_for_variable_batch_size,
    get_dataloader_and_lr_scheduler_for_variable_batch_size,
    lr_scheduler_for_variable_batch_size,
    scale_lr,
)

from tests.support.ranks import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "tests", "golden", "variable_batch.json")) as _f:
    GOLDEN = json.load(_f)
SEQLENS = GOLDEN["seqlens"]
ENTRY = "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed"


# the golden script's dataset, padding and collate (scripts/variable_batch_golden.py)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
from variable_batch_golden import collate, pad, sample  # noqa: E402

DATASET = [sample(i) for i in range(len(SEQLENS))]


def sgd() -> torch.optim.SGD:
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    return torch.optim.SGD([{"params": [params[0]]}, {"params": [params[1]], "lr": 0.05}], lr=0.1)


def lrs(opt) -> list[float]:
    return [g["lr"] for g in opt.param_groups]


def plain(x):
    """Tuples as lists, as JSON has them."""
    if isinstance(x, list | tuple):
        return [plain(v) for v in x]
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    return x


# --- batch_by_seqlens -----------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(GOLDEN["batch_by_seqlens"]))
def test_batch_by_seqlens_equals_deepspeeds(case):
    want = GOLDEN["batch_by_seqlens"][case]
    if "error" in want:  # DeepSpeed asserts: too few micro-batches for one per data loader
        with pytest.raises(ValueError, match="fewer than effective_batch_size"):
            batch_by_seqlens(SEQLENS, **want["kwargs"])
        return
    ids, sizes, max_seqlens = batch_by_seqlens(SEQLENS, **want["kwargs"])
    assert plain(ids) == want["microbatch_ids"]
    assert sizes == want["batch_sizes"]
    assert max_seqlens == want["batch_max_seqlens"]


def test_samples_longer_than_max_tokens_are_left_out_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="zerostack"):
        ids, _, _ = batch_by_seqlens(SEQLENS, max_tokens=15, effective_batch_size=2)
    too_long = [i for i, n in enumerate(SEQLENS) if n > 15]
    assert len(caplog.records) == 1 and str(too_long) in caplog.messages[0]
    assert not {i for _, mb in ids for i in mb} & set(too_long)


def test_batch_by_seqlens_refusals():
    with pytest.raises(ValueError, match="sequence_picking_order: 'longest' is not one of"):
        batch_by_seqlens(SEQLENS, 30, sequence_picking_order="longest")
    with pytest.raises(ValueError, match="effective_batch_size: must be at least 1"):
        batch_by_seqlens(SEQLENS, 30, effective_batch_size=0)
    with pytest.raises(ValueError, match="the 0 samples within max_tokens make 0 micro-batches"):
        batch_by_seqlens([5, 6], max_tokens=4)


# --- scale_lr -------------------------------------------------------------------------------


def test_scale_lr_equals_deepspeeds():
    got = [scale_lr(base, size, lr, method) for base, size, lr, method, _ in GOLDEN["scale_lr"]]
    assert got == [want for *_, want in GOLDEN["scale_lr"]]
    assert scale_lr(4, 8, 0.1, "NONE") == 0.1


@pytest.mark.parametrize("method", ["cubic", "Linear", 3])
def test_scale_lr_refuses_unknown_methods(method):
    with pytest.raises(ValueError, match="lr_scaling_method: .* is not one of linear, sqrt, none"):
        scale_lr(4, 8, 0.1, method)


# --- VariableBatchSizeLR --------------------------------------------------------------------


def _base(kind, opt):
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.9**e)
    if kind == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    if kind == "multiplicative":  # steps from the rate it finds: step(0) must reset it first
        return torch.optim.lr_scheduler.MultiplicativeLR(opt, lambda e: 0.8)
    return opt


def _scheduler(kind, method):
    opt = sgd()
    sched = lr_scheduler_for_variable_batch_size(
        4, GOLDEN["lr_batch_sizes"], None, _base(kind, opt), lr_scaling_method=method
    )
    return opt, sched


@pytest.mark.parametrize("case", sorted(GOLDEN["scheduler"]))
def test_scheduler_equals_deepspeeds(case):
    """8 steps (the batch sizes wrap around), step(0) back to the first batch, 2 more."""
    want = GOLDEN["scheduler"][case]
    opt, sched = _scheduler(want["base"], want["method"])
    got = {"lrs": [lrs(opt)], "last_lr": [list(sched.get_last_lr())], "last_epoch": []}
    for epoch in [None] * 8 + [0, None, None]:
        opt.step()
        sched.step(epoch)
        got["lrs"].append(lrs(opt))
        got["last_lr"].append(list(sched.get_last_lr()))
        got["last_epoch"].append(sched.last_epoch)
    assert got == {k: want[k] for k in got}
    assert sched.get_lr() == lrs(opt) and sched.optimizer is opt


def test_scheduler_state_dict_resumes_the_schedule():
    """A scheduler loaded from another's state after 3 steps continues as it would have."""
    want = GOLDEN["scheduler"]["step_linear"]["lrs"]
    opt, sched = _scheduler("step", "linear")
    for _ in range(3):
        sched.step()
    state = sched.state_dict()
    assert state["last_epoch"] == 3 and state["batch_sizes"] == GOLDEN["lr_batch_sizes"]
    opt2, sched2 = _scheduler("step", "linear")
    opt2.load_state_dict(opt.state_dict())  # the optimizer's state holds the current rates
    sched2.load_state_dict(state)
    got = []
    for _ in range(4):
        sched2.step()
        got.append(lrs(opt2))
    assert got == want[4:8]


def test_scheduler_refuses_what_has_no_optimizer():
    with pytest.raises(ValueError, match="expected a torch.optim.Optimizer or a scheduler"):
        lr_scheduler_for_variable_batch_size(4, [4], None, None)
    with pytest.raises(ValueError, match="the scheduler's optimizer is a dict"):
        lr_scheduler_for_variable_batch_size(4, [4], None, SimpleNamespace(optimizer={}))
    assert issubclass(VariableBatchSizeLR, torch.optim.lr_scheduler.LRScheduler)


# --- the loader -----------------------------------------------------------------------------


def _microbatches():
    return batch_by_seqlens(SEQLENS, **GOLDEN["loader"]["kwargs"])


@pytest.mark.parametrize("rank", [0, 1])
def test_loader_equals_deepspeeds_on_each_replica(rank):
    """The replicas take the micro-batches in turn; padded to the batch's longest, collated."""
    want = GOLDEN["loader"][str(rank)]
    ids, _, max_seqlens = _microbatches()
    loader, io_kwargs = dataloader_for_variable_batch_size(
        DATASET, ids, max_seqlens, dataloader_rank=rank, dataloader_batch_size=2,
        dataloader_num_replicas=2, dataloader_collate_fn=collate, dataloader_num_workers=0,
        required_microbatches_of_same_seqlen=True, sample_padding_fn=pad,
    )  # fmt: skip
    unpadded, _ = dataloader_for_variable_batch_size(
        DATASET, ids, max_seqlens, dataloader_rank=rank, dataloader_batch_size=2,
        dataloader_num_replicas=2, dataloader_num_workers=0,
    )  # fmt: skip
    assert [plain(b) for b in loader] == want["padded"]
    assert [plain(b) for b in unpadded] == want["plain"]
    assert sorted(io_kwargs) == want["io_kwargs"]
    assert io_kwargs["batch_size"] == want["io_batch_size"]
    assert io_kwargs["num_local_io_workers"] == want["io_workers"]
    assert io_kwargs["data_sampler"] is loader.sampler and io_kwargs["dataset"] is ids


def test_loader_refusals():
    ids, _, max_seqlens = _microbatches()
    with pytest.raises(ValueError, match="sample_padding_fn: required when"):
        dataloader_for_variable_batch_size(
            DATASET, ids, max_seqlens, required_microbatches_of_same_seqlen=True
        )
    short = [1] * len(max_seqlens)  # lengths the dataset's samples exceed
    loader, _ = dataloader_for_variable_batch_size(
        DATASET, ids, short, dataloader_num_workers=0,
        required_microbatches_of_same_seqlen=True, sample_padding_fn=pad,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"sample \d+: length \d+ exceeds batch 0's longest"):
        next(iter(loader))


@pytest.mark.parametrize("rank", [0, 1])
def test_loader_and_scheduler_end_to_end_equal_deepspeeds(rank):
    want = GOLDEN["end_to_end"][str(rank)]
    opt = sgd()
    loader, sched, io_kwargs = get_dataloader_and_lr_scheduler_for_variable_batch_size(
        DATASET, SEQLENS, max_tokens=20, effective_batch_size=4,
        dataset_filter_ids=list(range(2, 46)), lr_scaling_method="sqrt", min_batch_size=1,
        max_batch_size=3, sequence_picking_order="random", dataloader_batch_size=1,
        dataloader_rank=rank, dataloader_num_replicas=2, dataloader_collate_fn=collate,
        lr_scheduler_or_optimizer=opt, required_microbatches_of_same_seqlen=True,
        sample_padding_fn=pad, seed=5,
    )  # fmt: skip
    assert [plain(b) for b in loader] == want["batches"]
    got = [lrs(opt)]
    for _ in range(5):
        sched.step()
        got.append(lrs(opt))
    assert got == want["lrs"] and sched.batch_sizes == want["batch_sizes"]
    assert io_kwargs["num_local_io_workers"] == want["io_workers"]


# --- DeepSpeed's entry point ----------------------------------------------------------------


def _data_efficiency(**batching) -> dict:
    """The data_efficiency block of the golden ``engine`` case's settings (and ``batching``)."""
    dynamic = {
        "enabled": True, "max_tokens": 20, "lr_scaling_method": "sqrt", "max_batch_size": 4,
        "sequence_picking_order": "random", **batching,
    }  # fmt: skip
    sampling = {"num_workers": 0, "dynamic_batching": dynamic}
    return {"enabled": True, "seed": 7, "data_sampling": sampling}


def _stand_in(rank: int, pipelined: bool, **batching):
    """An object with the engine attributes the entry point reads (2 data-parallel ranks)."""
    cfg = load_config(
        {"train_batch_size": 8, "data_efficiency": _data_efficiency(**batching)}
    )  # fmt: skip
    return SimpleNamespace(
        config=SimpleNamespace(data_efficiency=cfg.data_efficiency),
        topology=SimpleNamespace(data_parallel_rank=rank, data_parallel_size=2),
        runner=SimpleNamespace(pipelined=pipelined),
        train_batch_size=lambda: 8,
        train_micro_batch_size_per_gpu=lambda: 2,
        lr_scheduler=None,
        optimizer=sgd(),
    )


def test_the_deepspeed_path_serves_every_name():
    for name in ds_path.__all__:
        assert callable(getattr(ds_path, name)), name
    assert ds_path.batch_by_seqlens is batch_by_seqlens and ENTRY in ds_path.__all__


@pytest.mark.parametrize("rank", [0, 1])
def test_entry_point_under_a_pipeline_packs_same_size_padded_micro_batches(rank):
    """A pipelined engine (a stand-in): the golden loader case's settings and results."""
    engine = _stand_in(
        rank, True, max_tokens=24, sequence_picking_order="seqlen", lr_scaling_method="linear",
        max_batch_size=None,
    )  # fmt: skip
    loader, sched, io_kwargs = getattr(ds_path, ENTRY)(
        DATASET, engine, dataset_seqlens=SEQLENS, dataloader_collate_fn=collate,
        sample_padding_fn=pad,
    )  # fmt: skip
    assert [plain(b) for b in loader] == GOLDEN["loader"][str(rank)]["padded"]
    assert sched.optimizer is engine.optimizer and io_kwargs["batch_size"] == 2


def test_settings_are_read_with_deepspeeds_defaults():
    """From the typed config and from a plain dict (a DeepSpeed-style config) alike."""
    defaults = {
        "enabled": False, "lr_scaling_method": "linear", "min_batch_size": 1,
        "max_batch_size": None, "max_tokens": None, "sequence_picking_order": "dataloader",
        "verbose": False, "metrics_path": None, "num_workers": 0, "pin_memory": False,
        "seed": 1234,
    }  # fmt: skip
    typed = load_config({"train_batch_size": 8})
    assert ds_path._batching(SimpleNamespace(config=typed)) == defaults
    given = _data_efficiency()
    from_dict = ds_path._batching(SimpleNamespace(config={"data_efficiency": given}))
    assert from_dict == {**defaults, **given["data_sampling"]["dynamic_batching"], "seed": 7}


def test_entry_point_refusals():
    off = _stand_in(0, False, enabled=False)
    with pytest.raises(ValueError, match="dynamic_batching.enabled is false"):
        getattr(ds_path, ENTRY)(DATASET, off, dataset_seqlens=SEQLENS)
    with pytest.raises(ValueError, match="batch_seqlens_fn: needed to measure the sample"):
        getattr(ds_path, ENTRY)(DATASET, _stand_in(0, False))


def _loaded(loader) -> list:
    return [batch for batch in loader]


def test_lengths_measured_with_batch_seqlens_fn_then_read_from_the_metrics_files(tmp_path):
    """DeepSpeedExamples' script passes no lengths: they are measured with its
    ``batch_seqlens_fn`` on collated batches (DeepSpeed's DataAnalyzer's job), written as
    ``{metrics_path}/seqlen/seqlen_sample_to_metric`` by rank 0, and read from there by the next
    run, which needs no function: the loaders equal the one given the lengths."""
    given = getattr(ds_path, ENTRY)(
        DATASET, _stand_in(0, False), dataset_seqlens=SEQLENS, dataloader_collate_fn=collate
    )[0]
    engine = _stand_in(0, False, metrics_path=str(tmp_path))
    engine.global_rank = 0
    seen = []

    def batch_seqlens_fn(batch):
        seen.append(batch["n"])
        return torch.tensor([len(row) for row in batch["rows"]])

    measured = getattr(ds_path, ENTRY)(
        DATASET, engine, dataloader_collate_fn=collate, batch_seqlens_fn=batch_seqlens_fn
    )[0]
    assert seen == [len(DATASET)] and _loaded(measured) == _loaded(given)
    assert (tmp_path / "seqlen" / "seqlen_sample_to_metric.idx").exists()
    read = getattr(ds_path, ENTRY)(DATASET, engine, dataloader_collate_fn=collate)[0]
    assert _loaded(read) == _loaded(given)
    with pytest.raises(ValueError, match="sample lengths for a dataset of"):
        getattr(ds_path, ENTRY)(DATASET[:-1], engine, dataloader_collate_fn=collate)


def _engine_epochs(rank, world, seqlens, root):
    """The golden ``engine`` case on a real engine, as DeepSpeedExamples' script runs it: two
    epochs, each starting with ``step(0)``; what the loader yields and the LR after each step."""
    import zerostack.compat.deepspeed as deepspeed

    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "data_efficiency": _data_efficiency(),
    }
    engine, *_ = deepspeed.initialize(model=torch.nn.Linear(1, 1), config=config)
    dataset = [[i] * n for i, n in enumerate(seqlens)]
    loader, sched, _ = getattr(ds_path, ENTRY)(
        dataset, engine, dataset_seqlens=seqlens, dataloader_collate_fn=collate,
        sample_padding_fn=pad,
    )  # fmt: skip
    engine.lr_scheduler = sched  # engine.step() steps it at each window's end
    gas = engine.gradient_accumulation_steps()
    seen, rates = [], [engine.optimizer.param_groups[0]["lr"]]
    for _ in range(2):
        sched.step(0)
        batches = iter(loader)
        for _ in range(len(loader) // gas):
            for _ in range(gas):
                batch = next(batches)
                seen.append(plain(batch))
                x = torch.tensor([[float(len(row))] for row in batch["rows"]])
                engine.backward(engine(x).mean())
                engine.step()
            rates.append(engine.optimizer.param_groups[0]["lr"])
    engine.save_checkpoint(root, tag="vb")  # the scheduler's state goes into the checkpoint
    saved = sched.last_epoch
    sched.step(0)
    engine.load_checkpoint(root, tag="vb")
    assert sched.last_epoch == saved and sched.batch_sizes == sched.state_dict()["batch_sizes"]
    return engine.topology.data_parallel_rank, seen, rates


@pytest.mark.distributed
def test_entry_point_on_a_two_rank_engine_equals_deepspeeds(tmp_path):
    """Each rank reads its replica's golden micro-batches, twice; the LR after each step is
    the golden one, back to the first batch's after step(0). A checkpoint keeps the
    scheduler's position."""
    want = GOLDEN["engine"]
    runs = run_distributed(_engine_epochs, world=2, args=(SEQLENS, str(tmp_path)))
    for dp_rank, seen, rates in runs:
        golden = want[str(dp_rank)]
        steps = len(golden["batches"]) // 2  # 2 accumulation steps per optimizer step
        assert seen == golden["batches"] * 2
        assert rates == golden["lrs"][: steps + 1] + golden["lrs"][1 : steps + 1]
