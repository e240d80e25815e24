"""The config's ``"optimizer": {"type": "Muon"}`` trains as DeepSpeed 0.19.8's does: the same
tiny model, config and batches as scripts/muon_golden.py ran under real DeepSpeed (its losses
in tests/golden/muon.json), at ZeRO 0-3, under zero.Init and offloaded, on one rank and on dp 2,
within 1e-5 relative at every step. The sharded update against one process's Muon on the whole
matrices is in test_parity.py (families ``muon-*``), every step, per tensor.

Where zerostack is not DeepSpeed, on purpose:

- ``gradient_clipping`` clips the gradients (their norm is the one reported), as
  ``clip_grad_norm_`` before a single process's Muon does; DeepSpeed's ZeRO-1/2 orthogonalise
  while they partition the gradients and clip, and report, the orthogonalised updates.
- ``ns_method: "standard"`` runs DeepSpeed's bf16 iteration as torch runs it eagerly;
  DeepSpeed compiles it, and inductor's fused bf16 arithmetic moves the losses of the golden
  case by 8e-5 relative (its eager run, also recorded, is ours to the bit).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import zerostack
from zerostack.config import ConfigError, load_config
from zerostack.config.optim import MuonParams
from zerostack.optim import Muon
from zerostack.optim.muon import _gram, _standard, muon_groups, orthogonalize

from tests.support.ranks import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import muon_golden as golden  # noqa: E402

GOLDEN = json.load(open(os.path.join(ROOT, "tests", "golden", "muon.json")))
TOL = 1e-5
# DeepSpeed's compiled bf16 iteration (see the module) and its clipping of the updates
NOT_OURS = ("zero2_standard", "zero1_clipped")


def _model(name: str, config: dict):
    if name.endswith("_init"):
        with zerostack.zero.Init(config_dict_or_path=config):
            return golden.model()
    return golden.model()


def _losses(rank, world, name):
    config = golden.config(name)
    config["train_micro_batch_size_per_gpu"] = golden.MICRO // world
    net = _model(name, config)
    engine, *_ = zerostack.initialize(model=net, config=config)
    per = golden.MICRO // world
    losses = []
    for ids in golden.batches():
        loss = engine(ids[rank * per : (rank + 1) * per])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    muon = sorted(n for n, p in net.named_parameters() if p.use_muon)
    kind = type(engine.optimizer).__name__
    engine.destroy()
    return losses, muon, kind


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", [n for n in golden.CASES if n not in NOT_OURS])
def test_losses_and_muon_parameters_are_deepspeeds(name, world):
    assert GOLDEN["deepspeed"] == "0.19.8"
    results = run_distributed(_losses, world, args=(name,))
    ours = [sum(r[0][step] for r in results) / world for step in range(golden.STEPS)]
    theirs = GOLDEN["cases"][name]
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert abs(a - b) <= TOL * abs(b), (name, step, ours, theirs)
    for _, muon, kind in results:
        assert muon == GOLDEN["use_muon"][name]  # the embedding and the biases take Adam
        assert kind == "Muon"


def _clipped_reference() -> list[float]:
    """One process: the golden's model and batches, DeepSpeed's two halves, the gradients
    clipped to the config's norm before each step."""
    config = golden.config("zero1_clipped")
    net = golden.model()
    params = MuonParams(**config["optimizer"]["params"])
    opt = Muon(muon_groups(net, [{"params": list(net.parameters())}], params))
    losses = []
    for ids in golden.batches():
        loss = net(ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), config["gradient_clipping"])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
def test_clipping_clips_the_gradients_where_deepspeed_clips_the_updates(world):
    results = run_distributed(_losses, world, args=("zero1_clipped",))
    ours = [sum(r[0][step] for r in results) / world for step in range(golden.STEPS)]
    want = _clipped_reference()
    for a, b in zip(ours, want, strict=True):
        assert abs(a - b) <= TOL * abs(b), (ours, want)
    theirs, unclipped = GOLDEN["cases"]["zero1_clipped"], GOLDEN["cases"]["zero1"]
    assert max(abs(a - b) for a, b in zip(theirs, unclipped, strict=True)) > 1e-2  # it clips
    assert max(abs(a - b) for a, b in zip(theirs, ours, strict=True)) > 1e-3  # another way


def test_the_standard_method_is_deepspeeds_eager_iteration():
    """The recorded figures behind the module's note: DeepSpeed's compiled and eager runs of
    the standard (bf16) method differ; the eager one is checked against ours above."""
    compiled, eager = GOLDEN["cases"]["zero2_standard"], GOLDEN["cases"]["zero2_standard_eager"]
    gap = max(abs(a - b) / abs(b) for a, b in zip(compiled, eager, strict=True))
    assert 1e-5 < gap < 1e-3, gap


def test_defaults_are_deepspeeds():
    """MuonWithAuxAdam's group defaults (recorded from DeepSpeed) are MuonParams' and the
    groups' when the config names none of them."""
    net = golden.model()
    groups = muon_groups(net, [{"params": list(net.parameters())}], MuonParams())
    for group in groups:
        half = GOLDEN["defaults"]["muon" if group["use_muon"] else "adam"]
        got = {k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if k in half}
        assert got == half, (got, half)
    assert [g["name"] for g in groups] == ["muon-params", "adam-params"]


def test_each_half_takes_its_own_rate_and_a_groups_own_settings_win():
    net = golden.model()
    decay = [p for n, p in net.named_parameters() if n.endswith(".weight")]
    rest = [p for n, p in net.named_parameters() if not n.endswith(".weight")]
    raw = [{"params": decay}, {"params": rest, "weight_decay": 0.0, "momentum": 0.5}]
    params = MuonParams(lr=0.1, adam_lr=0.003, weight_decay=0.01, betas=(0.8, 0.9))
    groups = muon_groups(net, raw, params)
    got = [(g["name"], g["lr"], g["weight_decay"]) for g in groups]
    assert got == [
        ("group0-muon-params", 0.1, 0.01),
        ("group0-adam-params", 0.003, 0.01),  # the embedding
        ("group1-adam-params", 0.003, 0.0),  # the biases and norms: no Muon half
    ]
    assert groups[1]["betas"] == (0.8, 0.9) and "momentum" not in groups[2]


def test_gram_newton_schulz_is_the_standard_iteration_rearranged():
    """In float64 the Gram form (the polynomial folded into ``q``, a restart) and the
    quintic iteration agree to rounding, wide and tall; the result's singular values lie in the
    band the quintic's coefficients aim at (about 0.7 to 1.2), scaled by sqrt(rows / cols)."""
    g = torch.Generator().manual_seed(0)
    for rows, cols in ((8, 24), (24, 8), (16, 16)):
        u = torch.randn(rows, cols, generator=g, dtype=torch.float64)
        x = u.mT if rows > cols else u
        x = x / x.norm()
        a, b = _gram(x.clone(), 5), _standard(x.clone(), 5)
        assert torch.allclose(a, b, rtol=0, atol=1e-12), (rows, cols)
        s = torch.linalg.svdvals(orthogonalize(u.float()).double())
        scale = (rows / cols) ** 0.5 if rows > cols else 1.0
        assert 0.6 * scale < s.min() and s.max() < 1.25 * scale, (rows, cols, s)


def test_a_tensor_that_is_no_matrix_in_a_muon_group_is_refused():
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    with pytest.raises(ValueError, match=r"Muon: a tensor of shape \(4,\) in a use_muon group"):
        Muon([{"params": [p], "use_muon": True}]).step()
    with pytest.raises(ValueError, match="no 'use_muon' entry"):
        Muon([{"params": [p]}])


def test_per_head_muon_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="per_head_muon: not supported yet"):
        load_config({"optimizer": {"type": "Muon", "params": {"per_head_muon": True}}})


def _refused(rank, world, config, ep=1):
    from zerostack.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, d_model=16, bias=False)
    if ep > 1:
        cfg = GPTConfig(**{**cfg.__dict__, "moe_every": 2, "num_experts": 2, "moe_ep_size": ep})
    try:
        zerostack.initialize(model=GPT(cfg), config=config)
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.distributed
def test_layouts_not_served_yet_are_refused_at_initialize(tmp_path):
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Muon"}}
    nvme = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}
    [why] = run_distributed(_refused, 1, args=({**base, "zero_optimization": nvme},))
    assert why == (
        "optimizer.type Muon with offload_param on NVMe: pieces read from files are not put "
        "together whole for Newton-Schulz yet"
    )
    files = {**base, "checkpoint": {"deepspeed_files": True}}
    [why] = run_distributed(_refused, 1, args=(files,))
    assert why == (
        "checkpoint.deepspeed_files with optimizer.type Muon (its halves keep different "
        "moments): DeepSpeed's files are not written for it yet"
    )
    for why in run_distributed(_refused, 2, args=(base, 2)):
        assert why == (
            "optimizer.type Muon with expert parallelism (ep 2): experts are not put together "
            "whole for Newton-Schulz yet"
        )


def _resume(rank, world, stage, root):
    """tests/support/models.py's resume_pair with Muon's config."""
    from tests.support.models import resume_pair

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    return resume_pair(rank, world, config, root)


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 3])
def test_a_checkpoint_resumes_exactly(stage, tmp_path):
    """Muon's momentum and the Adam half's moments and step are saved and come back: the
    resumed run equals the uninterrupted one bit for bit."""
    for uninterrupted, resumed, want, got in run_distributed(
        _resume, 2, args=(stage, str(tmp_path))
    ):
        assert resumed == uninterrupted
        kinds = {k.split("/")[1] for k in want if k.startswith("master")}
        assert kinds >= {"momentum_buffer", "exp_avg", "exp_avg_sq"}, kinds
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k


class _Odd(torch.nn.Module):
    """Matrices whose sizes no piece width divides (7x13, 13x5, 5x11): every cut runs into
    padding, and at dp 2 each matrix is cut mid-row."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b = torch.nn.Linear(7, 13), torch.nn.Linear(13, 5)
        self.c = torch.nn.Linear(5, 11, bias=False)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).square().mean()


ODD_STEPS = 3


def _odd_batch(step: int) -> torch.Tensor:
    return torch.randn(4, 7, generator=torch.Generator().manual_seed(50 + step))


def _odd(rank, world, stage):
    config = {
        "train_micro_batch_size_per_gpu": 4 // world,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "Muon", "params": {"muon_lr": 0.05, "adam_lr": 0.01,
                                                 "momentum": 0.9, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              "reduce_bucket_size": 100},
    }  # fmt: skip
    engine, *_ = zerostack.initialize(model=_Odd(), config=config)
    per = 4 // world
    for step in range(ODD_STEPS):
        x = _odd_batch(step)[rank * per : (rank + 1) * per]
        engine.backward(engine(x))
        engine.step()
    out = engine.full_state_dict()
    engine.destroy()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_matrices_cut_mid_row_into_padded_pieces_match_one_process(stage):
    net = _Odd()
    params = MuonParams(muon_lr=0.05, adam_lr=0.01, momentum=0.9, weight_decay=0.1)
    opt = Muon(muon_groups(net, [{"params": list(net.parameters())}], params))
    for step in range(ODD_STEPS):
        net(_odd_batch(step)).backward()
        opt.step()
        opt.zero_grad()
    want = {k: v.detach() for k, v in net.state_dict().items()}
    for got in run_distributed(_odd, 2, args=(stage,)):
        for k, v in want.items():
            err = float((got[k] - v).norm() / v.norm())
            assert err <= TOL, (stage, k, err)


def _reshard(rank, world, root, save_stage, load_stage):
    """At dp 2: three steps and a save; at ``world`` (this call's): the load, three steps.
    Returns the losses after the load."""
    from tests.support.models import batch, tiny_gpt

    def config(stage, micro):
        return {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 1e-3}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }

    per = 4 // world
    engine, *_ = zerostack.initialize(
        model=tiny_gpt(seed=7 if save_stage is None else 0),
        config=config(load_stage if save_stage is None else save_stage, per),
    )
    first = 0
    if save_stage is None:
        engine.load_checkpoint(root)
        first = 3
    losses = []
    for step in range(first, first + 3 if save_stage is None else 6):
        x, y = batch(step, 4)
        loss = engine(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if save_stage is not None and step == 2:
            engine.save_checkpoint(root)
    engine.destroy()
    return losses


@pytest.mark.distributed
@pytest.mark.parametrize("save_stage,load_stage", [(1, 3), (3, 0)])
def test_the_momentum_reshards_onto_another_layout(save_stage, load_stage, tmp_path):
    """Saved at dp 2 (six steps, the save after three), loaded at dp 1 on another stage: its
    three steps after the load are the dp-2 run's last three, within 1e-5 (the layouts only
    sum in other orders)."""
    runs = run_distributed(_reshard, 2, args=(str(tmp_path), save_stage, None))
    want = [sum(r[step] for r in runs) / 2 for step in range(3, 6)]
    [got] = run_distributed(_reshard, 1, args=(str(tmp_path), None, load_stage))
    for a, b in zip(got, want, strict=True):
        assert abs(a - b) <= TOL * abs(b), (got, want)


def as_deepspeed(script: str, case: str) -> list[str]:
    """DeepSpeed's golden script ``scripts/<script>`` itself, unmodified, run on zerostack as
    ``python -m zerostack.as_deepspeed <script> --case <case>`` (one rank, in a process of its
    own: the script sets its own rendezvous variables): its stdout lines."""
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(ROOT, "scripts")}
    argv = ["-m", "zerostack.as_deepspeed", os.path.join(ROOT, "scripts", script), "--case", case]
    run = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines()


@pytest.mark.parametrize("name", ["zero1", "zero3_init"])
def test_deepspeeds_own_script_runs_unmodified_on_zerostack(name):
    """scripts/muon_golden.py's case, as DeepSpeed ran it (``import deepspeed``, zero.Init,
    ``param.use_muon``), under ``python -m zerostack.as_deepspeed``: DeepSpeed's losses."""
    lines = as_deepspeed("muon_golden.py", name)
    losses = json.loads(next(x for x in lines if x.startswith("LOSSES "))[len("LOSSES ") :])
    muon = json.loads(next(x for x in lines if x.startswith("MUON "))[len("MUON ") :])
    theirs = GOLDEN["cases"][name]
    for a, b in zip(losses, theirs, strict=True):
        assert abs(a - b) <= TOL * abs(b), (losses, theirs)
    assert muon == GOLDEN["use_muon"][name]
