"""zerostack plan: the cost model's flops against Narayanan et al.'s formula, the published
1T-parameter case, the written ds_config loading in zerostack unchanged, and one-line errors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from zerostack.config import load_config
from zerostack.estimate import Transformer, estimate
from zerostack.models import GPT, GPTConfig
from zerostack.plan import Candidate, PlanError, model_flops, predict, profile
from zerostack.plan.cost import (
    Software,
    attention_core_flops,
    compute_seconds,
    dp_traffic,
    hbm_bytes,
    head_seconds,
)
from zerostack.plan.hardware import FABRICS, PROFILES
from zerostack.plan.search import search

from tests.support.models import batch, run_cli
from tests.support.ranks import run_distributed

# Narayanan et al., SC'21, Table 1's largest model, trained on 3072 A100-80GB with tp 8, pp 64,
# dp 6, micro-batch 1, global batch 3072, full recompute: 163 TFLOP/s per GPU, 52% of peak.
GPT_1T = Transformer(layers=128, hidden=25600, heads=160, vocab=51200, seq=2048, dropout=False)


_cli = run_cli


def test_flops_are_narayanans_formula():
    """With full recompute: 96 B s l h^2 (1 + s / 6h + V / 16 l h); without: 3/4 of the layers'
    term (forward + backward, no second forward) and the same logits."""
    B, s, layers, h, V = 3072, 2048, 128, 25600, 51200
    want = 96 * B * s * layers * h * h * (1 + s / (6 * h) + V / (16 * layers * h))
    assert model_flops(GPT_1T, B, recompute="full") == pytest.approx(want, rel=1e-12)
    no_recompute = 72 * B * s * layers * h * h * (1 + s / (6 * h) + V / (12 * layers * h))
    assert model_flops(GPT_1T, B) == pytest.approx(no_recompute, rel=1e-12)


def test_the_published_1t_layout():
    """Their layout, priced by the nominal A100 profile: 52% of peak reported (hardware flops,
    recompute included); the model predicts it within 5 points, and the difference is the
    bubble (they interleave, the model prices plain 1F1B) and the matmul efficiency assumed."""
    hw = profile("a100-80gb", gpus=3072)
    theirs = Candidate(dp=6, tp=8, pp=64, stage=1, micro_batch=1, gas=512, recompute="full")
    p = predict(GPT_1T, 3072, theirs, hw)
    assert p.hfu == pytest.approx(0.52, abs=0.05), p.as_dict()
    # 1F1B's bubble on 64 stages over 512 micro-batches: (pp - 1) / gas of the compute
    assert p.bubble_s == pytest.approx(p.compute_s * 63 / 512, rel=1e-12)
    assert p.memory_bytes < 0.9 * hw.memory_bytes  # it fits in 80 GB, as it did


@pytest.mark.slow
def test_the_planner_on_the_published_case():
    hw = profile("a100-80gb", gpus=3072)
    plan = search(GPT_1T, hw, 3072)
    best = plan.best.candidate
    assert best.tp <= 8 and best.world == 3072  # tensor parallelism stays inside a node
    assert plan.best.memory_bytes <= 0.9 * 80e9
    assert 0.4 < plan.best.mfu < 0.65
    assert [p.step_s for p in plan.ranked] == sorted(p.step_s for p in plan.ranked)
    assert "tp 16: spans nodes (8 devices per node)" in plan.dropped
    assert any(r.startswith("tp 1 x pp 2: its smallest layout needs") for r in plan.dropped)


def test_the_written_config_loads_unchanged(tmp_path):
    out = tmp_path / "plan.json"
    code, text, _ = _cli(
        "plan", "--layers", "8", "--hidden", "512", "--heads", "8", "--vocab", "32000",
        "--seq", "1024", "--batch", "64", "--gpus", "16", "--out", str(out),
    )  # fmt: skip
    assert code == 0 and "torchrun --nnodes 2 --nproc-per-node 8" in text
    cfg = json.loads(out.read_text())
    dp = 16 // (cfg.get("tensor_parallel", {}).get("autotp_size", 1)
                * cfg.get("pipeline", {}).get("stages", 1))  # fmt: skip
    tbs, micro, gas = load_config(cfg).resolve_batch(dp)
    assert tbs == 64 and micro * gas * dp == 64


def test_json_output_has_the_ranking():
    code, text, _ = _cli(
        "plan", "--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "1000",
        "--seq", "256", "--batch", "16", "--gpus", "4", "--json", "--top", "3",
    )  # fmt: skip
    got = json.loads(text)
    assert code == 0 and len(got["ranked"]) == 3 and got["feasible"] >= 3
    assert got["ranked"][0]["step_s"] <= got["ranked"][1]["step_s"]
    assert got["ds_config"]["train_batch_size"] == 16


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--hardware", "x100"],
            "--hardware: 'x100' is not one of a100-80gb, b200-180gb, h100-80gb, h200-141gb",
        ),
        (["--gpu-memory", "0.001"], "no layout fits 8 x a100-80gb"),
        (["--gpus", "12", "--gpus-per-node", "8"], "gpus: 12 is not a whole number of nodes of 8"),
        (["--calibrate", "--fabric", "roce-400g"], "--fabric: --calibrate measures this machine"),
        (["--fabric", "omni-path", "--inter-bw", "5"], "--fabric, --inter-bw: both set the"),
    ],
)
def test_bad_input_is_one_line(argv, message):
    model = ["--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "1000", "--seq", "256"]
    code, out, err = _cli("plan", *model, "--batch", "16", *argv)
    assert code == 2 and out == ""
    assert err.startswith("PlanError: ") and message in err and err.count("\n") == 1, err


def test_no_model_is_one_line():
    code, _, err = _cli("plan", "--batch", "8")
    assert code == 2 and err == "PlanError: the model: give --layers ... --seq or --hf-config\n"


def test_a_model_that_fits_nowhere_names_the_families():
    with pytest.raises(PlanError, match="no layout fits 8 x a100-80gb: tp 1 x pp 1"):
        search(GPT_1T, profile("a100-80gb", gpus=8), 8, offload=False)


def test_the_bubble_is_the_simulated_schedule():
    """Small schedules are run by pipeline/simulate.py (1F1B and interleaved): the bubble and the
    micro-batches the first stage holds; they agree with the closed forms used past its size."""
    from zerostack.plan.cost import pipeline

    assert pipeline(1, 8) == (0.0, 1.0)
    assert pipeline(4, 4) == (0.75, 4.0)  # (pp - 1) / gas; pp micro-batches in flight
    bubble, held = pipeline(8, 64, 2)  # interleaved, two chunks per rank
    assert bubble == pytest.approx(7 / 128) and held == 8 * (1 + 7 / 16)
    big, held = pipeline(64, 512, 2)  # past the simulator's size: the closed forms
    assert big == pytest.approx(63 / 1024) and held == 64 * (1 + 63 / 128)


# ------------------------------------------------------------ the cost model against the CommLog
WIDE = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, d_model=256)


def _dp_hops(rank, world, stage, gas):
    """Ring hops of the dp collectives one optimizer step issues, as the CommLog records them:
    an all-reduce is 2 (n - 1) hops, an all-gather or a reduce-scatter n - 1."""
    import zerostack

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = zerostack.initialize(model=GPT(WIDE), config=config)
    x, y = batch(0, 1, WIDE.block_size)
    for _ in range(2):  # the second step: buffers and optimizer state already exist
        start = len(engine.comm.log.records)
        for _ in range(gas):
            engine.backward(engine(x, y))
            engine.step()
    records = [r for r in engine.comm.log.records[start:] if r.axis == "dp"]
    engine.destroy()
    return sum((2 if r.op == "all_reduce" else 1) * (world - 1) for r in records)


@pytest.mark.distributed
@pytest.mark.parametrize("gas", [1, 2])
def test_the_dp_collectives_are_what_the_engine_issues(gas):
    """With unlimited bandwidth, 1 s per hop and no overlap, the cost model's exposed dp time is
    its count of collective hops: at stages 0-2 it equals what the engine's CommLog records
    (the gradients' all-reduce at the boundary; a reduce-scatter per micro-batch at stage 2; the
    gather of the stepped shards and the norm's all-reduce at stages 1-2). Stage 3's gathers
    depend on its prefetching and persistence: ``stage3_fetch_units`` is what the CommLog counts
    for the reference GPT of benchmarks/plan.py (7 per pass for 4 layers), not an exact rule."""
    hw = profile("a100-80gb", gpus=2, gpus_per_node=2).scaled(
        intra_bw=1e30, intra_latency=1.0, shared_cores=1
    )
    for stage in range(3):
        want = run_distributed(_dp_hops, 2, args=(stage, gas))[0]
        c = Candidate(2, 1, 1, stage, 1, gas, "none", "none", precision="fp32")
        got = predict(Transformer.from_gpt_config(WIDE), 2 * gas, c, hw).dp_exposed_s
        assert got == pytest.approx(want), (stage, got, want)


def test_published_runs_are_whole_layouts_with_their_sources():
    """benchmarks/published/runs.csv (issue 56): every row a layout of exactly its GPUs whose
    batch its data-parallel ranks divide, naming its source, table and row, and whether its
    figures were checked there; benchmarks/published.py prices each row it can model and says
    why not for the others."""
    import csv
    import importlib.util
    import math
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "published", os.path.join(root, "benchmarks", "published.py")
    )
    published = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = published  # its dataclasses look their module up
    spec.loader.exec_module(published)
    with open(published.RUNS) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) >= 30 and len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        grid = int(r["tp"]) * int(r["pp"]) * int(r["cp"]) * int(r["dp"])
        assert grid == int(r["gpus"]), r["id"]
        assert int(r["batch"]) % (int(r["dp"]) * int(r["micro"] or 1)) == 0, r["id"]
        assert r["source"] and r["where"] and r["checked"], r["id"]
        assert r["gpu"] in ("a100-80gb", "h100-80gb"), r["id"]
        assert r["fabric"] in ("", *FABRICS), r["id"]  # "": the profile's own
        assert all(r[k] == "" or float(r[k]) > 0 for k in ("memory_gb", "hbm_tb_s")), r["id"]
        assert r["system"] in published.SYSTEMS, r["id"]
        assert int(r["stage"]) in published.SYSTEMS[r["system"]].stages, r["id"]
    result = published.evaluate(rows, with_search=False)
    priced = [e for e in result["rows"] if not e["skipped"]]
    assert len(priced) == result["priced"] >= 28
    assert all(math.isfinite(e["predicted"]) and e["predicted"] > 0 for e in priced)
    skipped = {e["id"]: e["skipped"] for e in result["rows"] if e["skipped"]}
    assert skipped["llama3-405b-131k"] == "context parallelism"
    assert skipped["megatron-8b"] == "fp8 compute"
    assert skipped["megascale-175b"].startswith("parallel block")
    assert skipped["megatron-gpt-oss-120b"].startswith("mixture of experts")
    # the layouts that ran and that the planner may choose (they fit 90% of the device by the
    # estimator): all but three, each with its reason in docs/results/plan.md; ZeRO-3 at 530B
    # on 640 GPUs fits as DeepSpeed gathers (a matrix at a time), Llama 3 on 16K GPUs as its
    # pipeline splits the layers (one fewer on the first and last stages), OPT as metaseq kept
    # 1/tp of each checkpointed input
    tight = {"llama3-405b-8k", "titan-8b-fsdp", "titan-8b-fsdp-compile"}
    assert {e["id"] for e in priced if not e["fits"]} == tight
    # the cost model against the record (issue 56's goal: within 15% on average), with the
    # nominal profiles' two fitted figures what the fit over these rows gives, not set by hand
    assert result["mape"] <= 0.15, result["mape"]
    fitted = published.fit(rows)
    for name in ("kernel_derate", "link_efficiency"):
        assert all(getattr(hw, name) == fitted[name] for hw in PROFILES.values()), name
    assert fitted["leave_one_out_mape"] <= 0.15, fitted
    # Narayanan et al.'s Table 2: PTD-P ahead of ZeRO-3 at 175B on 384, 768 and 1,536 GPUs
    # (153, 149, 141 against 144, 88, 44 TFLOP/s), ZeRO-3 halving as the GPUs double
    got = {e["id"]: e["predicted"] for e in priced}
    for gpus in (384, 768, 1536):
        assert got[f"zero3-175b-{gpus}"] < got[f"ptdp-175b-{gpus}"], gpus
    assert got["zero3-175b-1536"] < 0.6 * got["zero3-175b-768"] < 0.6 * got["zero3-175b-384"]


def test_a_matrix_gather_overlaps_only_the_matrix_before_it():
    """DeepSpeed's ZeRO-3 prefetches one matrix ahead: each phase takes
    sum_j max(s_j, r s_(j+1)) over its compute, cyclically over the layers' matrices. Equal
    matrices: the aggregate max(1, r); a GPT layer's (3, 1, 4, 4) at r = 1: the 4-matrix after
    the 1-matrix waits 3 of its compute, so 15/12, not 1."""
    from zerostack.plan.cost import matrix_chain

    assert matrix_chain(0.5, [2, 2, 2]) == 1 and matrix_chain(3.0, [2, 2, 2]) == 3
    assert matrix_chain(1.0, [3, 1, 4, 4]) == pytest.approx(15 / 12)
    assert matrix_chain(100.0, [3, 1, 4, 4]) == pytest.approx(100.0)


def test_the_busiest_pipeline_stage_paces_an_uneven_split():
    """3 layers on 2 stages: the first holds 2 layers, the last 1 and the whole output layer
    (its matmuls and the loss: pp times its even share); the step waits for the busier (the
    planner priced 1.5 layers a stage before, and the output layer spread over the stages).
    With a vocabulary 50 times larger, the last stage is the busier."""
    hw = profile("h100-80gb", gpus=4)
    c = Candidate(dp=1, tp=2, pp=2, stage=0, micro_batch=1, gas=4)
    for vocab, busier in ((1000, "first"), (50_000, "last")):
        m = Transformer(layers=3, hidden=256, heads=8, vocab=vocab, seq=128)
        p = predict(m, 4, c, hw)
        head = head_seconds(m, 4, c, hw)
        layer = (compute_seconds(m, 4, c, hw) - head) * 2 / 3
        first, last = 2 * layer, layer + 2 * head
        assert (first > last) == (busier == "first"), vocab
        assert p.compute_s == pytest.approx(max(first, last), rel=1e-12), vocab
    # the output layer is what grows with the vocabulary: model_flops' logits, hbm_bytes' loss
    one = replace(m, vocab=1)
    matmul = hw.peak_flops * hw.kernel_derate * hw.matmul_efficiency
    flops = (model_flops(m, 4) - model_flops(one, 4)) / matmul / c.world
    loss = (hbm_bytes(m, 4, c) - hbm_bytes(one, 4, c)) / (hw.hbm_bw * hw.kernel_derate)
    assert head_seconds(m, 4, c, hw) - head_seconds(one, 4, c, hw) == pytest.approx(
        flops + loss, rel=1e-12
    )
    m = Transformer(layers=3, hidden=256, heads=8, vocab=1000, seq=128)
    p = predict(m, 4, c, hw)
    even = predict(replace(m, layers=4), 4, c, hw)  # 2 layers a stage, evenly
    assert p.tp_s == pytest.approx(even.tp_s, rel=1e-12)  # the busiest stage's collectives


def test_the_step_outside_the_matmuls_is_counted_per_kernel():
    """hbm_bytes against a count by hand for one GPT layer and one Llama layer (tp 2, the
    replicated width split only under sequence parallelism), and compute_seconds as the
    roofline of its parts: matmuls at the matmul rate, flash attention's causal half at its
    own, the bytes at the memory bandwidth."""
    d, t, tokens = 2, 2, 4 * 64  # bf16, tp 2, a batch of 4 sequences of 64 on one dp rank
    gpt = Transformer(layers=2, hidden=32, heads=4, vocab=100, seq=64)  # dropout, LayerNorm
    c = Candidate(dp=1, tp=t, pp=1, stage=0, micro_batch=4, gas=1)
    h, f = 32, 128
    # forward per token: 2 LayerNorms (2d each, h/t under sp), 2 residuals behind eager dropout
    # (3d + 2d + a mask byte), GELU over f/t (2d); backward twice that
    forward = 2 * 2 * d * h / t + 2 * (3 * d + 2 * d + 1) * h / t + 2 * d * f / t
    loss = (2 * d + 40) * 100 / t  # eager fp32 softmax over the vocabulary, forward + backward
    assert hbm_bytes(gpt, 4, c) == pytest.approx(tokens * (3 * forward * 2 + loss), rel=1e-12)
    whole = replace(c, software=Software(sequence_parallel=False))
    replicated = 2 * 2 * d * h + 2 * (5 * d + 1) * h + 2 * d * f / t
    assert hbm_bytes(gpt, 4, whole) == pytest.approx(tokens * (3 * replicated * 2 + loss))
    scores = replace(c, software=Software(flash=False, fused=True))  # materialised, fused
    fused = 2 * 2 * d * h / t + 2 * (3 * d + 1) * h / t + 2 * d * f / t
    core = (4 * d + 2 * d + 1) * 4 / t * 64  # written, softmaxed, dropped out, read
    want = tokens * (3 * (fused + core) * 2 + (2 * d + 8) * 100 / t)
    assert hbm_bytes(gpt, 4, scores) == pytest.approx(want, rel=1e-12)

    llama = Transformer(
        layers=2, hidden=32, heads=4, kv_heads=2, vocab=100, seq=64, ffn=96, gated=True,
        positions=False, dropout=False, bias=False, tied=False,
    )  # fmt: skip
    full = replace(c, recompute="full")
    kv = 16
    forward = 2 * (4 * d + 28) * h / t + 2 * 3 * d * h / t + 5 * d * 96 / t
    forward += (2 * d + 16) * (h + kv) / t  # rotary through fp32 complex numbers
    assert hbm_bytes(llama, 4, full) == pytest.approx(tokens * (4 * forward * 2 + loss))

    hw = profile("h100-80gb", gpus=2)
    flops = model_flops(gpt, 4) - attention_core_flops(gpt, 4)
    rate = hw.peak_flops * hw.kernel_derate
    want = (
        flops / (rate * hw.matmul_efficiency) / 2
        + attention_core_flops(gpt, 4) / 2 / (rate * hw.attention_efficiency) / 2
        + hbm_bytes(gpt, 4, c) / (hw.hbm_bw * hw.kernel_derate)
    )
    assert compute_seconds(gpt, 4, c, hw) == pytest.approx(want, rel=1e-12)


def test_software_that_cannot_overlap_or_regathers_pays_for_it():
    """Stage 3 under full recompute gathers each layer again but its last matrix (zerostack's
    engine does, as DeepSpeed's: tests/test_dryrun.py holds dp_traffic to its CommLog), and the
    step prices those bytes over the ring; Megatron's 2021 DDP reduces after backward, so its
    all-reduce is all exposed."""
    m = Transformer(layers=8, hidden=1024, heads=16, vocab=32000, seq=1024)
    hw = profile("a100-80gb", gpus=64)
    z3 = Candidate(dp=64, tp=1, pp=1, stage=3, micro_batch=1, gas=1, recompute="full")
    once = replace(z3, software=Software(regather=False))
    qkv, proj, fc = 3 * 1024 * 1024, 1024 * 1024, 4 * 1024 * 1024  # the last (fc2) stays held
    extra = dp_traffic(m, z3)["all_gather"] - dp_traffic(m, once)["all_gather"]
    assert extra == 8 * (qkv + proj + fc) * 2  # bf16, pieces of 64 whole blocks: no padding
    bw = hw.inter_bw * hw.link_efficiency
    seconds = predict(m, 64, z3, hw).dp_s - predict(m, 64, once, hw).dp_s
    assert seconds == pytest.approx(63 / 64 * extra / bw + 8 * 63 * hw.inter_latency, rel=1e-9)

    ddp = Candidate(dp=64, tp=1, pp=1, stage=0, micro_batch=1, gas=1)
    after = predict(m, 64, replace(ddp, software=Software(overlap_grad_reduce=False)), hw)
    assert after.dp_exposed_s == pytest.approx(after.dp_s, rel=1e-12)
    during = predict(m, 64, ddp, hw)
    slowed = during.dp_s * hw.overlap_slowdown / (1 + hw.overlap_slowdown)
    window = 2 / 3 * during.compute_s  # backward
    assert during.dp_exposed_s == pytest.approx(max(during.dp_s - window, slowed), rel=1e-12)


def test_compute_beside_a_collective_runs_slower():
    """A collective overlapping compute slows it by ``overlap_slowdown`` f (Lee et al. 2025:
    18.9%): of D seconds of collectives over W seconds of compute, the step grows by
    D f / (1 + f) when W hides them, by D - W when they outlast W (1 + f), and by all of D where
    nothing overlaps; f = 0 is the free overlap the model had before."""
    m = Transformer(layers=8, hidden=1024, heads=16, vocab=32000, seq=1024)
    hw = profile("a100-80gb", gpus=64)
    assert hw.overlap_slowdown == 0.189
    f = hw.overlap_slowdown / (1 + hw.overlap_slowdown)
    for gpus, micro, hidden in ((8, 8, True), (64, 1, False)):  # in one node; over InfiniBand
        c = Candidate(dp=gpus, tp=1, pp=1, stage=0, micro_batch=micro, gas=1)
        p = predict(m, micro * gpus, c, profile("a100-80gb", gpus=gpus))
        window = 2 / 3 * p.compute_s  # the gradients reduce during backward
        assert (p.dp_s * (1 + hw.overlap_slowdown) < window) == hidden, gpus
        assert p.dp_exposed_s == pytest.approx(max(p.dp_s * f, p.dp_s - window), rel=1e-12)
        free = profile("a100-80gb", gpus=gpus).scaled(overlap_slowdown=0)
        free = predict(m, micro * gpus, c, free)
        assert free.dp_exposed_s == pytest.approx(max(0.0, p.dp_s - window), abs=1e-15)
        assert p.step_s - free.step_s == pytest.approx(p.dp_exposed_s - free.dp_exposed_s)
    after = replace(c, software=Software(overlap_grad_reduce=False))
    assert predict(m, 64, after, hw).dp_exposed_s == pytest.approx(p.dp_s, rel=1e-12)
    with pytest.raises(PlanError, match=r"overlap_slowdown: 1 is not in \[0, 1\)"):
        hw.scaled(overlap_slowdown=1)


def test_megatron_2021_steps_an_fp32_copy_of_its_gradients():
    """Megatron-LM's 2021 fp16 optimizer casts every gradient it steps to fp32 after backward
    (``Software.step_grad_copy``): the rank's peak is its states plus the larger of its
    activations and 4 bytes a parameter it steps (all of its slice at stage 0, 1/dp at 1)."""
    m = Transformer(layers=8, hidden=1024, heads=16, vocab=32000, seq=1024)
    hw = profile("a100-80gb", gpus=16)
    # the copy outgrows the activations (170 MB against 144) at stage 0 and micro-batch 1 only
    for stage, micro, grows in ((0, 1, True), (0, 8, False), (1, 1, False)):
        c = Candidate(dp=4, tp=2, pp=2, stage=stage, micro_batch=micro, gas=4, precision="fp16")
        copy = replace(c, software=Software(step_grad_copy=True))
        est = estimate(int(m.params), c.layout(), model=m, work=c.workload())
        stepped = est["params_per_model_parallel_rank"] / (4 if stage else 1)
        act = est["activation_bytes_per_rank"]
        assert predict(m, 64, c, hw).memory_bytes == est["total_bytes_per_rank"]
        want = est["total_bytes_per_rank"] - act + max(act, 4 * stepped)
        assert predict(m, 64, copy, hw).memory_bytes == pytest.approx(want, rel=1e-12)
        assert (4 * stepped > act) == grows, (stage, micro)


def test_a_search_held_to_a_systems_reach():
    """What another system could run (benchmarks/published.py holds each row's search to it):
    the stages, the recompute kinds and, without model parallelism, dp alone."""
    m = Transformer(layers=8, hidden=1024, heads=16, vocab=32000, seq=1024)
    hw = profile("a100-80gb", gpus=16)
    free = search(m, hw, 64)
    assert {(p.candidate.tp, p.candidate.pp) for p in free.ranked} != {(1, 1)}
    held = search(m, hw, 64, stages=(3,), recompute=("full",), model_parallel=False)
    assert {(p.candidate.tp, p.candidate.pp, p.candidate.dp) for p in held.ranked} == {(1, 1, 16)}
    assert {(p.candidate.stage, p.candidate.recompute) for p in held.ranked} == {(3, "full")}


def test_interleaving_crosses_a_stage_boundary_per_chunk():
    """With 2 model chunks per rank, each micro-batch's activation and gradient cross twice as
    many stage boundaries: the pipeline's sends double while the bubble halves."""
    m = Transformer(layers=8, hidden=1024, heads=16, vocab=32000, seq=1024)
    hw = profile("h100-80gb", gpus=32)
    one = Candidate(dp=4, tp=2, pp=4, stage=0, micro_batch=1, gas=8)
    two = replace(one, chunks=2)
    assert predict(m, 32, two, hw).pp_s == pytest.approx(2 * predict(m, 32, one, hw).pp_s)
    assert predict(m, 32, two, hw).bubble_s < predict(m, 32, one, hw).bubble_s


def test_the_search_tries_every_grid_of_the_devices():
    """Pipeline sizes are every divisor of the devices beside tp, even ones that leave the
    layers uneven (70 layers on 24 GPUs, a batch of 64: dp is a power of two, so tp x pp has
    the factor 3: pp 3, 6, 12 or 24, none of which divides 70, each priced at its busiest
    stage); interleaving tries each chunk count up to 8 that divides a stage's layers, where
    the micro-batches are a multiple of the stages."""
    from zerostack.plan.search import _chunks

    m = Transformer(layers=70, hidden=512, heads=8, vocab=32000, seq=512)
    plan = search(m, profile("a100-80gb", gpus=24), 64)
    assert {p.candidate.pp for p in plan.ranked} == {3, 6, 12, 24}
    m = replace(m, layers=24)
    assert _chunks(m, 4, 8) == (1, 2, 3, 6)  # 6 layers a stage
    assert _chunks(m, 4, 6) == (1,)  # 6 micro-batches on 4 stages
    assert _chunks(replace(m, layers=25), 4, 8) == (1,)  # uneven stages
    assert _chunks(replace(m, layers=96), 4, 8) == (1, 2, 3, 4, 6, 8)  # 24 a stage, up to 8
    # Llama 3's split counts the embedding and the output layer as layers: 126 + 2 on 16
    # stages, 8 units a stage, so interleaving divides them though 16 does not divide 126
    llama = replace(m, layers=126, ends_as_layers=True)
    assert llama.stage_layers(16) == [7, *[8] * 14, 7] and llama.stage_layers(1) == [126]
    assert replace(llama, ends_as_layers=False).stage_layers(16) == [8] * 15 + [6]
    assert _chunks(llama, 16, 16) == (1, 2, 4, 8)
    assert _chunks(replace(llama, ends_as_layers=False), 16, 16) == (1,)


def test_distributed_checkpoints_keep_a_tp_share_and_gather_it_again():
    """Megatron's --distribute-saved-activations (metaseq's, as OPT-175B ran): without
    sequence parallelism, each tp rank keeps 1/tp of each layer's input under full recompute,
    and backward all-gathers it before recomputing the layer: one more activation-sized ring
    pass over tp per layer and micro-batch. Not with sequence parallelism (already split), tp
    1 or other recompute."""
    m = Transformer(layers=8, hidden=1024, heads=16, vocab=32000, seq=1024)
    hw = profile("a100-80gb", gpus=8)
    whole = Software(sequence_parallel=False)
    c = Candidate(dp=1, tp=8, pp=1, stage=0, micro_batch=2, gas=4, recompute="full", software=whole)
    split = replace(c, software=replace(whole, distribute_saved=True))
    assert split.distributes_saved and not c.distributes_saved
    for other in (
        replace(split, software=replace(split.software, sequence_parallel=True)),
        replace(split, tp=1, dp=8),
        replace(split, recompute="selective"),
    ):
        assert not other.distributes_saved
    kept = 2 * 1024 * 2 * 1024  # bf16 x seq x micro-batch x hidden, one layer's input
    est = {x: estimate(int(m.params), x.layout(), model=m, work=x.workload()) for x in (c, split)}
    less = est[c]["activation_bytes_per_rank"] - est[split]["activation_bytes_per_rank"]
    assert less == 8 * kept * 7 / 8  # 8 layers, each keeping 1/8 where it kept all
    bw, lat = hw.intra_bw * hw.link_efficiency, hw.intra_latency
    ring = 7 / 8 * kept / bw + 7 * lat
    more = predict(m, 8, split, hw).tp_s - predict(m, 8, c, hw).tp_s
    assert more == pytest.approx(4 * 8 * ring, rel=1e-9)  # gas x layers gathers


def test_zero_beside_a_pipeline_is_what_the_software_composes():
    """zerostack (as DeepSpeed) refuses ZeRO-2 and -3 with a pipeline, so its plans hold pp > 1
    to stages 0-1; software that runs FSDP under a pipeline (Llama 3, torchtitan:
    ``pipeline_zero`` 3) is searched at every stage there."""
    m = Transformer(layers=8, hidden=1024, heads=16, vocab=32000, seq=1024)
    hw = profile("a100-80gb", gpus=16)
    ours = search(m, hw, 64, offload=False)
    staged = {(p.candidate.pp > 1, p.candidate.stage) for p in ours.ranked}
    assert staged == {(False, 0), (False, 1), (False, 2), (False, 3), (True, 0), (True, 1)}
    fsdp = search(m, hw, 64, offload=False, software=Software(pipeline_zero=3))
    assert {p.candidate.stage for p in fsdp.ranked if p.candidate.pp > 1} == {0, 1, 2, 3}


def test_deepspeed_2021_holds_a_matrix_and_the_next_not_layers():
    """Stage 3's transient buffers (estimate's ``buffer_bytes_per_rank``): zerostack gathers a
    layer at a time and prefetches two more, DeepSpeed's 2021 ZeRO-3 (``prefetch="matrix"``) a
    module at a time, the next one ahead: the largest matrix (a GPT MLP's 4h x h, or the
    embedding where larger) twice, beside the reduce bucket."""
    m = Transformer(layers=4, hidden=1024, heads=16, vocab=2000, seq=1024)
    hw = profile("a100-80gb", gpus=8)
    c = Candidate(dp=8, tp=1, pp=1, stage=3, micro_batch=1, gas=1, precision="fp16")
    deepspeed = replace(c, software=Software(prefetch="matrix"))
    layer_wise = predict(m, 8, c, hw).memory_bytes
    est = estimate(int(m.params), c.layout(), model=m, work=c.workload())
    assert layer_wise == est["total_bytes_per_rank"]
    matrix, bucket = 4 * 1024 * 1024, min(5e8, sum(m.rank_tensors()))
    held = est["total_bytes_per_rank"] - est["buffer_bytes_per_rank"] + 2 * (2 * matrix + bucket)
    assert predict(m, 8, deepspeed, hw).memory_bytes == held
    big = replace(m, vocab=50000)  # the embedding (50000 x 1024) outgrows the MLP's 4096 x 1024
    est = estimate(int(big.params), c.layout(), model=big, work=c.workload())
    bucket = min(5e8, sum(big.rank_tensors()))
    held = est["total_bytes_per_rank"] - est["buffer_bytes_per_rank"]
    assert predict(big, 8, deepspeed, hw).memory_bytes == held + 2 * (2 * 50000 * 1024 + bucket)


def test_the_fabrics_are_their_line_rates_per_device():
    """Between nodes, one way, per device, from each source's figures: an HDR or NDR
    InfiniBand or 400 Gb/s RoCE adapter per GPU; Jean Zay's four 100 Gb/s Omni-Path links per
    eight GPUs (BLOOM). Each bundled profile carries its system's fabric; another replaces it."""
    bits = 8
    assert FABRICS == {
        "infiniband-hdr": 200e9 / bits,
        "infiniband-ndr": 400e9 / bits,
        "roce-400g": 400e9 / bits,
        "omni-path": 4 * 100e9 / bits / 8,
    }
    assert profile("a100-80gb").inter_bw == 25e9 and profile("h100-80gb").inter_bw == 50e9
    hw = profile("a100-80gb", gpus=384, fabric="omni-path")
    assert hw.inter_bw == 6.25e9 and hw.name == "a100-80gb+omni-path" and hw.gpus == 384
    with pytest.raises(PlanError, match="--fabric: 'ib' is not one of infiniband-hdr"):
        profile("h100-80gb", fabric="ib")
