"""zerostack writes DeepSpeed's files: under ``deepspeed.initialize`` (the facade) a checkpoint
folder holds, beside zerostack's own files, what DeepSpeed 0.19.8 writes for the same run, key for
key and tensor for tensor, so DeepSpeed's ``load_checkpoint``, its ``zero_to_fp32.py`` and
Lightning's converter read it.

Checked against the folders real DeepSpeed wrote (tests/fixtures/deepspeed/, see
scripts/deepspeed_fixtures.py):

- round trip, exact: a DeepSpeed folder loaded into zerostack and saved at once gives back
  DeepSpeed's files bit for bit (every key, every non-tensor value, every tensor's dtype, shape
  and bytes), at ZeRO 0, 1, 2 and 3, fp32, bf16 and fp16 (the loss scaler's state), with frozen
  parameters;
- the same run: the folder zerostack writes after training the fixture script's 3 steps holds
  DeepSpeed's keys and values, its tensors within the two engines' arithmetic: the second
  moment within 3e-5 relative, because DeepSpeed's Adam kernel forms ``1 - beta2`` in fp32
  (0.999f gives 1.2871e-5 more than 0.001; measured: 1.298e-5 on every element), so its steps
  differ by half that (6.5e-6) in the update, and the fp32 masters and weights within 1e-5: a
  weight that is all update (a bias starting at zero) differs as its update does (measured:
  6.8e-6 on the layer-norm biases, 1.1e-6 on the matrices); with SGD, torch's arithmetic in
  both, 2e-7. In bf16 the two engines' forward passes round at other points (from scratch their
  losses differ by 2e-5), and in both 16-bit precisions DeepSpeed's masters start from the
  16-bit weights where zerostack's keep the fp32 ones (so in fp16, with the same losses, the
  masters differ by 4.5e-5): 16 bits are held to the round trip, which is exact.

What DeepSpeed itself does with the folder (resume with the same losses, ``zero_to_fp32.py``) is
run in the peer environment: scripts/deepspeed_fixtures.py --engine zerostack --check.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

import zerostack
import zerostack.compat.deepspeed as deepspeed
from zerostack.checkpoint.deepspeed_read import load_pickle
from zerostack.config import ConfigError

from tests.support.ranks import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import deepspeed_fixtures as fx  # noqa: E402

CASES = json.load(open(os.path.join(fx.FIXTURES, "expected.json")))["cases"]


def differences(ours, theirs, path: str = "", tol: dict | None = None) -> list[str]:
    """Where ``ours`` differs from ``theirs`` (keys and their order, types, values; tensors'
    dtype, shape and values: exactly, or within ``tol[key]`` relative to the norm)."""
    out: list[str] = []
    if torch.is_tensor(ours) or torch.is_tensor(theirs):
        if not (torch.is_tensor(ours) and torch.is_tensor(theirs)):
            return [f"{path}: {type(ours).__name__} vs {type(theirs).__name__}"]
        if ours.dtype != theirs.dtype or ours.shape != theirs.shape:
            return [f"{path}: {ours.dtype}{tuple(ours.shape)} vs {theirs.dtype}"
                    f"{tuple(theirs.shape)}"]  # fmt: skip
        allowed = (tol or {}).get(path.rsplit("/", 1)[-1].split("[")[0], 0.0)
        if ours.numel() and not torch.equal(ours, theirs):
            rel = ((ours.float() - theirs.float()).norm() / theirs.float().norm()).item()
            if not rel <= allowed:
                out.append(f"{path}: differs by {rel:.3g} relative")
        return out
    if isinstance(ours, dict) and isinstance(theirs, dict):
        if list(ours) != list(theirs):
            out.append(f"{path}: keys {list(ours)} vs {list(theirs)}")
        for k in ours:
            if k in theirs:
                out += differences(ours[k], theirs[k], f"{path}/{k}", tol)
        return out
    numbers = (int, float)
    if isinstance(ours, numbers) and isinstance(theirs, numbers) and bool not in (
        type(ours), type(theirs)
    ):  # torch's SGD keeps its defaults as ints (dampening=0), zerostack's config as floats
        return [] if ours == theirs else [f"{path}: {ours!r} vs {theirs!r}"]
    if type(ours) is not type(theirs):
        return [f"{path}: {type(ours).__name__} {ours!r} vs {type(theirs).__name__} {theirs!r}"]
    if isinstance(ours, (list, tuple)):
        if len(ours) != len(theirs):
            return [f"{path}: {len(ours)} items vs {len(theirs)}"]
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            out += differences(a, b, f"{path}[{i}]", tol)
        return out
    if hasattr(ours, "__dict__"):
        return differences(vars(ours), vars(theirs), f"{path}.__dict__", tol)
    return [] if ours == theirs else [f"{path}: {ours!r} vs {theirs!r}"]


def folder_differences(ours: str, theirs: str, tol: dict | None = None) -> list[str]:
    """Where the ``.pt`` files under ``ours`` differ from those under ``theirs`` (at any depth:
    a universal checkpoint's ``zero/<name>/`` too)."""

    def files(root: str) -> list[str]:
        found = glob.glob(os.path.join(root, "**", "*.pt"), recursive=True)
        return sorted(os.path.relpath(p, root) for p in found)

    names, mine = files(theirs), files(ours)
    if names != mine:
        return [f"files {mine} vs {names}"]
    out = []
    for n in names:
        a, b = load_pickle(os.path.join(ours, n)), load_pickle(os.path.join(theirs, n))
        out += differences(a, b, n, tol)
    return out


def _round_trip(rank, world, case, out, native=False):
    """Case ``case``'s fixture loaded and saved at once to ``out`` (under the facade, or with
    ``native``, ``zerostack.initialize``: zerostack's files only)."""
    cfg = fx.ds_config(**fx.CASES[case])
    if fx.CASES[case].get("pipe"):
        net = fx.pipe_model(*fx.pipe_classes())
    elif fx.CASES[case].get("moe"):
        net, params = fx.moe_model()
    else:
        net = fx.model("frozen" in case, "odd" in case)
    if not fx.CASES[case].get("moe"):
        params = [p for p in net.parameters() if p.requires_grad]
    init = zerostack.initialize if native else deepspeed.initialize
    engine, *_ = init(model=net, model_parameters=params, config=cfg)
    _, client = engine.load_checkpoint(os.path.join(fx.FIXTURES, case))
    engine.save_checkpoint(out, client_state=client)


WRITTEN = [c for c in fx.CASES if not fx.CASES[c].get("tp")]
"""The cases whose DeepSpeed files zerostack writes (AutoTP's slices: not yet)."""


@pytest.mark.distributed
@pytest.mark.parametrize("case", [c for c in WRITTEN if not fx.CASES[c].get("universal")])
def test_a_deepspeed_folder_saved_again_is_deepspeeds_bit_for_bit(case, tmp_path):
    run_distributed(_round_trip, fx.WORLD, args=(case, str(tmp_path)))
    folder = tmp_path / "global_step3"
    assert folder_differences(str(folder), os.path.join(fx.FIXTURES, case, "global_step3")) == []
    manifest = json.loads((folder / "manifest.json").read_text())
    assert sorted(manifest["deepspeed_files"]) == sorted(
        os.path.basename(p) for p in glob.glob(str(folder / "*.pt"))
    )
    assert os.access(tmp_path / "zero_to_fp32.py", os.X_OK)
    assert (tmp_path / "latest").read_text() == "global_step3"


@pytest.mark.distributed
def test_a_universal_folder_saved_again_is_the_zero_folder_it_came_from(tmp_path):
    """zero2_universal is zero2's run (its config adds checkpoint.load_universal) turned into a
    universal checkpoint: loaded and saved, it gives zero2's ZeRO files bit for bit but the
    config they record."""
    run_distributed(_round_trip, fx.WORLD, args=("zero2_universal", str(tmp_path)))
    ours = str(tmp_path / "global_step3")
    theirs = os.path.join(fx.FIXTURES, "zero2", "global_step3")
    diffs = folder_differences(ours, theirs)
    assert diffs and all("/ds_config: keys" in d for d in diffs), diffs


def _train(rank, world, case, out):
    fx.train(fx.CASES[case], out, deepspeed=deepspeed)


SAME_RUN = ["zero1", "zero3", "zero3_sgd", "zero2_odd", "zero0", "zero3_frozen", "pipe_zero1",
            "moe_zero2"]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize("case", SAME_RUN)
def test_the_same_run_writes_what_deepspeed_writes(case, tmp_path):
    run_distributed(_train, fx.WORLD, args=(case, str(tmp_path)))
    tol = {"exp_avg_sq": 3e-5, "exp_avg": 1e-6, "momentum_buffer": 1e-6,
           "single_partition_of_fp32_groups": 1e-5, "fp32_flat_groups": 1e-5}  # fmt: skip
    tol.update({n: 1e-5 for n in fx.model().state_dict()})  # the names, whatever the width
    tol.update({n: 1e-5 for n in ("weight", "bias", "lin.weight", "lin.bias", "norm.weight",
                                  "norm.bias")})  # a pipeline's layer files  # fmt: skip
    experts = [n for n in fx.moe_model()[0].state_dict() if "deepspeed_experts.0." in n]
    tol.update({n.replace(".0.", f".{e}.", 1): 1e-5 for n in experts for e in range(4)})
    tol.update({n: 1e-5 for n in fx.moe_model()[0].state_dict()})
    ours, theirs = tmp_path / "global_step3", os.path.join(fx.FIXTURES, case, "global_step3")
    assert folder_differences(str(ours), theirs, tol) == []


@pytest.mark.distributed
def test_zerostacks_zero_to_fp32_in_the_folder_gives_the_weights(tmp_path):
    run_distributed(_round_trip, fx.WORLD, args=("zero3", str(tmp_path / "ckpt")))
    done = subprocess.run(
        [sys.executable, str(tmp_path / "ckpt" / "zero_to_fp32.py"), str(tmp_path / "ckpt"),
         str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    got = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    from zerostack.checkpoint import full_state_dict

    want = full_state_dict(os.path.join(fx.FIXTURES, "zero3"))
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


def _refused(rank, world, cfg):
    try:
        deepspeed.initialize(model=fx.model(), config=cfg)
    except ConfigError as exc:
        return str(exc)


def _unwritable() -> dict:
    """A layout DeepSpeed's files are not written for (round-robin gradients reorder stage 2's
    partitions)."""
    cfg = fx.ds_config(2)
    cfg["zero_optimization"]["round_robin_gradients"] = True
    return cfg


@pytest.mark.distributed
def test_deepspeed_files_where_they_cannot_be_written_are_refused():
    cfg = _unwritable()
    cfg["checkpoint"] = {"deepspeed_files": True}
    got = run_distributed(_refused, 1, args=(cfg,))[0]
    assert got == ("checkpoint.deepspeed_files with zero_optimization.round_robin_gradients: "
                   "DeepSpeed's files are not written for it yet")  # fmt: skip


def _refused_pipe(rank, world, stage):
    cfg = fx.ds_config(**{**fx.CASES["pipe_zero1"], "stage": stage})
    cfg["checkpoint"] = {"deepspeed_files": True}
    try:
        deepspeed.initialize(model=fx.pipe_model(*fx.pipe_classes()), config=cfg)
    except ConfigError as exc:
        return str(exc)


@pytest.mark.distributed
def test_a_pipelines_files_are_written_at_zero_1_only():
    """DeepSpeed's pipeline engine runs ZeRO 0-1; its stage 0 files are not written yet."""
    got = run_distributed(_refused_pipe, 2, args=(0,))
    assert got == ["checkpoint.deepspeed_files with pp 2 at ZeRO stage 0 (a pipeline's files "
                   "at ZeRO-1 only): DeepSpeed's files are not written for it yet"] * 2  # fmt: skip


def _native(rank, world, out):
    engine, *_ = zerostack.initialize(model=fx.model(), config=fx.ds_config(2))
    engine.save_checkpoint(out)


@pytest.mark.distributed
def test_natively_only_zerostacks_files_unless_asked(tmp_path):
    run_distributed(_native, 1, args=(str(tmp_path),))
    assert glob.glob(str(tmp_path / "global_step0" / "*.pt")) == []
    assert not (tmp_path / "zero_to_fp32.py").exists()


ROUNDTRIP = json.load(open(os.path.join(ROOT, "tests", "golden", "deepspeed_roundtrip.json")))


def test_real_deepspeed_resumes_and_converts_zerostacks_folders():
    """The record scripts/deepspeed_roundtrip.py wrote in the peer environment (DeepSpeed 0.19.8,
    no zerostack): DeepSpeed's load_checkpoint on zerostack's folder continues exactly as
    zerostack continues from it (fp32), and within 1.2e-7 of DeepSpeed continuing from its own
    folder of the same run (the runs' states differ by the Adam arithmetic above; bf16 by the
    two engines' bf16 rounding, 1e-4 as tests/test_deepspeed_checkpoints.py allows); DeepSpeed's
    zero_to_fp32, the placed zero_to_fp32.py and Lightning's converter give zerostack's weights
    exactly, and Lightning's converter keeps the client state."""
    assert ROUNDTRIP["versions"]["deepspeed"] == "0.19.8"
    assert ROUNDTRIP["command"].startswith("DS_ACCELERATOR=cpu .peers/bin/python scripts/")
    assert set(ROUNDTRIP["cases"]) == set(WRITTEN)
    for case, got in ROUNDTRIP["cases"].items():
        bf16 = "bf16" in case
        assert got["first_loss_vs_zerostack"] == 0.0, case  # the loaded weights alone
        assert got["vs_zerostack_from_its_folder"] <= (1e-5 if bf16 else 1e-6), case
        tools = ("deepspeed_zero_to_fp32", "placed_zero_to_fp32_py", "lightning_converter")
        pipe, moe = bool(fx.CASES[case].get("pipe")), bool(fx.CASES[case].get("moe"))
        if fx.CASES[case]["stage"] == 0 or pipe or moe:
            # DeepSpeed's tools read ZeRO files with the whole module beside them, which no
            # stage 0, pipeline or MoE folder has, its own neither: they refuse zerostack's as
            # they refuse DeepSpeed's. From scratch the two engines' stage 0 runs differ in 16 bits:
            # DeepSpeed's FP16_Optimizer takes one step with zero gradients at its start (its
            # Adam's count is one ahead), and in fp16 DeepSpeed 0.19.8 divides the gradients
            # by a loss scale it never applied
            for tool in tools:
                assert got[tool].startswith("refused, as DeepSpeed's own folder"), (case, tool)
            if case not in ("zero0", "pipe_zero1", "moe_zero2"):
                continue
        # the pipeline's model (1,374 parameters, every update large) shows the two Adams'
        # arithmetic more: from scratch their losses after the save differ by 1.03e-6 too
        bound = 1e-4 if bf16 else 1.1e-6 if pipe else 1e-6
        assert got["vs_deepspeed_from_its_folder"] <= bound, case
        if fx.CASES[case]["stage"] > 0 and not (pipe or moe):
            for tool in tools:
                assert got[tool] == 0.0, (case, tool)
            assert got["lightning_client_state"] == {"epoch": 7}


def _asked(rank, world, out, native):
    cfg = fx.ds_config(2)
    cfg["checkpoint"] = {"deepspeed_files": True}
    init = zerostack.initialize if native else deepspeed.initialize
    net = fx.model()
    engine, *_ = init(model=net, model_parameters=list(net.parameters()), config=cfg)
    x = fx.tokens(0, rank, world)
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    engine.save_checkpoint(out)


@pytest.mark.distributed
def test_natively_by_the_config_choice_the_same_files_as_under_the_facade(tmp_path):
    run_distributed(_asked, fx.WORLD, args=(str(tmp_path / "native"), True))
    run_distributed(_asked, fx.WORLD, args=(str(tmp_path / "facade"), False))
    native, facade = tmp_path / "native" / "global_step1", tmp_path / "facade" / "global_step1"
    assert len(glob.glob(str(native / "*.pt"))) == 3
    assert folder_differences(str(native), str(facade)) == []


def _unwritable_saved(rank, world, out):
    import logging

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("zerostack").addHandler(handler)
    net = fx.model()
    engine, *_ = deepspeed.initialize(model=net, config=_unwritable())
    at_initialize = list(said)
    engine.save_checkpoint(out)
    engine.save_checkpoint(out, tag="again")
    return at_initialize, [m for m in said if m.startswith("checkpoint:")]


@pytest.mark.distributed
def test_under_the_facade_a_layout_without_deepspeeds_files_says_so_at_its_first_save(tmp_path):
    [(at_initialize, said)] = run_distributed(_unwritable_saved, 1, args=(str(tmp_path),))
    assert not any(m.startswith("checkpoint:") for m in at_initialize)
    assert said == [
        "checkpoint: the folder holds zerostack's files only, not DeepSpeed's "
        "(zero_optimization.round_robin_gradients: DeepSpeed's files are not written for it yet; "
        "set checkpoint.deepspeed_files false to silence this)"
    ]
    assert glob.glob(str(tmp_path / "global_step0" / "*.pt")) == []
