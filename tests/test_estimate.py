"""zerostack.estimate: the ZeRO paper's figures, Korthikanti's activation table, and the estimate
against what live engines hold (engine.memory_breakdown() on real gloo ranks, for layouts with
offload, tensor and pipeline parallelism; tests/test_memory.py holds the census of live storage
against the same per-stage formulas, which the estimator must equal)."""

from __future__ import annotations

import functools
import json

import pytest
import torch

import zerostack
from zerostack.estimate import (
    EstimateError,
    Layout,
    Transformer,
    Workload,
    estimate,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
    layer_activation_bytes,
    model_states,
    zero_paper_bytes,
)
from zerostack.moe import is_moe_param
from zerostack.zero.stage3.params import full_shape

from tests.support.models import TINY, batch, run_cli, tiny_gpt, tiny_transformer
from tests.support.ranks import run_distributed
from tests.test_memory import expected

PAPER_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}  # ZeRO paper, Figure 1: 7.5B params, N = 64


_cli = run_cli


def test_the_zero_papers_figure_1():
    """7.5B parameters, 64 ranks, fp16 Adam: 120, 31.4, 16.6 and 1.9 GB per rank. zerostack's own
    layout equals it at stages 0-1 and holds exactly 2 psi / N more at stages 2-3 (its gradient
    shard is fp32, not 16-bit), plus at stages 1-2 the one gradient bucket (reduce_bucket_size,
    DeepSpeed's 5e8 elements) kept between steps."""
    psi, n = 7_500_000_000, 64
    code, out, _ = _cli(
        "estimate", "--params", "7.5e9", "--world", "64", "--precision", "fp16", "--json"
    )
    assert code == 0
    stages = json.loads(out)["stages"]
    assert sorted(stages) == ["0", "1", "2", "3"]
    for stage, gb in PAPER_GB.items():
        got = stages[str(stage)]
        assert round(got["zero_paper_bytes_per_rank"] / 1e9, 1) == gb
        assert got["zero_paper_bytes_per_rank"] == zero_paper_bytes(psi, n, stage)
        extra = 2 * -(-psi // n) if stage >= 2 else 0
        extra += 2 * 500_000_000 if stage in (1, 2) else 0  # one fp16 bucket kept between steps
        assert got["model_states_bytes_per_rank"] == got["zero_paper_bytes_per_rank"] + extra


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [1, 2, 4, 64])
def test_model_states_are_the_per_stage_formulas(stage, precision, dp):
    """The formulas tests/test_memory.py holds the engine and the census of live storage to."""
    psi = 4 * 3 * 5 * 7 * 64  # divisible by every dp here: no padding
    want = expected(stage, "bf16" if precision == "fp16" else precision, psi, dp)
    layout = Layout(dp=dp, stage=stage, precision=precision)
    assert model_states(psi, layout, bucket=psi).by_kind() == want  # one bucket, as the tiny GPT


def test_korthikanti_table_2():
    """Per-layer activation bytes / (s b h) in 16-bit with dropout, t = 8 (Korthikanti et al.),
    plus what their table leaves out: the two LayerNorms' fp32 mean and rstd, 16 s b (split
    with the norms' inputs under sequence parallelism)."""
    s, h, a, t = 2048, 12288, 96, 8
    m = Transformer(layers=1, hidden=h, heads=a, vocab=51200, seq=s)
    rows = {
        ("none", 1, False): 34 + 5 * a * s / h,
        ("none", t, False): 10 + 24 / t + 5 * a * s / (h * t),
        ("none", t, True): (34 + 5 * a * s / h) / t,
        ("selective", t, False): 10 + 24 / t,
        ("selective", t, True): 34 / t,
        ("full", t, False): 2,
        ("full", t, True): 2 / t,
    }
    for (recompute, tp, sp), coefficient in rows.items():
        got = layer_activation_bytes(m, 1, tp=tp, sequence_parallel=sp, recompute=recompute)
        stats = 0 if recompute == "full" else 16 * s / (tp if sp else 1)
        assert got == pytest.approx(coefficient * s * h + stats, rel=1e-12), (recompute, tp, sp)


def test_parameter_counts_of_known_models():
    """GPT-2 small from its config.json has 124,439,808 parameters; the reference GPT's count."""
    gpt2 = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
    assert Transformer.from_hf_config(gpt2).params == 124_439_808
    m = tiny_transformer()
    assert m.params == TINY.num_params == sum(p.numel() for p in tiny_gpt().parameters())


def test_hf_config_through_the_command_line(tmp_path):
    llama = {
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 8,
        "vocab_size": 1000,
        "max_position_embeddings": 512,
        "intermediate_size": 688,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(llama))
    code, out, _ = _cli(
        "estimate", "--hf-config", str(path), "--world", "2", "--stage", "3", "--json"
    )
    assert code == 0
    got = json.loads(out)["stages"]["3"]
    assert got["params"] == Transformer.from_hf_config(llama).params
    assert got["activation_bytes_per_rank"] > 0 and got["layout"]["dp"] == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--params", "1e9", "--world", "6", "--tp", "4"],
            "--world: 6 ranks cannot be split as tp 4 x pp 1",
        ),
        (["--layers", "2", "--hidden", "64"], "--heads: needed with a model description"),
        ([], "--params: give it, a model description (--layers ...) or --hf-config"),
        (
            ["--params", "1e9", "--stage", "0", "--offload-optimizer", "cpu"],
            "offload_optimizer: needs ZeRO stage 1, 2 or 3",
        ),
        (["--hf-config", "/nonexistent/config.json"], "--hf-config: /nonexistent/config.json"),
        (
            [
                "--layers",
                "3",
                "--hidden",
                "64",
                "--heads",
                "4",
                "--vocab",
                "9",
                "--seq",
                "8",
                "--pp",
                "4",
                "--world",
                "4",
            ],
            "pp: 4 stages for 3 layers",
        ),
        (["--params", "1e9", "--world", "4", "--ep", "3"], "split as tp 1 x pp 1 x ep 3"),
        (["--params", "1e9", "--world", "4", "--ep", "2"], "ep: 2 ranks split the experts"),
        (["--params", "1e9", "--expert-params", "2e9"], "experts: 2000000000 is not a count"),
        (["--params", "1e9", "--world", "4", "--sp", "3"], "sp: 3 does not divide the dp axis"),
        (
            ["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "9", "--seq", "6"]
            + ["--world", "4", "--sp", "4"],
            "sp: 4 Ulysses ranks split neither seq 6 nor heads 4 evenly",
        ),
    ],
)
def test_bad_input_is_one_line(argv, message):
    code, out, err = _cli("estimate", *argv)
    assert code == 2 and out == ""
    assert err.startswith("EstimateError: ") and message in err and err.count("\n") == 1, err


def test_expert_parallel_layouts_through_the_command_line():
    """``--ep`` with ``--expert-params``: per rank, the shared parameters' state cut over the
    dp x ep ranks and its experts' (a quarter of them at ep 4, whole on every tp rank) over dp,
    as the formulas written out here say (bf16, Adam, stage 2, nothing padded)."""
    p, x = 7_200_000_000, 6_400_000_000  # all, of which experts
    code, out, _ = _cli(
        "estimate", "--params", str(p), "--expert-params", str(x), "--world", "32", "--tp", "2",
        "--ep", "4", "--stage", "2", "--precision", "bf16", "--json",
    )  # fmt: skip
    assert code == 0
    got = json.loads(out)["stages"]["2"]
    dp, shared, experts = 4, (p - x) // 2, x // 4  # 32 = dp 4 x ep 4 x tp 2
    shard = shared // (dp * 4) + experts // dp
    assert got["layout"]["dp"] == dp and got["experts_per_rank"] == experts
    states = got["model_states"]
    assert states["params"] == 2 * (shared + experts)
    assert (states["grads"], states["master"], states["optimizer"]) == (
        4 * shard,
        4 * shard,
        8 * shard,
    )


def test_ulysses_holds_the_activations_of_its_sequence_shard():
    """``--sp 2``: each rank's activations are those of half the sequence; model states are
    the dp layout's (the sp ranks are part of dp)."""
    desc = ["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "100", "--world", "4"]
    runs = {}
    for seq, sp in ((512, 2), (256, 1), (512, 1)):
        code, out, _ = _cli(
            "estimate", *desc, "--seq", str(seq), "--sp", str(sp), "--stage", "3", "--json"
        )
        assert code == 0
        runs[seq, sp] = json.loads(out)["stages"]["3"]
    act = {k: r["activation_bytes_per_rank"] for k, r in runs.items()}
    assert act[512, 2] == act[256, 1] and 2 * act[512, 2] <= act[512, 1]
    assert runs[512, 2]["model_states"] == runs[512, 1]["model_states"]


def test_bad_layouts_are_named():
    with pytest.raises(EstimateError, match="stage: 4 is not one of 0, 1, 2, 3"):
        Layout(stage=4)
    with pytest.raises(EstimateError, match="offload_param: only with ZeRO stage 3"):
        Layout(stage=2, offload_param="cpu")
    with pytest.raises(EstimateError, match="hidden: 100 is not divisible by heads 3"):
        Transformer(layers=1, hidden=100, heads=3, vocab=5, seq=4)


def test_deepspeed_helpers_print_their_table(capsys):
    rows = estimate_zero2_model_states_mem_needs_all_cold(7_500_000_000, 8, 8)
    text = capsys.readouterr().out
    assert "HW: Setup with 8 nodes, 8 GPUs per node." in text and "per CPU  |  per GPU" in text
    assert [r[2] for r in rows] == ["offload_optimizer=cpu ", "offload_optimizer=none"]
    # without offload, per GPU: 2 psi + (4 + 4 + 8) psi / 64 (fp32 gradient shard, master, Adam)
    assert rows[1][1] == 2 * 7_500_000_000 + 16 * -(-7_500_000_000 // 64)
    rows = estimate_zero3_model_states_mem_needs_all_live(tiny_gpt(), 2, 1)
    assert len(rows) == 6 and "largest layer params" in capsys.readouterr().out


# ------------------------------------------------------------------ against live engines
LIVE = {
    "stage 2, offload cpu": dict(stage=2, offload="cpu"),
    "stage 3, offload cpu + params cpu": dict(stage=3, offload="cpu", offload_param="cpu"),
    "stage 3, bf16": dict(stage=3, precision="bf16"),
    "stage 1, bf16, offload cpu": dict(stage=1, precision="bf16", offload="cpu"),
    "tp 2, stage 1": dict(stage=1, tp=2),
    "pp 2, stage 1, bf16": dict(stage=1, pp=2, precision="bf16"),
    "stage 3, default persistence": dict(stage=3, persist=True),
    # the compositions of issue 35: the same formulas, over the ranks that shard each part
    "pp 2, stage 2": dict(stage=2, pp=2),
    "pp 2, stage 3, bf16": dict(stage=3, pp=2, precision="bf16"),
    "sp 2, stage 3": dict(stage=3, sp=2),
    "ep 2, stage 2": dict(stage=2, ep=2),
    "ep 2, stage 1, bf16": dict(stage=1, ep=2, precision="bf16"),
    "ep 2, stage 3": dict(stage=3, ep=2),
}


def _live_engine(case: dict):
    if case.get("pp", 1) == 1:
        model = tiny_gpt()
        if case.get("tp", 1) > 1:
            model = model.parallelize(zerostack.Topology.build(tp=2))
        if case.get("ep", 1) > 1:  # every second block a mixture of 4 experts, 2 on each rank
            import dataclasses

            from zerostack.models import GPT

            cfg = dataclasses.replace(TINY, moe_every=2, num_experts=4, moe_ep_size=case["ep"])
            torch.manual_seed(0)
            model = GPT(cfg)
        return _live_engine_of(model, case)
    from zerostack.models.gpt_pipe import GPTLoss, gpt_layers
    from zerostack.pipeline import PipelineModule

    topo = zerostack.Topology.build(pp=2)
    model = PipelineModule(
        gpt_layers(TINY, topology=topo),
        topology=topo,
        loss_fn=GPTLoss(topo),
        partition_method="type:Block",
    )
    return _live_engine_of(model, {**case, "gas": 2})


def _live_engine_of(model, case: dict):
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": case["stage"], "stage3_param_persistence_threshold": 0},
    }
    if case.get("persist"):  # the default threshold: small parameters also held whole
        del cfg["zero_optimization"]["stage3_param_persistence_threshold"]
    if case.get("precision", "fp32") != "fp32":
        cfg[case["precision"]] = {"enabled": True}
    for key in ("offload", "offload_param"):
        if key in case:
            name = "offload_optimizer" if key == "offload" else key
            cfg["zero_optimization"][name] = {"device": case[key]}
    if "gas" in case:
        cfg["gradient_accumulation_steps"] = case["gas"]
    if "sp" in case:
        cfg["sequence_parallel_size"] = case["sp"]
    return zerostack.initialize(model=model, config=cfg)[0]


def _live(rank, world, cases):
    out = {}
    for name, case in cases.items():
        engine = _live_engine(case)
        x, y = batch(0, 2)
        if case.get("pp", 1) > 1:
            engine.train_batch(iter([(x[:1], y[:1]), (x[1:], y[1:])]))
        else:
            from zerostack.sequence import shard_sequence

            x, y = shard_sequence((x, y), engine.topology)
            engine.backward(engine(x[:1], y[:1]))
            engine.step()  # the optimizer state exists after the first step
        sizes = sorted(full_shape(p).numel() for p in engine.module.parameters())
        units = len(sizes)
        stage = engine.topology.rank("pp")
        experts = sum(full_shape(p).numel() for p in engine.module.parameters() if is_moe_param(p))
        breakdown = engine.memory_breakdown()
        out[name] = (sum(sizes), units, engine.topology.dp, breakdown, sizes, stage, experts)
        engine.destroy()
    return out


@functools.cache
def _live_results():
    """Every LIVE case on 4 ranks, once for the tests that read them."""
    return run_distributed(_live, 4, args=(LIVE,))


def _case_layout(case: dict, dp: int, *, offload_param: bool = True) -> Layout:
    return Layout(
        dp=dp,
        tp=case.get("tp", 1),
        pp=case.get("pp", 1),
        ep=case.get("ep", 1),
        stage=case["stage"],
        precision=case.get("precision", "fp32"),
        optimizer="adamw",
        offload_optimizer=case.get("offload", "none"),
        offload_param=case.get("offload_param", "none") if offload_param else "none",
    )


@pytest.mark.distributed
def test_estimate_matches_live_engines():
    """Per rank, what the estimator predicts for the parameters this rank's tp x pp slice holds
    equals engine.memory_breakdown() up to padding (fewer than dp elements per bucket, or per
    parameter at stage 3)."""
    for got in _live_results():
        for name, case in LIVE.items():
            local, units, dp, breakdown, _, _, experts = got[name]
            layout = _case_layout(case, dp)
            # one bucket holds it all (at ep 2, the experts and the rest each one bucket)
            want = model_states(local, layout, bucket=local, experts=experts).by_kind()
            slack = 8 * dp * units  # padding, and Adam's 4-byte step counter per tensor
            for kind, value in want.items():
                if case.get("persist") and kind == "params":
                    continue  # checked from the model description below
                if case.get("offload_param") and kind == "params":
                    continue  # pieces in host memory: memory_breakdown counts those read in
                assert value <= breakdown[kind] <= value + slack, (name, kind, breakdown, want)
            if not experts:
                total = estimate(local * layout.tp * layout.pp, layout)["model_states"]["total"]
                assert total == sum(model_states(local, layout, bucket=local).by_kind().values())


def _odd_stage3(rank, world):
    from zerostack.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, d_model=20, bias=True)
    torch.manual_seed(0)
    engine = _live_engine_of(GPT(cfg), dict(stage=3, precision="bf16"))
    sizes = [full_shape(p).numel() for p in engine.module.parameters()]
    out = sizes, engine.memory_breakdown()
    engine.destroy()
    return out


@pytest.mark.distributed
def test_stage3_padding_is_estimated_as_the_engine_pads():
    """Given the tensors' sizes, the estimate of stage 3's parameter pieces is the engine's to the
    byte, for a model whose sizes are not multiples of 8 (pieces padded to 16-byte blocks)."""
    for sizes, breakdown in run_distributed(_odd_stage3, 2):
        layout = _case_layout(dict(stage=3, precision="bf16"), 2)
        want = model_states(sum(sizes), layout, sizes=sizes)
        assert any(n % 16 for n in sizes)  # padding is in play
        assert breakdown["params"] == want.params and breakdown["master"] == want.master


@pytest.mark.distributed
def test_estimate_from_the_model_description_matches_every_rank():
    """From the GPT's description alone (no live model): the busiest rank's model-state bytes
    equal the most any rank holds, with tp splitting some tensors and not others, a pipeline's
    last stage holding the tied output layer, and stage 3 holding small parameters whole."""
    model = tiny_transformer()
    results = _live_results()
    for name, case in LIVE.items():
        if case.get("offload_param"):
            continue  # memory_breakdown counts only the pieces read in right now
        if case.get("ep"):
            continue  # the model description has no experts (the live test above has them)
        dp = results[0][name][2]
        layout = _case_layout(case, dp, offload_param=False)
        work = Workload(persistence_threshold=100_000 if case.get("persist") else 0)
        got = max(sum(r[name][3].values()) for r in results)
        want = estimate(model.params, layout, model=model, work=work)["model_states"]["total"]
        units = results[0][name][1]
        assert want <= got <= want + 8 * dp * units, (name, got, want)
        for r in results:  # each rank's own tensors, pipeline stage by stage
            sizes, stage = r[name][4], r[name][5]
            assert sorted(model.rank_tensors(layout.tp, layout.pp, stage)) == sizes, name


def _uneven_pipeline(rank, world, layers):
    import dataclasses

    from zerostack.models.gpt_pipe import GPTLoss, gpt_layers
    from zerostack.pipeline import PipelineModule

    cfg = dataclasses.replace(TINY, n_layer=layers)
    topo = zerostack.Topology.build(pp=world)
    torch.manual_seed(0)
    model = PipelineModule(
        gpt_layers(cfg, topology=topo), topology=topo, loss_fn=GPTLoss(topo),
        partition_method="type:Block",
    )  # fmt: skip
    return topo.rank("pp"), sorted(p.numel() for p in model.parameters())


@pytest.mark.distributed
@pytest.mark.parametrize("layers,pp", [(3, 2), (5, 3)])
def test_uneven_pipeline_stages_are_estimated_as_the_engine_cuts_them(layers, pp):
    """When pp does not divide the layers, each stage's tensors are the engine's (the first
    stages take the larger share): 3 layers on 2 stages are 2 + 1, 5 on 3 are 2 + 2 + 1."""
    import dataclasses

    from zerostack.estimate import Transformer

    model = Transformer.from_gpt_config(dataclasses.replace(TINY, n_layer=layers))
    assert sum(model.stage_layers(pp)) == layers and max(model.stage_layers(pp)) == 2
    for stage, sizes in run_distributed(_uneven_pipeline, pp, args=(layers,)):
        assert sorted(model.rank_tensors(1, pp, stage)) == sizes, stage


def test_full_recompute_keeps_inputs_and_one_recomputed_layer():
    """Full recompute: per micro-batch in flight each layer's input (d s b h), plus, once, the
    activations of the layer backward is recomputing."""
    from zerostack.estimate import stage_activation_bytes

    m = Transformer(layers=8, hidden=64, heads=4, vocab=100, seq=32, dropout=False)
    full = stage_activation_bytes(m, 2, pp=2, in_flight=2, recompute="full", dtype_bytes=4)
    layer = layer_activation_bytes(m, 2, dtype_bytes=4)
    inputs = 4 * 32 * 2 * 64
    assert full == 2 * 4 * inputs + layer  # stage 0 of 2: 4 layers, 2 micro-batches in flight


LLAMA2_7B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
MISTRAL_7B = {
    **LLAMA2_7B,
    "model_type": "mistral",
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
}


def test_llama_style_configs_count_their_published_parameters():
    """Gated MLP, no biases, no position table, grouped-query attention, an untied output
    layer: Llama-2-7B has 6,738,415,616 parameters and Mistral-7B 7,241,732,096."""
    assert Transformer.from_hf_config(LLAMA2_7B).params == 6_738_415_616
    mistral = Transformer.from_hf_config(MISTRAL_7B)
    assert mistral.params == 7_241_732_096
    assert (mistral.kv_hidden, mistral.gated, mistral.positions, mistral.tied) == (
        1024,
        True,
        False,
        False,
    )


def test_llama_style_flops_are_two_per_weight_per_token():
    """A forward's matrix products: 2 flops per weight of each layer's matrices per token, the
    output layer's, and the attention scores' 4 s^2 h per layer (Mistral-7B at s = 4096)."""
    from zerostack.profiling.flops import transformer_flops

    m = Transformer.from_hf_config(MISTRAL_7B, seq=4096)
    h, f, kv, s, L, V = m.hidden, m.ffn_hidden, m.kv_hidden, m.seq, m.layers, m.vocab
    weights = L * (2 * h * h + 2 * h * kv + 3 * h * f)
    want = 2 * s * weights + 2 * s * h * V + 4 * s * s * h * L
    got = transformer_flops(L, h, m.heads, V, s, 1, ffn=f, backward=False, kv_hidden=kv, gated=True)
    assert got == want


def test_a_fused_swiglu_keeps_three_of_its_four_wide_tensors():
    """Run eagerly, SwiGLU keeps gate, up, act(gate) and their product (the dry run's census
    holds that to Hugging Face's Llama); one fused kernel (Megatron's, Transformer Engine's)
    keeps its input and recomputes act(gate) in backward: d s b f / t less per layer."""
    m = Transformer.from_hf_config(LLAMA2_7B, seq=512)
    for tp in (1, 4):
        eager = layer_activation_bytes(m, 2, tp=tp, flash=True)
        fused = layer_activation_bytes(m, 2, tp=tp, flash=True, fused_mlp=True)
        assert eager - fused == 2 * 512 * 2 * 11008 / tp
