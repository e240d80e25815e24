"""Hugging Face causal LMs (GPT-2 and Llama from small configs) trained by zerostack on real gloo
ranks, against single-process fp32 training of the same model (``hf_models.reference``).

Plain SGD, no clipping (see parity.py: a wrong constant factor in the gradient must show), three
steps of two micro-steps; per step, every parameter within 1e-5 relative of the reference and the
global gradient norm too (only the order of floating-point sums differs). Cases: ZeRO stages 0-3;
stage 3 with the model built inside ``zero.Init`` and with ``zero.Init(module=model)``, whose
weights must equal the plain model's bit for bit before training (the Hugging Face
initialisation runs on gathered parameters); tensor parallelism from the per-architecture table
(``tensor_parallel.autotp_size``) alone, with stage 3, and with dp. Also: DeepSpeed's ``ds_*``
attributes, ``save_16bit_model`` in both formats read back by torch and by ``from_pretrained``,
the consolidated state dict through ``save_pretrained``, a PEFT LoRA model at stage 3, and the
errors for an architecture without a policy and for a model already sharded.
"""

from __future__ import annotations

import os

import pytest
import torch

import zerostack
from zerostack import Topology
from zerostack.config import ConfigError
from zerostack.zero.stage3.params import is_sharded

from tests.support.hf import GAS, SGD_LR, STEPS, B, hf_model, reference, tokens
from tests.support.models import max_rel_diff
from tests.support.ranks import run_distributed

pytestmark = pytest.mark.distributed  # every test here starts ranks


def _config(stage: int, micro: int, tp: int = 1, **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": SGD_LR}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 4000,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 3000,
        },
        **extra,
    }
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    return cfg


def _build(arch: str, init: str):
    """The model as a user builds it: plain, inside zero.Init, or sharded by Init(module=)."""
    if init == "context":
        with zerostack.zero.Init():
            return hf_model(arch)
    model = hf_model(arch)
    if init == "module":
        zerostack.zero.Init(module=model)
    return model


def _gathered(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        with zerostack.zero.GatheredParameters(p):
            out[name] = p.detach().clone()
    return out


def _train(rank, world, arch, cases):
    results = []
    for case in cases:
        tp, init = case.get("tp", 1), case.get("init", "none")
        model = _build(arch, init)
        if init != "none":  # built as pieces: nothing whole but what is gathered
            assert all(is_sharded(p) and p.numel() == 0 for p in model.parameters()), init
        before = _gathered(model) if init != "none" else None
        engine, *_ = zerostack.initialize(
            model=model, config=_config(case["stage"], B // (world // tp), tp)
        )
        dp, per = engine.topology.dp, B // engine.topology.dp
        out = []
        for step in range(STEPS):
            x = tokens(step, B * GAS)
            for m in range(GAS):
                lo = m * B + engine.topology.dp_rank * per
                mb = x[lo : lo + per]
                engine.backward(engine(input_ids=mb, labels=mb).loss)
                engine.step()
            out.append((engine.full_state_dict(), engine.get_global_grad_norm()))
        assert dp * tp == world
        results.append((before, out))
        engine.destroy()
    return results


CASES = [
    {"stage": 0},
    {"stage": 1},
    {"stage": 2},
    {"stage": 3},
    {"stage": 3, "init": "context"},
    {"stage": 3, "init": "module"},
    {"stage": 1, "tp": 2},
    {"stage": 3, "tp": 2},
]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.slow
def test_hf_model_matches_single_process_training(arch):
    ref = reference(arch)
    initial = {k: v for k, v in hf_model(arch).named_parameters()}
    results = run_distributed(_train, 2, args=(arch, CASES), timeout=420)
    for rank_results in results:
        for case, (before, steps) in zip(CASES, rank_results, strict=True):
            if before is not None:  # zero.Init kept the Hugging Face initialisation exactly
                assert all(torch.equal(before[k], initial[k]) for k in initial), case
            for step, ((got, norm), (want, want_norm)) in enumerate(zip(steps, ref, strict=True)):
                diff, name = max_rel_diff(got, want)
                assert diff <= 1e-5, f"{case} step {step}: {name} off by {diff:.2e}"
                assert abs(norm - want_norm) <= 1e-5 * want_norm, f"{case} step {step}: norm"


def _tp_with_dp(rank, world):
    return _train(rank, world, "llama", [{"stage": 2, "tp": 2}])


@pytest.mark.slow
def test_hf_tensor_parallel_composes_with_data_parallel():
    ref = reference("llama")
    for rank_results in run_distributed(_tp_with_dp, 4, timeout=300):
        steps = rank_results[0][1]
        for step, ((got, norm), (want, want_norm)) in enumerate(zip(steps, ref, strict=True)):
            diff, name = max_rel_diff(got, want)
            assert diff <= 1e-5, f"tp2 x dp2, step {step}: {name} off by {diff:.2e}"
            assert abs(norm - want_norm) <= 1e-5 * want_norm


def _ds_attributes(rank, world):
    with zerostack.zero.Init():
        model = hf_model("gpt2")
    shapes = {n: tuple(p.ds_shape) for n, p in model.named_parameters()}
    ids = [p.ds_id for p in model.parameters()]
    p = model.transformer.h[0].attn.c_attn.weight
    seen = [p.ds_status, p.ds_numel, tuple(p.shape)]
    with zerostack.zero.GatheredParameters(p):
        seen += [p.ds_status, tuple(p.shape)]
    seen.append(p.ds_status)
    return shapes, ids, seen


def test_stage3_parameters_carry_deepspeeds_attributes():
    from zerostack.zero.stage3.params import ZeroParamStatus

    want = {n: tuple(p.shape) for n, p in hf_model("gpt2").named_parameters()}
    for shapes, ids, seen in run_distributed(_ds_attributes, 2):
        assert shapes == want
        assert len(set(ids)) == len(ids)
        assert seen == [
            ZeroParamStatus.NOT_AVAILABLE,
            32 * 96,
            (0,),
            ZeroParamStatus.AVAILABLE,
            (32, 96),
            ZeroParamStatus.NOT_AVAILABLE,
        ]


def _save(rank, world, root, tp):
    zero = {"stage3_gather_16bit_weights_on_model_save": True}
    config = _config(3, B // (world // tp), tp, bf16={"enabled": True})
    config["zero_optimization"].update(zero)
    if tp > 1:
        model = hf_model("gpt2")
    else:
        with zerostack.zero.Init():
            model = hf_model("gpt2")
    engine, *_ = zerostack.initialize(model=model, config=config)
    per = B // engine.topology.dp
    x = tokens(0, B)[engine.topology.dp_rank * per :][:per]
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.set_gradient_accumulation_boundary(True)
    engine.step()
    full = engine.full_state_dict()
    assert engine.save_16bit_model(root)  # DeepSpeed's default name: a torch state dict
    assert engine.save_16bit_model(root, "model.safetensors")
    sd = engine._zero3_consolidated_16bit_state_dict()
    if rank == 0:
        engine.module.config.save_pretrained(root)
        fresh = hf_model("gpt2")  # a plain model to save through (its own weights are ignored)
        fresh.save_pretrained(os.path.join(root, "pretrained"), state_dict=sd)
    return full, sd is None


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.slow
def test_16bit_model_files_load_in_torch_and_transformers(tp, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root = str(tmp_path)
    results = run_distributed(_save, 2, args=(root, tp), timeout=240)
    full = results[0][0]
    assert [none for _, none in results] == [False, True]  # the state dict is rank 0's
    keys = list(hf_model("gpt2").state_dict())
    bin_sd = torch.load(os.path.join(root, "pytorch_model.bin"), weights_only=True)
    st_sd = load_file(os.path.join(root, "model.safetensors"))
    for sd in (bin_sd, st_sd):
        assert sorted(sd) == sorted(keys)
        for k, t in sd.items():
            name = "transformer.wte.weight" if k == "lm_head.weight" else k
            assert t.dtype == torch.bfloat16 and torch.equal(t, full[name].bfloat16()), k
    for where, kwargs in [
        (root, {}),  # model.safetensors
        (root, {"use_safetensors": False}),  # pytorch_model.bin
        (os.path.join(root, "pretrained"), {}),  # save_pretrained(state_dict=consolidated)
    ]:
        loaded = AutoModelForCausalLM.from_pretrained(where, dtype=torch.bfloat16, **kwargs)
        for name, p in loaded.named_parameters():
            assert torch.equal(p.detach(), full[name].bfloat16()), (where, kwargs, name)


def _lora(rank, world, sharded):
    from peft import LoraConfig, get_peft_model

    model = _build("llama", "context" if sharded else "none")
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(model, lora)
    if world == 1:  # the reference: plain torch on the whole batch
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=SGD_LR)
        for step in range(STEPS):
            x = tokens(step, B * GAS)
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = zerostack.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=_config(3, B // world),
    )
    per = B // world
    for step in range(STEPS):
        x = tokens(step, B * GAS)
        for m in range(GAS):
            mb = x[m * B + rank * per :][:per]
            engine.backward(engine(input_ids=mb, labels=mb).loss)
            engine.step()
    return engine.full_state_dict()


@pytest.mark.slow
def test_peft_lora_model_trains_at_stage3():
    ref = run_distributed(_lora, 1, args=(False,))[0]
    trainable = [n for n in ref if "lora_" in n]
    assert len(trainable) == 2 * 2 * 2  # A and B, q and v, two layers
    for got in run_distributed(_lora, 2, args=(True,), timeout=240):
        diff, name = max_rel_diff(got, ref)
        assert diff <= 1e-5, f"{name} off by {diff:.2e}"
        assert not torch.equal(got[trainable[1]], torch.zeros_like(got[trainable[1]]))


def _unknown(rank, world):
    from transformers import AutoModelForCausalLM, BertConfig, BertForMaskedLM, GPT2Config

    bert = BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2))
    one_head = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=1))
    errors = []
    for model in (bert, one_head):
        try:
            zerostack.initialize(model=model, config=_config(1, 8, 2))
        except ConfigError as e:
            errors.append(str(e))
    with zerostack.zero.Init(topology=Topology.build()):
        sharded = hf_model("llama")
    try:
        zerostack.initialize(model=sharded, config=_config(3, 8, 2))
    except ConfigError as e:
        errors.append(str(e))
    return errors


@pytest.mark.slow
def test_autotp_refuses_what_it_cannot_split():
    errors = run_distributed(_unknown, 2)[0]
    assert errors[0] == (
        "tensor_parallel.autotp_size: no tensor-parallel policy for model_type 'bert'; known: "
        "gpt2, llama (or build the model from zerostack.tensor_parallel layers, or give it a "
        "parallelize(topology) method)"
    )
    assert errors[1] == (
        "tensor_parallel.autotp_size: gpt2 config.n_head = 1 does not split into 2 tp ranks"
    )
    assert errors[2].startswith(
        "tensor_parallel.autotp_size: the model's parameters are already stage-3 pieces"
    )
    assert len(errors) == 3


@pytest.mark.parametrize("argv", [["--arch", "llama"], ["--arch", "gpt2", "--tp", "2"]])
@pytest.mark.slow
def test_example_trains_saves_and_reloads(argv, tmp_path):
    """examples/hf_causal_lm.py under torchrun: trains, writes model.safetensors + config.json,
    and from_pretrained's model gives the engine's validation loss (both compute in bf16 from
    the same bf16 weights; the files' exact contents are checked above)."""
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [os.path.join(root, "examples", "hf_causal_lm.py"), "--steps", "3"]
    cmd += ["--deepspeed_config", os.path.join(root, "examples", "ds_config_hf.json")]
    cmd += ["--out", str(tmp_path), *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 3: loss" in proc.stdout
    found = re.search(r"validation loss: engine (\S+), from_pretrained\(.*\) (\S+)", proc.stdout)
    assert found, proc.stdout
    engine_loss, reloaded = float(found.group(1)), float(found.group(2))
    assert abs(engine_loss - reloaded) <= 1e-3 * engine_loss
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def _draws_under_no_init(rank, world):
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from tests.support.hf import hf_config

    torch.manual_seed(42)
    want = torch.rand(2)
    torch.manual_seed(42)
    with no_init_weights(), zerostack.zero.Init(topology=Topology.build()):
        # as from_pretrained builds it: the weights are loaded next, not drawn
        AutoModelForCausalLM.from_config(hf_config("llama"))
    return torch.equal(torch.rand(2), want)


def test_zero_init_draws_nothing_where_transformers_switched_initialisation_off():
    """``from_pretrained`` under ZeRO-3 enters ``no_init_weights`` and then ``zero.Init``: no
    random number may be drawn, or what the script draws next (a LoRA's initial weights)
    differs from DeepSpeed's and from a plain run (TRL's SFT with PEFT once did)."""
    assert run_distributed(_draws_under_no_init, 2) == [True, True]
