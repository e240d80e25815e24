"""``zerostack convert``: a checkpoint between zerostack's format, DeepSpeed's, Hugging Face
safetensors and torch DCP, checked against the folders real DeepSpeed 0.19.8 wrote
(tests/fixtures/deepspeed/):

- ``--to hf``: sharded safetensors and the index that ``from_pretrained`` loads into the
  weights the checkpoint holds, bit for bit;
- ``--to zerostack`` from DeepSpeed's folder: resumes under zerostack with DeepSpeed's own next
  losses (as the folder itself does);
- ``--to deepspeed`` from a zerostack-only folder (the state of DeepSpeed's folder, loaded and
  saved natively) and from DeepSpeed's folder itself: DeepSpeed's files bit for bit; cut for
  another dp size and stage, a folder that resumes with DeepSpeed's next losses;
- ``--to dcp``: what ``torch.distributed.checkpoint.load`` reads back is every weight and moment.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from zerostack.checkpoint import full_state_dict
from zerostack.checkpoint.convert import convert
from zerostack.checkpoint.restore import open_reader

from tests.support.ranks import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import deepspeed_fixtures as fx  # noqa: E402

from tests.test_deepspeed_checkpoints import _next, _resume  # noqa: E402
from tests.test_deepspeed_write import WRITTEN, _round_trip, folder_differences  # noqa: E402


def test_to_hf_shards_load_with_from_pretrained_bit_for_bit(tmp_path):
    src = os.path.join(fx.FIXTURES, "zero2")
    report = convert(src, str(tmp_path), "hf", max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all(os.path.getsize(tmp_path / f) <= 40_000 + 4096 for f in files)
    assert report.tensors == len(index["weight_map"])
    from transformers import GPT2LMHeadModel

    fx.model().config.save_pretrained(tmp_path)
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.float32)
    want = full_state_dict(src)
    got = loaded.state_dict()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_to_hf_bf16_and_one_file(tmp_path):
    from safetensors.torch import load_file

    src = os.path.join(fx.FIXTURES, "zero3")
    convert(src, str(tmp_path), "hf", dtype="bf16")
    got = load_file(tmp_path / "model.safetensors")
    want = full_state_dict(src)
    assert "lm_head.weight" not in got  # tied to the embedding: written once, as HF does
    for name, value in got.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, want[name].bfloat16())


@pytest.mark.distributed
def test_to_zerostack_from_deepspeed_resumes_with_deepspeeds_losses(tmp_path):
    convert(os.path.join(fx.FIXTURES, "zero3"), str(tmp_path / "zs"), "zerostack")
    folder, reader = open_reader(str(tmp_path / "zs"))
    assert type(reader).__name__ == "ShardReader"
    assert reader.manifest["client_state"] == {"epoch": 7}
    want = full_state_dict(os.path.join(fx.FIXTURES, "zero3"))
    got = full_state_dict(str(tmp_path / "zs"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    out = run_distributed(_resume, fx.WORLD, args=("zero3", 2, str(tmp_path / "zs")))
    for (_, client, counters, losses), expect in zip(out, _next("zero3"), strict=True):
        assert client == {"epoch": 7} and counters[:2] == (3, 12)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expect), rtol=1e-6, atol=0)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["zero1", "zero3_bf16", "zero2_odd", "zero2_frozen"])
def test_to_deepspeed_from_zerostacks_files_is_deepspeeds_bit_for_bit(case, tmp_path):
    run_distributed(_round_trip, fx.WORLD, args=(case, str(tmp_path / "zs"), True))
    assert not list((tmp_path / "zs" / "global_step3").glob("*.pt"))  # zerostack's files only
    convert(str(tmp_path / "zs"), str(tmp_path / "ds"), "deepspeed")
    theirs = os.path.join(fx.FIXTURES, case, "global_step3")
    assert folder_differences(str(tmp_path / "ds" / "global_step3"), theirs) == []
    assert (tmp_path / "ds" / "latest").read_text() == "global_step3"
    assert (tmp_path / "ds" / "zero_to_fp32.py").exists()


@pytest.mark.parametrize(
    "case", [c for c in WRITTEN if not (fx.CASES[c].get("pipe") or fx.CASES[c].get("moe"))]
)
def test_deepspeeds_folder_converted_to_deepspeed_is_itself_bit_for_bit(case, tmp_path):
    """DeepSpeed's folder read (:mod:`.deepspeed_read`) and written (:mod:`.deepspeed_write`)
    back, in one process: every file as DeepSpeed wrote it; a universal checkpoint (read and
    written by :mod:`.deepspeed_universal`) every file ``ds_to_universal`` wrote too."""
    universal = bool(fx.CASES[case].get("universal"))
    convert(os.path.join(fx.FIXTURES, case), str(tmp_path), "deepspeed", universal=universal)
    tag = "global_step3_universal" if universal else "global_step3"
    theirs = os.path.join(fx.FIXTURES, case, tag)
    assert folder_differences(str(tmp_path / tag), theirs) == []
    if universal:
        assert (tmp_path / "latest_universal").read_text() == tag


@pytest.mark.parametrize("case", ["zero2", "zero3_bf16", "zero2_odd"])
def test_deepspeed_to_zerostack_to_deepspeed_is_deepspeeds_bit_for_bit(case, tmp_path):
    """Through zerostack's format (each parameter whole, one file) and back, cut again for
    DeepSpeed's 2 ranks: each rank's piece is read as an element range of the whole tensor."""
    convert(os.path.join(fx.FIXTURES, case), str(tmp_path / "zs"), "zerostack")
    convert(str(tmp_path / "zs"), str(tmp_path / "ds"), "deepspeed", world=2)
    theirs = os.path.join(fx.FIXTURES, case, "global_step3")
    assert folder_differences(str(tmp_path / "ds" / "global_step3"), theirs) == []


@pytest.mark.distributed
def test_to_deepspeed_on_another_dp_size_and_stage_resumes(tmp_path):
    """DeepSpeed's zero2 folder recut for 1 rank at ZeRO-3, then read back at dp 1: the loss is
    the mean of the two ranks' DeepSpeed losses."""
    convert(os.path.join(fx.FIXTURES, "zero2"), str(tmp_path / "ds1"), "deepspeed", world=1,
            stage=3)  # fmt: skip
    names = sorted(p.name for p in (tmp_path / "ds1" / "global_step3").glob("*.pt"))
    assert names == ["zero_pp_rank_0_mp_rank_00_model_states.pt",
                     "zero_pp_rank_0_mp_rank_00_optim_states.pt"]  # fmt: skip
    [(_, client, _, losses)] = run_distributed(_resume, 1, args=("zero2", 2,
                                                                str(tmp_path / "ds1")))
    want = [sum(r[i] for r in _next("zero2")) / 2 for i in range(2)]
    assert client == {"epoch": 7}
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-6, atol=0)


@pytest.mark.parametrize("source", ["deepspeed", "zerostack"])
def test_to_dcp_reads_back_every_weight_and_moment(source, tmp_path):
    import torch.distributed.checkpoint as dcp

    src = original = os.path.join(fx.FIXTURES, "zero2_frozen")
    if source == "zerostack":  # the same state, each parameter whole in zerostack's format
        convert(src, str(tmp_path / "zs"), "zerostack")
        src = str(tmp_path / "zs")
    convert(src, str(tmp_path / "dcp"), "dcp")
    _, reader = open_reader(original)  # the values as DeepSpeed wrote them
    frozen = set(reader.manifest["frozen"])
    state = {}
    for name, shape in reader.manifest["params"].items():
        state[f"model.{name}"] = torch.zeros(shape)
        if name not in frozen:
            for kind in ("exp_avg", "exp_avg_sq"):
                state[f"optimizer.state.{name}.{kind}"] = torch.zeros(shape)
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for key, value in state.items():
        if key.startswith("model."):
            kind, name = "master", key[len("model.") :]
        else:
            name, kind = key[len("optimizer.state.") :].rsplit(".", 1)
        assert torch.equal(value, reader.full(name, kind)), key


def test_the_command(tmp_path, capsys):
    from zerostack.cli import main

    code = main(["convert", os.path.join(fx.FIXTURES, "zero1"), str(tmp_path), "--to", "hf",
                 "--no-progress"])  # fmt: skip
    assert code == 0
    assert "tensors" in capsys.readouterr().out and (tmp_path / "model.safetensors").exists()


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="--to 'safetensors': expected one of hf, zerostack"):
        convert(os.path.join(fx.FIXTURES, "zero1"), str(tmp_path / "x"), "safetensors")
    from zerostack.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="ZeRO stage 4 on 2 ranks"):
        convert(os.path.join(fx.FIXTURES, "zero1"), str(tmp_path / "y"), "deepspeed", stage=4)
    assert not (tmp_path / "x").exists()
