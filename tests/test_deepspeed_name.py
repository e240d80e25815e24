"""``zerostack.compat.deepspeed``: DeepSpeed's module tree served by zerostack, its ``install()``
(the ``deepspeed`` name and distribution), the runner ``python -m zerostack.as_deepspeed``, and
the modules' own behaviour (``zero_to_fp32`` against the engine's weights, ``FusedAdam`` against
torch's Adam, ...).

``install()`` changes the interpreter for good (``sys.meta_path``), so everything that installs
runs in a fresh ``python`` process.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import zerostack
import zerostack.compat.deepspeed as ds

from tests.support.models import batch, tiny_gpt
from tests.support.ranks import run_distributed

VERSION = f"0.19.8+zerostack.{zerostack.__version__}"


def _with_path(folder) -> dict:
    """The environment with ``folder`` first on PYTHONPATH, the rest kept (the mutation gate
    puts its planted copy of zerostack there)."""
    rest = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), rest]))}


def _python(code: str, *args: str, env: dict | None = None, runner: bool = False, cwd=None):
    """Run ``code`` (a script) in a fresh interpreter, under the runner when ``runner``."""
    script = os.path.join(cwd, "script.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent(code))
    cmd = [sys.executable, *(["-m", "zerostack.as_deepspeed"] if runner else []), script, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


SEEN_BY_THE_LIBRARIES = """
    import importlib.metadata, importlib.util, json, sys
    assert __name__ == "__main__"
    out = {"argv": sys.argv[1:]}
    # what the libraries check, before they import anything of it
    out["find_spec"] = importlib.util.find_spec("deepspeed") is not None
    out["version"] = importlib.metadata.version("deepspeed")
    out["metadata_name"] = importlib.metadata.metadata("deepspeed")["Name"]
    import deepspeed
    import transformers.integrations.deepspeed as hf
    from accelerate.utils import is_deepspeed_available
    from accelerate.utils.versions import compare_versions
    from lightning_utilities.core.imports import RequirementCache
    out["transformers"] = hf.is_deepspeed_available()
    out["accelerate"] = is_deepspeed_available() and compare_versions("deepspeed", ">=", "0.18.2")
    out["lightning"] = bool(RequirementCache("deepspeed>=0.16.0"))
    # the paths they import: the same objects as zerostack's
    import zerostack, zerostack.moe.layer
    from deepspeed import DeepSpeedEngine, comm
    from deepspeed.moe.layer import MoE
    from deepspeed.runtime.zero import partition_parameters as pp
    from deepspeed.runtime.engine import DeepSpeedEngine as Engine2
    from deepspeed.utils.logging import logger
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    out["same"] = [
        Engine2 is DeepSpeedEngine, issubclass(DeepSpeedEngine, zerostack.Engine),
        deepspeed.zero is zerostack.zero, comm is zerostack.comm,
        MoE is zerostack.moe.layer.MoE, pp.Init is zerostack.zero.Init,
    ]
    out["logger"] = logger.name
    try:
        import deepspeed.autotuning
    except ModuleNotFoundError as exc:
        out["missing"] = str(exc)
    # every deepspeed.* module is one of zerostack's
    out["foreign"] = sorted(
        name for name, m in sys.modules.items()
        if name.split(".")[0] == "deepspeed" and not m.__name__.startswith("zerostack")
    )
    out["deepspeed_modules"] = sum(name.split(".")[0] == "deepspeed" for name in sys.modules)
    print("OUT " + json.dumps(out))
"""


def _out(done) -> dict:
    lines = [x[4:] for x in done.stdout.splitlines() if x.startswith("OUT ")]
    assert done.returncode == 0 and lines, done.stdout + done.stderr
    return json.loads(lines[0])


def test_the_runner_serves_deepspeed_to_the_libraries_and_nothing_else(tmp_path):
    out = _out(_python(SEEN_BY_THE_LIBRARIES, "a", "--b", "c", runner=True, cwd=tmp_path))
    assert out["argv"] == ["a", "--b", "c"]  # the script's own arguments, as python script.py
    assert out["find_spec"] and out["version"] == VERSION and out["metadata_name"] == "deepspeed"
    assert out["transformers"] and out["accelerate"] and out["lightning"]
    assert all(out["same"]), out["same"]
    assert out["logger"] == "zerostack"
    assert out["missing"].startswith("No module named 'deepspeed.autotuning': zerostack serves")
    assert out["foreign"] == [] and out["deepspeed_modules"] > 5


def test_install_in_the_script_itself(tmp_path):
    code = "import zerostack.compat.deepspeed as z\nz.install()\nz.install()\n"
    code += textwrap.dedent(SEEN_BY_THE_LIBRARIES)
    out = _out(_python(code, cwd=tmp_path))
    assert out["version"] == VERSION and out["transformers"] and out["foreign"] == []


def test_without_install_there_is_no_deepspeed(tmp_path):
    done = _python(
        """
        import importlib.util, zerostack.compat.deepspeed
        assert importlib.util.find_spec("deepspeed") is None
        print("OUT {}")
        """,
        cwd=tmp_path,
    )
    assert _out(done) == {}


def test_install_after_the_libraries_is_refused(tmp_path):
    done = _python(
        """
        import accelerate, transformers
        import zerostack.compat.deepspeed
        zerostack.compat.deepspeed.install()
        """,
        cwd=tmp_path,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "zerostack.compat.serve.ServeError: install() must run before accelerate, transformers "
        "is imported: they decide whether DeepSpeed is installed when they are imported; call it "
        "first, or run the script with python -m zerostack.as_deepspeed"
    )


@pytest.mark.parametrize("kind", ["distribution", "package"])
def test_a_real_deepspeed_is_never_shadowed(tmp_path, kind):
    site = tmp_path / "site"
    if kind == "distribution":  # installed: its metadata is there
        (site / "deepspeed-0.19.8.dist-info").mkdir(parents=True)
        (site / "deepspeed-0.19.8.dist-info" / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8\n"
        )
        where = f"{site} (version 0.19.8)"
    else:  # a checkout on the path, no metadata
        (site / "deepspeed").mkdir(parents=True)
        (site / "deepspeed" / "__init__.py").write_text("")
        where = str(site / "deepspeed" / "__init__.py")
    done = _python("print('never')", env=_with_path(site), runner=True, cwd=tmp_path)
    assert done.returncode == 1 and "never" not in done.stdout
    assert done.stderr.strip().splitlines()[-1] == (
        f"zerostack.compat.serve.ServeError: deepspeed is installed in this environment "
        f"({where}): zerostack will not shadow it; uninstall it or use another environment to "
        f"run on zerostack"
    )


def test_runner_usage_and_modules(tmp_path):
    run = [sys.executable, "-m", "zerostack.as_deepspeed"]
    none = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert none.returncode == 2 and none.stderr.startswith("usage: python -m zerostack.as_")
    missing = subprocess.run([*run, "nope.py"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and missing.stderr.startswith("zerostack.as_deepspeed: nope.py")
    (tmp_path / "mod_to_run.py").write_text(
        "import sys, deepspeed\nprint('RAN', __name__, sys.argv[1:], deepspeed.__version__)\n"
    )
    env = {**os.environ, **_with_path(tmp_path)}
    done = subprocess.run(
        [*run, "-m", "mod_to_run", "x"], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"RAN __main__ ['x'] {VERSION}"
    failing = _python("raise SystemExit(3)", runner=True, cwd=tmp_path)
    assert failing.returncode == 3


# ------------------------------------------------------------------ the modules themselves
def test_fused_adam_is_torch_adam_with_deepspeeds_arguments():
    torch.manual_seed(0)
    for adam_w_mode, torch_cls in ((True, torch.optim.AdamW), (False, torch.optim.Adam)):
        a, b = torch.randn(5, 3, requires_grad=True), None
        b = a.detach().clone().requires_grad_(True)
        ours = ds.ops.adam.FusedAdam([a], lr=0.1, weight_decay=0.5, adam_w_mode=adam_w_mode)
        theirs = torch_cls([b], lr=0.1, weight_decay=0.5)
        for step in range(3):
            g = torch.randn(5, 3, generator=torch.Generator().manual_seed(step))
            a.grad, b.grad = g.clone(), g.clone()
            ours.step()
            theirs.step()
        assert torch.equal(a, b), adam_w_mode
    with pytest.raises(ValueError, match="bias_correction=False"):
        ds.ops.adam.FusedAdam([a], bias_correction=False)
    assert ds.ops.adam.DeepSpeedCPUAdam is zerostack.optim.CPUAdam


def test_small_modules():
    base = torch.arange(10.0)
    item = {"a": [base[2:4], (base[:1], 3)], "b": "x"}
    cloned = ds.checkpoint.utils.clone_tensors_for_torch_save(item)
    assert torch.equal(cloned["a"][0], base[2:4]) and cloned["a"][1][1] == 3
    assert cloned["a"][0].untyped_storage().nbytes() == 8  # its own storage, not the base's
    assert isinstance(cloned["a"][1], tuple) and cloned["b"] == "x"

    acc = ds.accelerator.get_accelerator()
    assert acc is ds.accelerator.get_accelerator()
    assert (acc.device_name(), acc.current_device_name()) == ("cpu", "cpu")
    assert acc.communication_backend_name() == "gloo" and acc.device(0) == torch.device("cpu")

    pp = ds.runtime.zero.partition_parameters
    assert pp.zero_wrapper_for_fp_tensor_constructor(torch.arange, torch.half) is torch.arange
    assert pp._orig_torch_arange is torch.arange

    schedules = ds.runtime.lr_schedules.VALID_LR_SCHEDULES
    assert schedules == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    model = torch.nn.Linear(2, 2)
    tp2 = {"tensor_parallel": {"autotp_size": 2}}
    assert ds.tp_model_init(model, 2, torch.float32, tp2) is model
    with pytest.raises(zerostack.ConfigError, match=r"tp_model_init\(tp_size=2\)"):
        ds.tp_model_init(model, 2, torch.float32, config={})
    ds.utils.groups._set_grid(None)  # no engine yet: DeepSpeed's answers without an mpu
    assert ds.utils.groups._get_sequence_parallel_world_size() == 1
    assert ds.utils.groups._get_sequence_parallel_rank() == 0
    with pytest.raises(KeyError, match="No sequence parallel group found"):
        ds.utils.groups._get_sequence_parallel_group()
    assert not issubclass(torch.optim.AdamW, ds.runtime.base_optimizer.DeepSpeedOptimizer)


def test_log_dist_logs_on_the_ranks_named(caplog):
    with caplog.at_level(logging.INFO, logger="zerostack"):
        ds.utils.log_dist("to rank 0")
        ds.utils.log_dist("to rank 1", ranks=[1])
        ds.utils.log_dist("to all", ranks=[-1])
    assert [r.getMessage() for r in caplog.records] == ["[Rank 0] to rank 0", "[Rank 0] to all"]


# ------------------------------------------------------------------------------ zero_to_fp32
def _trained_checkpoint(rank, world, root, frozen):
    model = tiny_gpt()
    model.get_parameter(frozen).requires_grad_(False)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerostack.initialize(model=model, config=config)
    for step in range(2):
        x, y = batch(step, 2 * world)
        engine.backward(engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
        engine.step()
    engine.save_checkpoint(root)
    full = engine.full_state_dict()
    engine.destroy()
    return full


@pytest.mark.distributed
def test_zero_to_fp32_gives_the_engines_weights(tmp_path):
    from safetensors.torch import load_file

    z = ds.utils.zero_to_fp32
    frozen = "blocks.0.ln1.weight"
    root = str(tmp_path / "ckpt")
    full = run_distributed(_trained_checkpoint, 2, args=(root, frozen))[0]
    state = z.get_fp32_state_dict_from_zero_checkpoint(root)
    assert set(state) == set(full) | {"head.weight"}  # the tied head under its own name too
    assert all(torch.equal(state[k], v) for k, v in full.items())
    assert all(v.dtype == torch.float32 for v in state.values())
    assert state["head.weight"] is state["wte.weight"]
    lazy = z.get_fp32_state_dict_from_zero_checkpoint(root, lazy_mode=True)
    assert all(torch.equal(v.contiguous(), state[k]) for k, v in lazy.items())
    unfrozen = z.get_fp32_state_dict_from_zero_checkpoint(root, exclude_frozen_parameters=True)
    assert set(unfrozen) == set(state) - {frozen}

    model = z.load_state_dict_from_zero_checkpoint(tiny_gpt(seed=5), root)
    assert all(torch.equal(p.detach(), full[n]) for n, p in model.named_parameters())

    # files: one safetensors, then torch.save shards under an index (5 KB: several shards)
    z.convert_zero_checkpoint_to_fp32_state_dict(root, tmp_path / "st", safe_serialization=True)
    one = load_file(tmp_path / "st" / "model.safetensors")
    assert set(one) == set(state) and all(torch.equal(one[k], v) for k, v in state.items())
    z.convert_zero_checkpoint_to_fp32_state_dict(root, tmp_path / "bin", max_shard_size="5KB")
    index = json.loads((tmp_path / "bin" / "pytorch_model.bin.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"pytorch_model-00001-of-{len(files):05d}.bin"
    joined = {}
    for f in files:
        joined.update(torch.load(tmp_path / "bin" / f, weights_only=True))
    assert set(joined) == set(state) and all(torch.equal(joined[k], v) for k, v in state.items())
    assert sorted(os.listdir(tmp_path / "bin")) == sorted([*files, "pytorch_model.bin.index.json"])


@pytest.mark.parametrize("end, code, torn_down", [("", 0, True), ("sys.exit(0)", 0, True),
                                                   ("sys.exit(3)", 3, False)])  # fmt: skip
def test_the_runner_tears_the_groups_down_when_the_script_ends_well(tmp_path, end, code, torn_down):
    """DeepSpeed-style scripts end without ``destroy``: the runner tears the process groups down
    (``zerostack.shutdown``) when the script ends without error, not on a failure."""
    done = _python(
        f"""
        import atexit, sys
        import torch.distributed as dist
        import deepspeed
        deepspeed.init_distributed()
        atexit.register(lambda: print("AT EXIT", dist.is_initialized()))
        {end}
        """,
        runner=True,
        cwd=tmp_path,
    )
    assert done.returncode == code, done.stderr
    assert done.stdout.strip() == f"AT EXIT {not torn_down}"
