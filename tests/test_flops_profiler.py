"""zerostack.profiling: DeepSpeed's flops profiler over FlopCounterMode, Narayanan's count, MFU.

Single process, no process group, the tiny reference GPT; the whole file runs in a few seconds.
"""

from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from zerostack.models import GPT, GPTConfig
from zerostack.profiling import (
    FlopsProfiler,
    get_model_profile,
    model_flops_utilization,
    transformer_flops,
)
from zerostack.profiling.flops_profiler import (
    duration_to_string,
    flop_formulas,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)
from zerostack.zero.stage3.params import ShardState, is_sharded

CFG = GPTConfig(n_layer=2, d_model=64, n_head=4, block_size=32, vocab_size=256)
B, S, L, H, V = 2, CFG.block_size, CFG.n_layer, CFG.d_model, CFG.vocab_size
LAYER_FWD = 24 * B * S * H * H + 4 * B * S * S * H  # Narayanan: one layer's forward
LOGITS_FWD = 2 * B * S * H * V
FWD = L * LAYER_FWD + LOGITS_FWD  # 15,728,640


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**CFG.__dict__, **kw}))


def _idx() -> torch.Tensor:
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(0))


def _rows(out: str) -> dict[str, str]:
    """The summary's "label: value" rows."""
    return {k: v.strip() for k, _, v in (ln.partition(": ") for ln in out.splitlines()) if v}


def _profiled(model: nn.Module, *inputs, **kw) -> FlopsProfiler:
    prof = FlopsProfiler(model, **kw)
    prof.start_profile()
    model(*inputs)
    prof.stop_profile()
    return prof


# --- (a) measured forward == analytic forward ---------------------------------------------


def test_measured_forward_flops_equal_narayanans_forward_count_exactly():
    """Equal to the flop: 15,728,640 = 2 layers x (24·B·s·h² + 4·B·s²·h) + 2·B·s·h·V.

    FlopCounterMode counts the matrix products, 2 flops per multiply-add (addmm's bias add not
    counted): QKV, the output projection, the two MLP products and the tied head; and attention
    as q·kᵀ and scores·v over the whole s x s square (is_causal ignored). Narayanan et al. count
    exactly those products; the embedding lookups, layer norms, GELU, softmax and residual adds
    are 0 in both. So there is no residual term. On CPU, torch has no formula for its attention
    kernel (aten._scaled_dot_product_flash_attention_for_cpu): a bare FlopCounterMode falls
    short by exactly the attention term 4·B·s²·l·h = 1,048,576, which the profiler adds back.
    """
    model, idx = _gpt(), _idx()
    prof = _profiled(model, idx)
    expected = transformer_flops(
        layers=L, hidden=H, heads=4, vocab=V, seq=S, batch=B, backward=False
    )
    assert expected == FWD == 15_728_640
    assert prof.get_total_flops() == expected
    assert prof.get_total_macs() == expected // 2  # every counted op is a multiply-add

    # Term by term, per module (a parent includes its children; the ModuleList sums them).
    for block in model.blocks:
        assert prof.flops_of(block.attn.qkv) == 6 * B * S * H * H
        assert prof.flops_of(block.attn) == 8 * B * S * H * H + 4 * B * S * S * H
        assert prof.flops_of(block.mlp) == 16 * B * S * H * H
        assert prof.flops_of(block.ln1) == prof.flops_of(block.ln2) == 0
    assert prof.flops_of(model.blocks) == L * LAYER_FWD
    assert prof.flops_of(model.head) == LOGITS_FWD
    assert prof.flops_of(model.wte) == 0

    # Every module's figure is the one FlopCounterMode files under its dotted name.
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as named:
        model(idx)
    by_name = {k: sum(v.values()) for k, v in named.get_flop_counts().items()}
    for name, module in model.named_modules():
        if prof.profiles[module].ncalls:
            assert prof.flops_of(module) == by_name.get(f"GPT.{name}".rstrip("."), 0), name

    with FlopCounterMode(display=False) as bare:
        model(idx)
    assert bare.get_total_flops() in (expected, expected - 4 * B * S * S * L * H)


def test_backward_and_recomputation_before_stop_are_not_counted():
    """A step profiled DeepSpeed's way (stop after backward), with every block checkpointed:
    the count is still one forward; the step's flops are DeepSpeed's (3 + recompute) x it."""
    model, idx = _gpt(checkpoint_every=1), _idx()
    prof = FlopsProfiler(model, recompute_fwd_factor=1.0)
    prof.start_profile()
    model(idx, idx).backward()  # the blocks' forwards run again inside backward
    prof.stop_profile()
    assert prof.get_total_flops() == FWD
    assert prof.profiles[model.blocks[0]].ncalls == 1
    assert prof.get_step_flops() == 4 * FWD
    # DeepSpeed's factor recomputes the logits too; Narayanan's recompute count does not.
    full = transformer_flops(L, H, 4, V, S, B, recompute=True)
    assert prof.get_step_flops() - full == LOGITS_FWD
    prof.end_profile()
    with pytest.raises(RuntimeError, match=r"^FlopsProfiler\.get_total_flops: no profile"):
        prof.get_total_flops()


# --- (b) Narayanan et al.'s formula --------------------------------------------------------


def test_narayanan_formula_for_the_1t_model():
    """The 1T GPT of Narayanan et al. (SC'21, Table 1: 128 layers, h = 25600, 160 heads,
    s = 2048, V = 51200, batch 3072): their F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) is
    51,390,513,775,273,574,400 ≈ 5.14e19 flops per iteration, with full recomputation (4 layer
    forwards' worth, 3 for the logits). Without recomputation: 72·B·s·l·h²·(1 + s/(6h) +
    V/(12·l·h)) = 38,555,254,837,267,660,800."""
    b, s, n, h, v = 3072, 2048, 128, 25600, 51200  # n: layers
    dims = dict(layers=n, hidden=h, heads=160, vocab=v, seq=s, batch=b)
    layer_fwd = 24 * b * s * h * h + 4 * b * s * s * h
    logits_fwd = 2 * b * s * h * v

    with_recompute = transformer_flops(**dims, recompute=True)
    paper = 96 * b * s * n * h**2 * (1 + Fraction(s, 6 * h) + Fraction(v, 16 * n * h))
    assert with_recompute == paper == 4 * n * layer_fwd + 3 * logits_fwd
    assert with_recompute == 51_390_513_775_273_574_400

    without = transformer_flops(**dims)
    assert without == 72 * b * s * n * h**2 * (1 + Fraction(s, 6 * h) + Fraction(v, 12 * n * h))
    assert without == 3 * n * layer_fwd + 3 * logits_fwd == 38_555_254_837_267_660_800
    assert transformer_flops(**dims, backward=False) == n * layer_fwd + logits_fwd
    assert transformer_flops(**dims, ffn=4 * h) == without

    # Their 163 teraFLOP/s per A100 (312 peak) is 52% of peak, whatever the iteration time.
    seconds = with_recompute / (3072 * 163e12)
    assert model_flops_utilization(with_recompute, seconds, 3072 * 312e12) == pytest.approx(
        163 / 312
    )


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: transformer_flops(2, 64, 4, 256, 32, 2, backward=False, recompute=True),
            "transformer_flops: recompute=True needs backward=True",
        ),
        (
            lambda: transformer_flops(2, 64, 5, 256, 32, 2),
            "transformer_flops: heads 5 does not divide hidden 64",
        ),
        (
            lambda: transformer_flops(0, 64, 4, 256, 32, 2),
            "transformer_flops: layers must be a positive int, got 0",
        ),
        (
            lambda: model_flops_utilization(1e12, 0, 1e12),
            "model_flops_utilization: step_seconds must be > 0, got 0",
        ),
        (
            lambda: model_flops_utilization(1e12, 1.0, -1),
            "model_flops_utilization: peak_flops_per_second must be > 0, got -1",
        ),
    ],
)
def test_analytic_errors_name_the_argument(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value) == message


# --- (c) the printed profile and get_model_profile ----------------------------------------


def test_printed_profile_has_the_summary_the_top_modules_and_the_tree(capsys, tmp_path):
    prof = _profiled(_gpt(), _idx())
    prof.print_model_profile(profile_step=3, top_modules=2)
    out = capsys.readouterr().out
    rows = _rows(out)
    assert "Profile Summary at step 3:" in out
    assert rows["params per GPU"] == "118.53 K"
    assert rows["fwd MACs per GPU"] == "7.86 MMACs"
    assert rows["fwd flops per GPU"] == "15.73 M"
    assert rows["fwd FLOPS per GPU = fwd flops per GPU / fwd latency"].endswith("FLOPS")
    assert "depth 4:\n    params      - {'InitLinear': '99.46 K'}" in out
    assert "    MACs        - {'InitLinear': '6.29 MMACs'}" in out
    assert "    MACs        - {'ModuleList': '6.82 MMACs', 'Linear': '1.05 MMACs'}" in out
    tree = out[out.index("\nGPT(\n") :]
    for line in [
        "  118.53 K = 100% Params, 7.86 MMACs = 100% MACs, ",
        "  (blocks): ModuleList(\n    99.97 K = 84.34% Params, 6.82 MMACs = 86.67% MACs, ",
        "    (1): Block(\n",
        "        (qkv): InitLinear(12.48 K = 10.53% Params, 786.43 KMACs = 10% MACs, ",
        "in_features=64, out_features=192, bias=True)\n",
        "  (head): Linear(16.38 K = 13.82% Params, 1.05 MMACs = 13.33% MACs, ",
    ]:
        assert line in tree, line

    path = tmp_path / "new_dir" / "profile.txt"
    prof.print_model_profile(profile_step=3, top_modules=2, output_file=str(path))
    assert capsys.readouterr().out == ""
    assert path.read_text() == out  # the same profile, not measured again
    prof.print_model_profile(detailed=False)
    assert "\nGPT(\n" not in capsys.readouterr().out


def test_engine_summary_names_the_sizes_and_the_step_flops(capsys):
    model = _gpt()
    engine = SimpleNamespace(
        module=model,
        world_size=4,
        dp_world_size=2,
        topology=SimpleNamespace(tp=2),
        train_micro_batch_size_per_gpu=lambda: 2,
    )
    prof = FlopsProfiler(None, ds_engine=engine, recompute_fwd_factor=1.0)
    assert prof.model is model
    prof.start_profile()
    model(_idx())
    prof.stop_profile()
    prof.print_model_profile()
    rows = _rows(capsys.readouterr().out)
    assert (rows["world size"], rows["data parallel size"], rows["model parallel size"]) == (
        "4",
        "2",
        "2",
    )
    assert rows["batch size per GPU"] == "2"
    assert rows["params of model = params per GPU * mp_size"] == "237.06 K"
    assert rows["fwd+bwd flops per GPU per step = 4 * fwd flops per GPU"] == "62.91 M"


def test_get_model_profile_returns_deepspeeds_triple(capsys):
    model, idx = _gpt(), _idx()
    got = get_model_profile(model, args=[idx], print_profile=False)
    assert got == ("15.73 M", "7.86 MMACs", "118.53 K")  # number_, macs_, params_to_string
    assert capsys.readouterr().out == ""
    assert get_model_profile(model, args=[idx], print_profile=False, as_string=False) == (
        FWD,
        FWD // 2,
        CFG.num_params,
    )
    assert model.training  # put back as it was

    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    flops, macs, params = get_model_profile(mlp, input_shape=(3, 8), as_string=False)
    assert (flops, macs, params) == (2 * 3 * 8 * 16 + 2 * 3 * 16 * 4, 576, 8 * 16 + 16 + 16 * 4 + 4)
    assert "Sequential(" in capsys.readouterr().out


def test_number_strings_are_deepspeeds():
    assert number_to_string(0) == "0 "
    assert number_to_string(1234) == "1.23 K"
    assert number_to_string(15_728_640) == "15.73 M"
    assert macs_to_string(7_864_320) == "7.86 MMACs"
    assert flops_to_string(1.23e9) == "1.23 GFLOPS"
    assert flops_to_string(2.5e12, units="G") == "2500 GFLOPS"
    assert params_to_string(1.5e9) == "1.5 B"
    assert params_to_string(6) == "6"
    assert duration_to_string(0.00123) == "1.23 ms"
    assert duration_to_string(2e-5) == "20 us"


# --- (d) parameters ------------------------------------------------------------------------


def test_shared_parameters_are_counted_once():
    model = _gpt()
    assert model.head.weight is model.wte.weight
    prof = FlopsProfiler(model)
    prof.start_profile()
    every_use = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert prof.get_total_params() == CFG.num_params == 118_528 == every_use - V * H
    assert prof.profiles[model.head].params == prof.profiles[model.wte].params == V * H

    lin = nn.Linear(8, 8)
    twice = nn.Sequential(lin, nn.ReLU(), lin)
    prof = _profiled(twice, torch.ones(3, 8))
    assert prof.get_total_params() == 8 * 8 + 8
    assert prof.profiles[lin].ncalls == 2
    assert prof.get_total_flops() == prof.flops_of(lin) == 2 * (2 * 3 * 8 * 8)


def test_stage3_shards_count_at_full_size():
    lin = nn.Linear(8, 16)
    for p in lin.parameters():  # as zero.Init leaves it: an empty tensor, the shape in p._zs
        p._zs = ShardState(shape=p.shape, numel=p.numel(), piece=torch.empty(0))
        p.data = torch.empty(0)
    assert all(is_sharded(p) and p.numel() == 0 for p in lin.parameters())
    prof = FlopsProfiler(lin)
    prof.start_profile()
    assert prof.get_total_params() == 8 * 16 + 16
    assert prof.get_total_params(as_string=True) == "144"


# --- (e) errors ----------------------------------------------------------------------------


def test_generate_mode_is_refused_in_one_line():
    with pytest.raises(ValueError) as info:
        get_model_profile(_gpt(), args=[_idx()], mode="generate")
    assert str(info.value) == "get_model_profile: mode 'generate' is not supported (only 'forward')"


def test_other_misuse_names_the_thing():
    with pytest.raises(ValueError, match=r"^get_model_profile: no input; give input_shape"):
        get_model_profile(_gpt())
    with pytest.raises(ValueError, match=r"^get_model_profile: input_shape must be a non-empty"):
        get_model_profile(_gpt(), input_shape=[2, 32])
    with pytest.raises(TypeError, match=r"^FlopsProfiler: model must be a torch.nn.Module"):
        FlopsProfiler("gpt")
    with pytest.raises(RuntimeError, match=r"^FlopsProfiler\.print_model_profile: no profile"):
        FlopsProfiler(_gpt()).print_model_profile()


# ------------------------------------------------------------------ the engine's config block
def _engine_profile(rank, world, gas):
    import contextlib
    import io

    import zerostack
    from zerostack.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, d_model=64, n_head=4, block_size=32, vocab_size=256)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "flops_profiler": {"enabled": True, "profile_step": 1, "detailed": False},
        "steps_per_print": 1,
    }
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("zerostack").addHandler(handler)
    logging.getLogger("zerostack").setLevel(logging.INFO)
    engine, *_ = zerostack.initialize(model=GPT(cfg), config=config)
    out = io.StringIO()
    seen = []
    with contextlib.redirect_stdout(out):
        for _ in range(3 * gas):
            x = torch.randint(0, 256, (2, 32))
            engine.backward(engine(x, x))
            engine.step()
            seen.append(engine.flops_profile.active)
    steps = [r for r in records if r.startswith("step=")]
    return out.getvalue(), engine.flops_profile.last_step_flops, seen, cfg, steps


@pytest.mark.distributed
@pytest.mark.parametrize("gas", [1, 2])
def test_the_engine_profiles_the_configured_step(gas):
    """``flops_profiler.enabled``: the step after ``profile_step`` completed ones is profiled
    (every micro-batch's forward), printed once at its boundary; its flops are a whole step's
    (forward x 3) over the global batch."""
    from tests.support.ranks import run_distributed

    text, flops, seen, cfg, steps = run_distributed(_engine_profile, 1, args=(gas,))[0]
    assert text.count("Profile Summary at step 1:") == 1, text
    layers, h, s, v = cfg.n_layer, cfg.d_model, cfg.block_size, cfg.vocab_size
    assert flops == transformer_flops(layers, h, cfg.n_head, v, s, batch=2 * gas)
    # active during the micro-steps of the second step only
    assert seen == [False] * gas + [True] * (gas - 1) + [False] * (gas + 1)
    # the step log: samples/s from its second line, model TFLOP/s per rank once profiled
    assert len(steps) == 3 and "samples/s=" not in steps[0], steps
    assert all("samples/s=" in line and "TFLOP/s per rank=" in line for line in steps[1:]), steps
