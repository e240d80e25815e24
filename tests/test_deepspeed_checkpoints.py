"""DeepSpeed's checkpoint folders resume under zerostack: folders real DeepSpeed 0.19.8 wrote
(tests/fixtures/deepspeed/, from scripts/deepspeed_fixtures.py: a tiny GPT-2, AdamW and WarmupLR
from the config, 2 ranks, saved after 3 steps) load with ``engine.load_checkpoint(dir)`` at the
same layout and at another ZeRO stage and dp size, and the next two losses are DeepSpeed's own
continuing from the same folder (recorded beside it): within 1e-6 in fp32 and fp16, 2e-5 in bf16
after the first update (its arithmetic rounds at other points: from scratch the two engines' bf16
losses differ by 2e-5 too).
Nothing is unpickled: a class off the allow-list is refused naming it, and a truncated file or a
missing rank's file is a one-line error naming the file."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys

import pytest
import torch

import zerostack.compat.deepspeed as deepspeed
from zerostack.checkpoint import CheckpointError

from tests.support.ranks import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import deepspeed_fixtures as fx  # noqa: E402

EXPECTED = json.load(open(os.path.join(fx.FIXTURES, "expected.json")))
CASES = EXPECTED["cases"]


def _load(engine, case, folder=None):
    """Case ``case``'s fixture folder (or ``folder``) loaded: the tag, client state and the
    counters it set (steps, samples, skipped steps, learning rates, loss scale)."""
    path, client = engine.load_checkpoint(folder or os.path.join(fx.FIXTURES, case))
    counters = (engine.global_steps, engine.global_samples, engine.skipped_steps,
                engine.get_lr(), engine.loss_scale)  # fmt: skip
    return os.path.basename(path), client, counters


def _resume(rank, world, case, stage, folder=None, tp=None):
    """Case ``case``'s script resumed from its fixture folder (or ``folder``) at ``stage`` (and
    tensor-parallel size ``tp``: the case's unless given)."""
    tp = tp or fx.CASES[case].get("tp", 1)
    cfg = fx.ds_config(**{**fx.CASES[case], "stage": stage, "tp": tp})
    rank, world = rank // tp, world // tp  # the data-parallel rank and size
    cfg["train_micro_batch_size_per_gpu"] = fx.MICRO * fx.WORLD // world
    net = fx.llama() if "tp" in fx.CASES[case] else fx.model("frozen" in case, "odd" in case)
    params = [p for p in net.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=net, model_parameters=params, config=cfg)
    tag, client, counters = _load(engine, case, folder)
    losses = []
    for step in range(fx.SAVE_AT, fx.STEPS):
        x = fx.tokens(step, rank, world, "odd" in case)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    return tag, client, counters, losses


def _resume_pipe(rank, world, case, stage, folder=None, stages=2):
    """The ``pipe`` case's script resumed from its fixture folder (on ``stages`` pipeline
    stages: DeepSpeed's had 2)."""
    cfg = fx.ds_config(**{**fx.CASES[case], "stage": stage})
    net = fx.pipe_model(*fx.pipe_classes(), stages=stages)
    engine, *_ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()),
                                      config=cfg)  # fmt: skip
    tag, client, counters = _load(engine, case, folder)
    losses = [float(engine.train_batch(data_iter=fx.pipe_batches(step)))
              for step in range(fx.SAVE_AT, fx.STEPS)]  # fmt: skip
    return tag, client, counters, losses


def _resume_moe(rank, world, case, stage, folder=None):
    """The ``moe`` case's script (4 experts over ep 2) resumed from its fixture folder."""
    net, groups = fx.moe_model()
    cfg = fx.ds_config(**{**fx.CASES[case], "stage": stage})
    engine, *_ = deepspeed.initialize(model=net, model_parameters=groups, config=cfg)
    tag, client, counters = _load(engine, case, folder)
    losses = []
    for step in range(fx.SAVE_AT, fx.STEPS):
        loss = fx.moe_loss(engine, step, rank, world)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return tag, client, counters, losses


def _resume_of(case: str):
    kind = fx.CASES[case]
    return _resume_pipe if kind.get("pipe") else _resume_moe if kind.get("moe") else _resume


def _tag(case: str) -> str:
    return "global_step3_universal" if fx.CASES[case].get("universal") else "global_step3"


def _next(case: str) -> list[list[float]]:
    return [r[fx.SAVE_AT :] for r in CASES[case]["losses"]]


def test_the_fixtures_are_deepspeeds():
    assert EXPECTED["versions"]["deepspeed"] == "0.19.8"
    assert EXPECTED["command"].startswith("DS_ACCELERATOR=cpu .peers/bin/python scripts/deepspeed_")
    assert set(CASES) == set(fx.CASES)
    for case in CASES:
        universal = fx.CASES[case].get("universal")
        latest = os.path.join(fx.FIXTURES, case, "latest_universal" if universal else "latest")
        assert open(latest).read().strip() == _tag(case)


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(fx.CASES))
def test_a_deepspeed_folder_resumes_with_deepspeeds_next_losses(case):
    # the first loss is the loaded weights' alone: 1e-6 everywhere; the second follows one
    # update from the loaded moments: 1e-5 in bf16 as before; at stage 0 in bf16 DeepSpeed's
    # FP16_Optimizer sums the gradient norm as one flat group (6e-8 relative apart from
    # zerostack's), four weights round to the next bf16 value and a loss moves by 1.6e-5
    # (measured); a moment or step count off moves it by 1e-4 and more
    tol = [1e-6, 2e-5 if case == "zero0_bf16" else 1e-5 if "bf16" in case else 1e-6]
    if case == "zero0_fp16":  # DeepSpeed 0.19.8's stage 0 fp16 never scales the loss (its
        tol = tol[:1]  # engine.backward scales for ZeRO optimizers only) but divides the
        # gradients by the scale: its next update is not the one zerostack makes
    kind = fx.CASES[case]
    resume = _resume_of(case)
    got = run_distributed(resume, fx.WORLD, args=(case, fx.CASES[case]["stage"]))
    # fp16's first two steps overflow (the scale 2^18, then 2^17): DeepSpeed skips them, but at
    # stage 0, where nothing overflows
    skipped = 2 if "fp16" in case and case != "zero0_fp16" else 0
    scale = {0: 1.0, 2: 2.0**16}.get(skipped) if "fp16" in case else 1.0
    scale = 2.0**18 if case == "zero0_fp16" else scale
    # under AutoTP DeepSpeed 0.19.8 counted 24 samples in 3 steps of 4 (each tp rank's copy of
    # the batch counted); its counter is loaded as it is
    samples = 24 if kind.get("tp") else 12
    for (tag, client, counters, losses), want in zip(got, _next(case), strict=True):
        assert tag == _tag(case) and client == {"epoch": 7}
        assert counters[:3] == (3, samples, skipped)
        # WarmupLR's lr after 3 - skipped steps (last_batch_iteration 2 - skipped):
        # 1e-2 * log(3 - skipped) / log(4)
        lr = 1e-2 * math.log(3 - skipped) / math.log(4)
        groups = 2 if kind.get("moe") else 1  # the experts' own group
        assert counters[3] == pytest.approx([lr] * groups, rel=1e-12, abs=0)
        assert counters[4] == scale
        for got_loss, want_loss, rtol in zip(losses, want, tol, strict=False):  # zero0_fp16: 1
            assert got_loss == pytest.approx(want_loss, rel=rtol, abs=0)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "case, stage, world",
    [("zero2", 3, 2), ("zero3", 1, 1), ("zero1", 2, 1), ("zero0", 3, 2), ("zero2_fp16", 0, 1),
     ("zero3_frozen", 2, 1), ("moe_zero2", 1, 2)],
)
def test_a_deepspeed_folder_resumes_on_another_stage_and_dp_size(case, stage, world):
    """At dp 1 one rank trains on the whole batch: its loss is the mean of the two ranks'."""
    got = run_distributed(_resume_of(case), world, args=(case, stage))
    want = torch.tensor(_next(case))
    losses = torch.tensor([r[3] for r in got])
    if world == 1:
        losses, want = losses[0], want.mean(0)
    torch.testing.assert_close(losses, want, rtol=1e-6, atol=0)


@pytest.mark.distributed
def test_a_deepspeed_tensor_parallel_folder_resumes_without_tp():
    """DeepSpeed's AutoTP slices (tp 2) joined whole: 2 data-parallel ranks without tp continue
    with DeepSpeed's losses (each rank's half of the batch: their mean is the batch's loss)."""
    got = run_distributed(_resume, 2, args=("tp2_zero1", 1), kwargs={"tp": 1})
    want = _next("tp2_zero1")[0]
    for step, want_loss in enumerate(want):
        mean = sum(r[3][step] for r in got) / 2
        assert mean == pytest.approx(want_loss, rel=1e-6, abs=0)


@pytest.mark.distributed
def test_a_deepspeed_pipeline_folder_resumes_on_one_stage():
    """Its layer files and both stages' optimizer files joined: one rank running all 6 layers
    continues with DeepSpeed's losses (every stage reports the batch's loss)."""
    [got] = run_distributed(_resume_pipe, 1, args=("pipe_zero1", 1), kwargs={"stages": 1})
    want = _next("pipe_zero1")[0]
    for got_loss, want_loss in zip(got[3], want, strict=True):
        assert got_loss == pytest.approx(want_loss, rel=1e-6, abs=0)


def _load_only(rank, world, folder):
    engine, *_ = deepspeed.initialize(model=fx.model(), config=fx.ds_config(2))
    try:
        engine.load_checkpoint(folder)
    except CheckpointError as e:
        return str(e)
    return None


def _copy(tmp_path, case: str = "zero2") -> str:
    folder = str(tmp_path / case)
    shutil.copytree(os.path.join(fx.FIXTURES, case), folder)
    return folder


@pytest.mark.distributed
def test_a_class_off_the_allow_list_is_refused_before_anything_loads(tmp_path):
    import argparse

    folder = _copy(tmp_path)
    path = os.path.join(folder, "global_step3", "mp_rank_00_model_states.pt")
    state = torch.load(path, weights_only=False)  # the test's own file: written just now
    state["args"] = argparse.Namespace(lr=1.0)  # what older scripts put in client state
    torch.save(state, path)
    (message,) = run_distributed(_load_only, 1, args=(folder,))
    assert message == (
        f"{path}: holds argparse.Namespace, which is not on the allow-list of DeepSpeed classes "
        "zerostack reads (refused: loading never unpickles code)"
    )


@pytest.mark.distributed
def test_a_truncated_or_missing_file_is_named(tmp_path):
    folder = _copy(tmp_path)
    path = os.path.join(folder, "global_step3", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    (message,) = run_distributed(_load_only, 1, args=(folder,))
    assert message.startswith(f"{path}: not a readable checkpoint file (")
    os.remove(path)
    (message,) = run_distributed(_load_only, 1, args=(folder,))
    assert message == (
        f"{os.path.dirname(path)}: 1 optimizer-state files, DeepSpeed's partition count says 2 "
        "(an incomplete or mixed folder)"
    )


@pytest.mark.parametrize("case", ["zero2", "zero3", "zero2_bf16"])
def test_zero_to_fp32_reads_a_deepspeed_folder(case):
    """zerostack's ``deepspeed.utils.zero_to_fp32`` (and ``zerostack.checkpoint.full_state_dict``)
    turn DeepSpeed's folder into the fp32 weights: at stages 1-2 in fp32 exactly the module
    DeepSpeed saved beside them, the tied head under its own name too; in bf16 the masters,
    which round to that module's bf16 weights; at stage 3, zero2's (the same run)."""
    from zerostack.compat.deepspeed.utils.zero_to_fp32 import (
        get_fp32_state_dict_from_zero_checkpoint,
    )

    got = get_fp32_state_dict_from_zero_checkpoint(os.path.join(fx.FIXTURES, case))
    ref_case = "zero2" if case == "zero3" else case
    module = os.path.join(fx.FIXTURES, ref_case, "global_step3", "mp_rank_00_model_states.pt")
    saved = torch.load(module, weights_only=True)["module"]  # tensors only: no class to allow
    assert set(got) == set(saved)
    assert got["lm_head.weight"] is got["transformer.wte.weight"]
    for name, want in saved.items():
        if case == "zero3":  # another run of the same script: within fp32 round-off
            torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6)
        else:
            assert got[name].dtype == torch.float32
            assert torch.equal(got[name].to(want.dtype), want), name


def test_a_stage_0_folder_of_another_grouping_is_refused():
    """DeepSpeed's stage 0 files do not name their optimizer state's parameters: they pair with
    the loading run's groups, whose sizes must match (here the same parameters in reverse)."""
    from zerostack.checkpoint.deepspeed_read0 import Zero0Reader

    folder = os.path.join(fx.FIXTURES, "zero0", "global_step3")
    names = [n for n, p in fx.model().named_parameters() if n != "lm_head.weight"]
    reader = Zero0Reader(folder, groups=[names])
    assert list(reader.manifest["params"]) == names
    assert reader.manifest["aliases"] == {"lm_head.weight": "transformer.wte.weight"}
    with pytest.raises(CheckpointError) as err:
        Zero0Reader(folder, groups=[names[::-1]])
    assert str(err.value).startswith(
        f"{folder}/mp_rank_00_model_states.pt: optimizer group 0 holds parameters of [2048, "
    )
    assert str(err.value).endswith("another model or another grouping of its parameters")
