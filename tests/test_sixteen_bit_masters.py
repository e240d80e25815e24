"""16-bit master weights and optimizer states: DeepSpeed 0.19's
``bf16.bf16_master_weights_and_grads``, ``bf16.bf16_optimizer_states`` and
``fp16.fp16_master_weights_and_grads``.

The numerics are neither stochastic rounding nor Kahan-compensated updates: as DeepSpeed, each
step computes in fp32 from the 16-bit values and rounds the result to nearest. In memory the
masters are the 16-bit parameter pieces themselves (no copy), with the moments in bf16 (torch's
fused AdamW on the pieces); offloaded, the CPU Adam keeps fp32 moments (or bf16 ones with
``bf16_optimizer_states``) and rounds its fp32 step into the 16-bit master.

Held here: at dp 1, ZeRO 1-3 bit for bit one process's bf16 AdamW (the same arithmetic on
pieces as on whole tensors); at dp 2 within bf16's rounding of it; DeepSpeed's losses
(scripts/sixteen_bit_golden.py) to the last bit where its arithmetic is the same and within one
bf16 step of the loss where its CPU kernels round in another order (ZeRO-3 and the fp32-moment
offload: sums of squares of the weights 1e-5 to 1e-4 apart, a few weights one bf16 step apart);
each refusal DeepSpeed makes. Bytes per parameter are in test_memory.py, peak memory and the
loss over 300 steps beside fp32 masters in benchmarks/sixteen_bit_masters.py.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import zerostack
from zerostack.config import ConfigError
from zerostack.optim import CPUAdam

from tests.support.ranks import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import sixteen_bit_golden as golden  # noqa: E402

GOLDEN = json.load(open(os.path.join(ROOT, "tests", "golden", "sixteen_bit_masters.json")))
# DeepSpeed's CPU kernels round as torch's do in these: its losses to the last bit
SAME_ARITHMETIC = ("bf16_states_zero1", "bf16_states_zero2", "bf16_states_zero2_offload")


def _run(rank, world, name, config=None):
    config = config or golden.config(name)
    config["train_micro_batch_size_per_gpu"] = golden.MICRO // world
    engine, *_ = zerostack.initialize(model=golden.model(), config=config)
    per = golden.MICRO // world
    losses, weights = [], []
    for ids in golden.batches():
        loss = engine(ids[rank * per : (rank + 1) * per])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        weights.append({k: v.clone() for k, v in engine.full_state_dict().items()})
    master = engine.zero.masters()[0]
    kinds = {k: v.dtype for k, v in engine.optimizer.state[master].items() if v.dim() > 0}
    engine.destroy()
    return losses, weights, master.dtype, kinds


@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for n in golden.CASES if "fp32_masters" not in n])
def test_losses_are_deepspeeds(name):
    assert GOLDEN["deepspeed"] == "0.19.8"
    [(losses, weights, master, kinds)] = run_distributed(_run, 1, args=(name,))
    theirs = GOLDEN["cases"][name]["losses"]
    if name in SAME_ARITHMETIC:
        assert losses == theirs
    for a, b in zip(losses, theirs, strict=True):
        assert abs(a - b) <= 2**-7 * abs(b), (name, losses, theirs)  # one bf16 step of the loss
    assert master == torch.bfloat16
    states = torch.bfloat16 if "states" in name else torch.float32
    assert kinds == {"exp_avg": states, "exp_avg_sq": states}, kinds


def _reference(offloaded: bool) -> list[dict[str, torch.Tensor]]:
    """One process: the golden's model in bf16 and AdamW on its parameters (bf16 moments), or
    fp32 moments over an fp32 copy of each weight rounded to bf16 after every step (the CPU
    Adam's arithmetic); the weights after each step."""
    net = golden.model().to(torch.bfloat16)
    opts = golden.ADAMW["params"]
    kw = dict(lr=opts["lr"], betas=tuple(opts["betas"]), eps=opts["eps"],
              weight_decay=opts["weight_decay"], fused=True)  # fmt: skip
    wide = [torch.nn.Parameter(p.detach().float()) for p in net.parameters()]
    opt = torch.optim.AdamW(wide if offloaded else list(net.parameters()), **kw)
    out = []
    for ids in golden.batches():
        net(ids).backward()
        if offloaded:
            for w, p in zip(wide, net.parameters(), strict=True):
                w.grad = p.grad.float()
        opt.step()
        net.zero_grad(set_to_none=True)
        if offloaded:
            with torch.no_grad():
                for w, p in zip(wide, net.parameters(), strict=True):
                    p.copy_(w)
                    w.copy_(p)
        out.append({k: v.detach().clone() for k, v in net.named_parameters()})
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("offloaded", [False, True])
def test_at_dp1_each_step_is_one_process_bf16_adamw_bit_for_bit(stage, offloaded):
    bf16 = {"enabled": True, "bf16_master_weights_and_grads": True,
            "bf16_optimizer_states": not offloaded}  # fmt: skip
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offloaded:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {**golden.config("bf16_states_zero2"), "bf16": bf16, "zero_optimization": zero}
    [(_, weights, _, _)] = run_distributed(_run, 1, args=("", config))
    for step, (got, want) in enumerate(zip(weights, _reference(offloaded), strict=True)):
        for k, v in want.items():
            assert torch.equal(got[k], v), (stage, offloaded, step, k)


@pytest.mark.distributed
def test_at_dp2_the_pieces_step_as_one_process_within_bf16s_rounding():
    """Two ranks sum their halves' gradients in bf16 (another order than one process's
    backward): every weight within 2% of the reference's after 8 steps (a few bf16 steps). The
    attention's qkv bias is left out: its key third has a gradient that is zero in exact
    arithmetic (softmax ignores a shift shared by a query's scores), so Adam turns each order's
    round-off into whole +-lr steps (tests/support/models.py says the same of fp32)."""
    config = golden.config("bf16_states_zero2")
    ranks = run_distributed(_run, 2, args=("", config))
    want = _reference(False)[-1]
    for _, weights, _, _ in ranks:
        for k, v in want.items():
            if k == "qkv.bias":
                continue
            err = float((weights[-1][k].float() - v.float()).norm() / v.float().norm())
            assert err < 2e-2, (k, err)


def _refused(rank, world, config):
    try:
        zerostack.initialize(model=golden.model(), config=config)
    except ConfigError as e:
        return str(e)
    return None


REFUSALS = [
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
               "bf16_optimizer_states": True}, "zero_optimization": {"stage": 0}},
     "bf16.bf16_master_weights_and_grads at zero_optimization.stage 0: only ZeRO stages 1-3 "
     "keep masters"),
    ({"bf16": {"enabled": True, "bf16_optimizer_states": True},
      "zero_optimization": {"stage": 2}},
     "bf16.bf16_optimizer_states without bf16.bf16_master_weights_and_grads"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
      "zero_optimization": {"stage": 2}},
     "bf16.bf16_master_weights_and_grads without the optimizer offloaded to the CPU: fp32 "
     "moments beside 16-bit masters are the CPU Adam's (DeepSpeed's rule); set "
     'zero_optimization.offload_optimizer.device to "cpu" or bf16.bf16_optimizer_states'),
    ({"bf16": {"bf16_master_weights_and_grads": True}, "zero_optimization": {"stage": 2}},
     "bf16.bf16_master_weights_and_grads without bf16.enabled: the weights are not bf16"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True},
      "zero_optimization": {"stage": 2}},
     "fp16.fp16_master_weights_and_grads without the optimizer offloaded to the CPU: fp32 "
     "moments beside 16-bit masters are the CPU Adam's (DeepSpeed's rule); set "
     'zero_optimization.offload_optimizer.device to "cpu"'),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
      "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
     "bf16.bf16_master_weights_and_grads with the optimizer offloaded: only the config's Adam "
     "or AdamW (the CPU Adam)"),
    ({"checkpoint": {"deepspeed_files": True}},
     "checkpoint.deepspeed_files with 16-bit master weights (*_master_weights_and_grads): "
     "DeepSpeed's files are not written for it yet"),
]  # fmt: skip


@pytest.mark.distributed
def test_what_deepspeed_refuses_is_refused_naming_the_keys():
    for extra, message in REFUSALS:
        config = {**golden.config("bf16_states_zero2"), **extra}
        if "fp16" in extra:
            config.pop("bf16")
        [why] = run_distributed(_refused, 1, args=(config,))
        assert why == message, (extra, why)


def test_fp16_masters_step_on_the_cpu_adam_with_fp32_moments():
    """fp16 masters (offloaded, the only way DeepSpeed takes them): the CPU Adam's fp32 step
    rounded to fp16 (DeepSpeed refuses fp16 on this CPU, so there is no golden run)."""
    from zerostack.config import load_config
    from zerostack.core.precision import Precision

    cfg = load_config({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}})
    assert Precision.from_config(cfg).master_dtype == torch.float16
    assert Precision.from_config(cfg).accum_dtype(2) == torch.float16
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    p.grad = torch.full((3,), 0.5, dtype=torch.float16)
    opt = CPUAdam([p], lr=0.1)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    assert torch.equal(p.detach(), torch.full((3,), 0.9, dtype=torch.float16))


def _resume(rank, world, root, load_plain):
    """Six steps in one run; three, a save, a load into other weights and three more (into a
    run with fp32 masters when ``load_plain``): the last three losses of each, the weights at
    the end, and the loaded run's weights right after the load."""
    config = golden.config("bf16_states_zero2")
    config["train_micro_batch_size_per_gpu"] = golden.MICRO // world
    per, data = golden.MICRO // world, golden.batches()

    def steps(engine, first):
        out = []
        for ids in data[first : first + 3]:
            loss = engine(ids[rank * per : (rank + 1) * per])
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    whole, *_ = zerostack.initialize(model=golden.model(), config=config)
    steps(whole, 0)
    saved = whole.full_state_dict()
    uninterrupted = steps(whole, 3)
    first, *_ = zerostack.initialize(model=golden.model(), config=config)
    steps(first, 0)
    first.save_checkpoint(root)
    if load_plain:
        config = {**config, "bf16": {"enabled": True}}
    torch.manual_seed(5)
    second, *_ = zerostack.initialize(model=golden.TinyNet(golden.WIDTH, golden.VOCAB),
                                      config=config)  # fmt: skip
    second.load_checkpoint(root)
    loaded = second.full_state_dict()
    resumed = steps(second, 3)
    out = uninterrupted, resumed, saved, loaded, whole.full_state_dict(), second.full_state_dict()
    for engine in (whole, first, second):
        engine.destroy()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("load_plain", [False, True])
def test_a_checkpoint_resumes_exactly_and_loads_into_fp32_masters(load_plain, tmp_path):
    """The bf16 masters and moments are saved as they are and come back bit for bit; a run
    with fp32 masters loads them as their exact fp32 values (then steps on as its own)."""
    for uninterrupted, resumed, saved, loaded, end, got in run_distributed(
        _resume, 2, args=(str(tmp_path), load_plain)
    ):
        for k, v in saved.items():
            assert torch.equal(loaded[k], v), k
        if not load_plain:
            assert resumed == uninterrupted
            for k, v in end.items():
                assert torch.equal(got[k], v), k


def _offloaded_bytes(rank, world, states):
    config = golden.config("bf16_zero2_offload")
    config["bf16"] = {**config["bf16"], "bf16_optimizer_states": states}
    config["train_micro_batch_size_per_gpu"] = golden.MICRO // world
    engine, *_ = zerostack.initialize(model=golden.model(), config=config)
    per, ids = golden.MICRO // world, golden.batches()[0]
    engine.backward(engine(ids[rank * per : (rank + 1) * per]))
    engine.step()
    out = engine.memory_breakdown()
    engine.destroy()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("states", [False, True])
def test_offloaded_bytes_per_parameter_are_the_formula(states):
    """ZeRO 2 at dp 2, the optimizer in host memory: bf16 weights (2 psi), this rank's bf16
    gradient piece and master (2 psi / N each) and its moments, fp32 (8 psi / N) or bf16
    (4 psi / N). The tiny model's size divides evenly: no padding."""
    psi, n = sum(p.numel() for p in golden.model().parameters()), 2
    for got in run_distributed(_offloaded_bytes, n, args=(states,)):
        moments = 4 if states else 8
        want = {"params": 2 * psi, "grads": 2 * psi / n, "master": 2 * psi / n,
                "optimizer": moments * psi / n}  # fmt: skip
        assert {k: got[k] for k in want} == want, got


@pytest.mark.parametrize("name", ["bf16_states_zero2", "bf16_zero3_offload"])
def test_deepspeeds_own_script_runs_unmodified_on_zerostack(name):
    """scripts/sixteen_bit_golden.py's case, as DeepSpeed ran it, under ``python -m
    zerostack.as_deepspeed``: DeepSpeed's losses (as in :func:`test_losses_are_deepspeeds`)."""
    from tests.test_muon import as_deepspeed

    lines = as_deepspeed("sixteen_bit_golden.py", name)
    line = next(x for x in lines if x.startswith("FIGURES "))
    losses = json.loads(line[len("FIGURES ") :])["losses"]
    theirs = GOLDEN["cases"][name]["losses"]
    if name in SAME_ARITHMETIC:
        assert losses == theirs
    for a, b in zip(losses, theirs, strict=True):
        assert abs(a - b) <= 2**-7 * abs(b), (name, losses, theirs)
