"""zerostack dryrun (issue 56): the real engine, built as rank 3 of 1,024 ranks under torch's
fake process group with every tensor on the meta device, holds what ``zerostack estimate``
says, to the byte, and one step issues the data-parallel collectives the planner's cost model
counts (``zerostack.plan.cost.dp_traffic``), to the byte. Models: zerostack's GPT (tied
embedding, biases, so stage 3 pads its pieces) and Hugging Face Llama at Llama-3 70B's and
405B's width (grouped-query attention, SwiGLU, untied, AutoTP leaving the embeddings whole),
two layers each so the whole table runs in seconds."""

from __future__ import annotations

import dataclasses
import multiprocessing

import pytest

from zerostack.estimate import (
    Layout,
    Transformer,
    estimate,
    layer_activation_bytes,
    stage_activation_bytes,
)
from zerostack.models import GPTConfig
from zerostack.plan.cost import (
    Candidate,
    Software,
    dp_traffic,
    pp_send_bytes,
    tp_collectives,
)

from tests.support.models import run_cli

WORLD, RANK, GAS, SEQ = 1024, 3, 2, 256
GPT_CFG = GPTConfig(block_size=SEQ, n_layer=4, n_head=16, d_model=1024, vocab_size=50304)
LLAMA_70B = dict(
    model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=2,
    num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
    max_position_embeddings=8192, tie_word_embeddings=False,
)  # fmt: skip
LLAMA_405B = dict(
    LLAMA_70B, hidden_size=16384, intermediate_size=53248, num_attention_heads=128
)  # fmt: skip
MODELS = {
    "gpt": GPT_CFG,
    "gpt-dropout": dataclasses.replace(GPT_CFG, dropout=0.1),  # two sequences per micro-batch
    "llama-70b": LLAMA_70B,
    "llama-405b": LLAMA_405B,
}
MICRO = {"gpt-dropout": 2}
CASES = [
    ("gpt-dropout", 1, 1, "none"),
    ("gpt-dropout", 1, 8, "none"),
    *[("gpt", stage, tp, "none") for stage in range(4) for tp in (1, 8)],
    ("gpt", 3, 1, "full"),
    ("gpt", 3, 8, "full"),
    *[("llama-70b", stage, tp, "none") for stage in range(4) for tp in (1, 8)],
    ("llama-405b", 1, 8, "none"),
    ("llama-405b", 3, 8, "none"),
]


def _config(stage: int, tp: int, micro: int = 1) -> dict:
    config = {
        "train_batch_size": WORLD // tp * GAS * micro,
        "train_micro_batch_size_per_gpu": micro,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    }
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    return config


def _builder(name: str, recompute: str):
    if name.startswith("gpt"):
        from zerostack.models import GPT

        cfg = dataclasses.replace(MODELS[name], checkpoint_every=1 if recompute == "full" else 0)
        return lambda: GPT(cfg)
    from transformers import LlamaConfig, LlamaForCausalLM

    raw = {k: v for k, v in MODELS[name].items() if k != "model_type"}
    return lambda: LlamaForCausalLM(LlamaConfig(**raw))


def _dry_runs(cases) -> list[dict]:
    """Every case's dry run, in a fresh process (the fake group is this process's world)."""
    from zerostack.dryrun import dry_run

    out = []
    for name, stage, tp, recompute in cases:
        config = _config(stage, tp, MICRO.get(name, 1))
        r = dry_run(_builder(name, recompute), config, world=WORLD, rank=RANK, seq=SEQ)
        out.append(r.as_dict())
    return out


# pipelines of the GPT (pp, tp, chunks per rank, the rank): its first stage (embedding, the
# most parameters), interleaved; a middle one interleaved over tp 2; its last (final norm,
# the tied head)
PIPE_CASES = [(4, 1, 2, 3), (4, 2, 2, 300), (4, 1, 1, 1023)]
PIPE_CFG = dataclasses.replace(GPT_CFG, n_layer=8)  # a block for each of 4 x 2 chunks
PIPE_GAS = 8  # micro-batches a multiple of the stages, as the interleaved schedule needs


def _pipe_runs(cases) -> list[dict]:
    from zerostack import Topology
    from zerostack.dryrun import dry_run
    from zerostack.models.gpt_pipe import GPTLoss, gpt_layers
    from zerostack.pipeline import PipelineModule

    out = []
    for pp, tp, chunks, rank in cases:

        def build(pp=pp, tp=tp, chunks=chunks):
            topo = Topology.build(pp=pp, tp=tp)
            layers = gpt_layers(PIPE_CFG, topology=topo)
            return PipelineModule(layers, topology=topo, loss_fn=GPTLoss(topo),
                                  partition_method="type:Block", virtual_stages=chunks)  # fmt: skip

        config = _config(1, tp)
        config["train_batch_size"] = WORLD // (tp * pp) * PIPE_GAS
        config["pipeline"] = {"stages": pp}
        if chunks > 1:
            config["pipeline"].update(schedule="interleaved", virtual_stages=chunks)
        out.append(dry_run(build, config, world=WORLD, rank=rank, seq=SEQ).as_dict())
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        runs = pool.apply(_dry_runs, (CASES,))
    return dict(zip(CASES, runs, strict=True))


@pytest.fixture(scope="module")
def pipe_results() -> dict:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        runs = pool.apply(_pipe_runs, (PIPE_CASES,))
    return dict(zip(PIPE_CASES, runs, strict=True))


def test_a_pipeline_at_1024_ranks_holds_and_sends_what_the_planner_says(pipe_results):
    """A PipelineModule of the GPT as three ranks of 1,024 (its stage's shapes learnt in this
    process, no neighbour sending a header): each rank holds its stage's parameters as
    ``Transformer.rank_tensors`` lays them out (an interleaved rank, its two chunks; within
    stage 1's bucket padding), the first stage's data-parallel bytes are ``dp_traffic``'s, and each
    rank sends and receives what ``pp_send_bytes`` says, per micro-batch and chunk: an
    activation forward unless its virtual stage is the last, a gradient back unless it is the
    first (zerostack sends a tp rank's activation whole, without sequence parallelism); the
    interleaved rank's tp all-reduces are its own blocks', ``tp_collectives``."""
    m = Transformer.from_gpt_config(PIPE_CFG)
    for (pp, tp, chunks, rank), run in pipe_results.items():
        dp = WORLD // (tp * pp)
        stage = rank // (dp * tp)  # the grid is (pp, dp, tp), pp outermost
        assert run["grid"] == {"dp": dp, "tp": tp, "pp": pp} and not run["activations"]
        held, slack = 2 * sum(m.rank_tensors(tp, pp, stage)), _bucket_slack(m, tp, 1)
        assert held <= run["model_states"]["params"] <= held + 2 * slack, rank
        c = Candidate(dp=dp, tp=tp, pp=pp, stage=1, micro_batch=1, gas=PIPE_GAS, chunks=chunks,
                      software=Software(sequence_parallel=False))  # fmt: skip
        if stage == 0:
            got = {k.split("/")[0]: v["bytes"] for k, v in run["collectives"].items()
                   if k.endswith("/dp") and v["bytes"] > 4}  # fmt: skip
            want = dp_traffic(m, c)
            assert set(got) == set(want), rank
            assert all(want[k] <= got[k] <= want[k] + slack for k in want), (rank, got, want)
        if tp > 1:  # its blocks' two all-reduces a layer each way, and once more forward as
            # it learns the shapes; the gradient norm's 4 bytes
            layers = PIPE_CFG.n_layer // pp
            passes, _ = tp_collectives(layers, "none", False, vocab_parallel=False)
            count = PIPE_GAS * passes // 2 + 2 * layers
            act = SEQ * m.hidden * 2
            want = {"count": count + 1, "bytes": count * act + 4}
            assert run["collectives"]["all_reduce/tp"] == want, rank
        virtual = [chunk * pp + stage for chunk in range(chunks)]
        sends = PIPE_GAS * sum((v < pp * chunks - 1) + (v > 0) for v in virtual)
        for op in ("send", "recv"):
            want = {"count": sends, "bytes": sends * pp_send_bytes(m, c)}
            assert run["collectives"][f"{op}/pp"] == want, (rank, op)


def _model(name: str) -> Transformer:
    if name.startswith("gpt"):
        return Transformer.from_gpt_config(MODELS[name])
    return Transformer.from_hf_config(MODELS[name], SEQ)


def _bucket_slack(m: Transformer, tp: int, stage: int) -> int:
    """Bytes of padding stages 1-2 may add: fewer than 8 x dp elements per 4M-element bucket
    (the engine's default reduce_bucket_size), 2-byte elements; none at stages 0 and 3."""
    if stage not in (1, 2):
        return 0
    buckets = sum(m.rank_tensors(tp)) // 4_000_000 + 2
    return buckets * 8 * (WORLD // tp) * 2


def test_the_engine_at_1024_ranks_holds_what_the_estimate_says(results):
    """memory_breakdown() of the real engine against estimate(): params, gradients, fp32
    masters and Adam's state by kind. Exact wherever no bucket padding is in play (every Llama
    case, stages 0 and 3 of the GPT with its padded stage-3 pieces); at stages 1-2 of the GPT
    within the buckets' padding. (The estimate's scratch, a gradient bucket the CPU's pool or
    the GPU's allocator keeps, is not a tensor the census sees on the meta device.)"""
    for (name, stage, tp, _), run in results.items():
        m = _model(name)
        assert run["grid"] == {"dp": WORLD // tp, "tp": tp, "pp": 1} and run["stage"] == stage
        layout = Layout(dp=WORLD // tp, tp=tp, stage=stage, precision="bf16")
        want = estimate(m.params, layout, model=m)["model_states"]
        slack = _bucket_slack(m, tp, stage) if name.startswith("gpt") else 0
        for kind in ("params", "grads", "master", "optimizer"):
            got = run["model_states"][kind]
            assert want[kind] <= got <= want[kind] + 2 * slack, (name, stage, tp, kind, got, want)
        assert run["peak_rss_bytes"] < 2e9  # no tensor of the model was ever allocated


def test_one_step_at_1024_ranks_issues_the_cost_models_collectives(results):
    """The CommLog's data-parallel bytes of one step (two micro-batches) against
    dp_traffic(): all-reduce at stage 0, reduce-scatter and gather at 1-2, stage 3's gathers in
    forward and backward, again for a recomputed forward (each layer's but its last matrix),
    the tied embedding's extra gather and the kept parameters' refresh; exact but for stages
    1-2's bucket padding on the GPT."""
    for (name, stage, tp, recompute), run in results.items():
        m = _model(name)
        c = Candidate(dp=WORLD // tp, tp=tp, pp=1, stage=stage, micro_batch=MICRO.get(name, 1),
                      gas=GAS, recompute=recompute)  # fmt: skip
        want = dp_traffic(m, c)
        got = {
            key.split("/")[0]: v["bytes"]
            for key, v in run["collectives"].items()
            if key.endswith("/dp") and v["bytes"] > 4  # the gradient norm's scalar apart
        }
        assert set(got) == set(want), (name, stage, tp, got, want)
        slack = _bucket_slack(m, tp, stage) * GAS if name.startswith("gpt") else 0
        for kind, value in want.items():
            assert value <= got[kind] <= value + slack, (name, stage, tp, recompute, kind)
        if stage == 3 and recompute == "full":  # the recompute's gathers are in the count
            plain = results[name, stage, tp, "none"]["collectives"]["all_gather/dp"]["bytes"]
            assert got["all_gather"] > plain


def test_one_step_at_1024_ranks_issues_the_cost_models_tp_all_reduces(results):
    """Tensor parallelism without sequence parallelism, against ``tp_collectives``: the GPT's
    two all-reduces a layer each way, its vocabulary-parallel embedding's and output layer's,
    and its loss's two small ones (the maximum, b s fp32, and the two sums, 2 b s); the
    Llama's AutoTP, whose column layers reading one input (q, k, v; gate, up) all-reduce its
    gradient once, as the GPT's fused ones do, with whole embeddings; a recomputed forward's
    again. Each activation all-reduce carries b s h in bf16; the gradient norm's 4 bytes once."""
    for (name, stage, tp, recompute), run in results.items():
        if tp == 1:
            assert not any(key.endswith("/tp") for key in run["collectives"]), name
            continue
        m, micro = _model(name), MICRO.get(name, 1)
        passes, small = tp_collectives(m.layers, recompute, False, m.vocab_parallel)
        act = micro * SEQ * m.hidden * 2
        loss = 3 * micro * SEQ * 4 if small else 0
        want = {
            "count": GAS * (passes // 2 + small) + 1,
            "bytes": GAS * (passes // 2 * act + loss) + 4,
        }
        assert run["collectives"]["all_reduce/tp"] == want, (name, stage, tp, recompute)
        assert {k for k in run["collectives"] if k.endswith("/tp")} == {"all_reduce/tp"}


def test_the_activations_the_forward_keeps_are_the_estimates(results):
    """A census of what autograd saves for backward in the first micro-batch's forward
    (attention and dropout as a GPU's kernels keep them: FlashAttention's output and
    log-sum-exp, 1-byte masks), parameters apart, against ``layer_activation_bytes(flash=True)``
    for the second block and ``stage_activation_bytes`` for the whole forward, to the byte:
    Hugging Face's RMSNorm with its fp32 copy, grouped-query keys and values, SwiGLU's four wide
    tensors, the norms' statistics, the rotary tables, the vocab-parallel masks, the loss's
    fp32 log-probabilities, dropout masks over two sequences. Under full recompute a block keeps
    its input; the estimate's one recomputed layer is held in backward, not the forward."""
    for (name, stage, tp, recompute), run in results.items():
        m, micro = _model(name), MICRO.get(name, 1)
        assert run["flash"], name
        got = run["activations"]
        assert got["layer"] == layer_activation_bytes(
            m, micro, tp=tp, recompute=recompute, flash=True
        ), (name, stage, tp, recompute)
        whole = stage_activation_bytes(m, micro, tp=tp, recompute=recompute, flash=True)
        if recompute == "full":
            whole -= layer_activation_bytes(m, micro, tp=tp, flash=True)
        assert got["forward"] == whole, (name, stage, tp, recompute)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rank", "1024", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "64",
          "--seq", "16"], "PlanError: --rank: 1024 is not in 0..1023"),
        (["--layers", "2"], "PlanError: --hidden: needed for the reference GPT"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line(tmp_path, argv, message):
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"train_batch_size": 1024}')
    code, out, err = run_cli("dryrun", str(cfg), "--world", "1024", *argv)
    assert code == 2 and out == "" and err.startswith(message) and err.count("\n") == 1, err


def test_the_meta_device_is_the_dry_runs_alone():
    """Engines keep their tensors on the meta device only inside on_meta(): a fake process
    group alone (scripts/gpu_check.py's fake-dp8 trains real tensors through one) does not."""
    from zerostack.topology import _META, on_meta

    with on_meta():
        assert _META[0]
    assert not _META[0]
    with pytest.raises(RuntimeError), on_meta():
        raise RuntimeError("a failed dry run")
    assert not _META[0]
