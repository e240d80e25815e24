"""The GPT as a PipelineModule, alone and on the full pp x dp x tp grid, against single-process
fp32 training; partitioning; the engine's pipeline API.

Parity tolerance 1e-5 relative per tensor after 5 AdamW steps with clipping: the pipeline changes
where layers run and how the batch's gradient is summed (micro-batch by micro-batch), ~1e-7 per
step in fp32.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerostack
from zerostack import ConfigError, Topology
from zerostack.models import GPTConfig
from zerostack.models.gpt_pipe import GPTLoss, gpt_layers, load_plain_state, plain_name
from zerostack.pipeline import LayerSpec, PipelineEngine, PipelineModule, partition_layers

from tests.support.models import batch, max_rel_diff, reference_train, tiny_gpt
from tests.support.ranks import run_distributed

CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=4, d_model=32, bias=False)
STEPS, B, GAS, CLIP = 5, 8, 4, 0.5


def _config(micro: int, stage: int, **pipeline) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000},
        "pipeline": pipeline,
    }


def _micro_batches(step: int, topo: Topology, micro: int):
    x, y = batch(step, B)
    for m in range(GAS):
        lo = (m * topo.dp + topo.dp_rank) * micro
        yield x[lo : lo + micro], y[lo : lo + micro]


def _train(rank, world, pp, tp, stage, schedule, chunks=1, sp=False, interval=0):
    topo = Topology.build(pp=pp, tp=tp)
    layers = gpt_layers(CFG, topology=topo, sequence_parallel=sp)
    model = PipelineModule(
        layers,
        topology=topo,
        loss_fn=GPTLoss(topo),
        partition_method="type:Block",
        virtual_stages=chunks,
        activation_checkpoint_interval=interval,
    )
    load_plain_state(model, tiny_gpt(cfg=CFG).state_dict(), CFG)
    micro = B // (topo.dp * GAS)
    engine, *_ = zerostack.initialize(
        model=model,
        config=_config(micro, stage, schedule=schedule, virtual_stages=chunks),
    )
    losses = []
    for step in range(STEPS):
        losses.append(engine.train_batch(_micro_batches(step, topo, micro)).item())
    state = {plain_name(k, CFG): v for k, v in engine.full_state_dict().items()}
    return state, losses, topo.rank("pp")


def _merged(results) -> dict[str, torch.Tensor]:
    """The whole model from every stage's parameters (the tied embedding from stage 0)."""
    out: dict[str, torch.Tensor] = {}
    for state, _, _ in sorted(results, key=lambda r: r[2]):
        for k, v in state.items():
            out.setdefault(k, v)
    return out


def _reference_losses() -> list[float]:
    model = tiny_gpt(cfg=CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, B)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world,pp,tp,stage,schedule,chunks,extra",
    [
        (2, 2, 1, 0, "gpipe", 1, {}),
        (2, 2, 1, 0, "1f1b", 1, {}),
        (2, 2, 1, 0, "interleaved", 2, {}),
        (4, 4, 1, 0, "gpipe", 1, {}),
        (4, 4, 1, 0, "1f1b", 1, {}),
        (4, 4, 1, 0, "interleaved", 2, {}),
        (4, 2, 1, 1, "1f1b", 1, {}),
        (4, 2, 1, 2, "1f1b", 1, {}),
        (4, 2, 2, 0, "1f1b", 1, {}),
        (4, 2, 2, 0, "interleaved", 2, {"sp": True, "interval": 1}),
        (8, 2, 2, 1, "1f1b", 1, {}),
    ],
)
@pytest.mark.slow
def test_gpt_pipeline_matches_single_process(world, pp, tp, stage, schedule, chunks, extra):
    ref = reference_train(STEPS, B, clip=CLIP, cfg=CFG)
    results = run_distributed(_train, world, args=(pp, tp, stage, schedule, chunks), kwargs=extra)
    diff, name = max_rel_diff(_merged(results), ref)
    assert diff <= 1e-5, f"{name}: relative difference {diff:.2e}"
    ref_losses = _reference_losses()
    for _, losses, _ in results:  # the batch's mean loss, on every stage
        assert losses == pytest.approx(ref_losses, rel=1e-5)
    # the tied embedding (and its gradient) stayed equal on the first and last stage
    first = [r[0] for r in results if r[2] == 0][0]
    last = [r[0] for r in results if r[2] == pp - 1][0]
    assert torch.equal(first["wte.weight"], last["wte.weight"])


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_gpt_pipeline_under_zero3_matches_single_process(schedule):
    """pp 2 x dp 2 at ZeRO stage 3 (the composition matrix's row, alone): each stage gathers its
    layers' pieces per micro-batch, reduces each backward's gradients into its pieces, and the
    tied embedding's pieces are summed between the first and the last stage."""
    from tests.support.matrix import Combo, measure

    combo = Combo(pp=2, dp=2, ep=1, tp=1, sp=1, megatron_sp=False, schedule=schedule, stage=3,
                  precision="fp32", offload="none")  # fmt: skip
    assert measure([combo])[1] == [("works", "")]


def _mixed(rank, world, precision, stage):
    topo = Topology.build(pp=2)
    model = PipelineModule(
        gpt_layers(CFG), topology=topo, loss_fn=GPTLoss(), partition_method="type:Block"
    )
    load_plain_state(model, tiny_gpt(cfg=CFG).state_dict(), CFG)
    micro = B // (topo.dp * GAS)
    cfg = {**_config(micro, stage), precision: {"enabled": True}, "gradient_clipping": 1.0}
    cfg["optimizer"]["params"]["lr"] = 3e-3
    engine, *_ = zerostack.initialize(model=model, config=cfg)
    losses = [engine.train_batch(_micro_batches(s % 2, topo, micro)).item() for s in range(8)]
    dtypes = {p.dtype for p in model.parameters()}
    return losses, dtypes, engine.loss_scale


@pytest.mark.distributed
@pytest.mark.parametrize("precision,world,stage", [("bf16", 2, 0), ("fp16", 4, 2)])
def test_pipeline_trains_in_mixed_precision(precision, world, stage):
    results = run_distributed(_mixed, world, args=(precision, stage))
    losses, dtypes, _ = results[0]
    assert dtypes == {torch.bfloat16 if precision == "bf16" else torch.float16}
    assert all(r[0] == losses for r in results)  # the same mean loss on every stage and dp rank
    assert sum(losses[-2:]) < sum(losses[:2]) - 0.3, losses


# ------------------------------------------------------------------------ partitioning
class Block(nn.Linear):
    pass


class Other(nn.Linear):
    pass


def test_partition_methods():
    layers = [
        LayerSpec(Other, 4, 100),
        *[LayerSpec(Block, 10, 10) for _ in range(6)],
        LayerSpec(Other, 10, 4),
    ]
    # type:Block: two blocks a stage; the weightless ends go to the first and last stage
    assert partition_layers(layers, 3, "type:Block") == [0, 3, 5, 8]
    assert partition_layers(layers, 4, "uniform") == [0, 2, 4, 6, 8]
    # parameters: 500, 110 x 6, 44 -> the heaviest stage is as light as it can be
    bounds = partition_layers(layers, 2, "parameters")
    counts = [500, *[110] * 6, 44]
    loads = [sum(counts[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    assert bounds == [0, 2, 8] and max(loads) == 610  # 500 + 110 | 5 x 110 + 44
    assert partition_layers(layers, 2, [0, 1, 8]) == [0, 1, 8]


@pytest.mark.parametrize(
    "parts,method,message",
    [
        (9, "uniform", "partition: 9 stages (x virtual stages) but only 8 layers"),
        (2, "best", "partition_method: 'best' is not one of"),
        (2, "type:Attention", "no layer's class matches 'Attention'"),
        (2, [0, 8, 8], "must rise strictly from 0 to 8 in 3 steps"),
    ],
)
def test_partition_errors(parts, method, message):
    layers = [LayerSpec(Block, 2, 2) for _ in range(8)]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        partition_layers(layers, parts, method)


def _errors(rank, world):
    topo = Topology.build(pp=2)
    layers = gpt_layers(CFG)
    model = PipelineModule(layers, topology=topo, loss_fn=GPTLoss())
    out = {}
    for name, cfg in {
        "stages": _config(2, 0, stages=4),
        "chunks": _config(2, 0, schedule="interleaved", virtual_stages=2),
    }.items():
        try:
            zerostack.initialize(model=model, config=cfg)
        except ConfigError as exc:
            out[name] = str(exc)
    engine, *_ = zerostack.initialize(model=model, config=_config(1, 0))
    for name, call in {
        "forward": lambda: engine(torch.zeros(1, 4, dtype=torch.long)),
        "backward": lambda: engine.backward(torch.zeros(())),
        "step": engine.step,
    }.items():
        try:
            call()
        except RuntimeError as exc:
            out[name] = str(exc)
    out["kind"] = (
        isinstance(engine, PipelineEngine),
        engine.is_first_stage(),
        engine.is_last_stage(),
    )
    out["eval"] = engine.eval_batch(_micro_batches(0, topo, 2)).item()
    return out


class _Experts(nn.Module):
    """A layer holding a MoE of 2 experts split over 2 ep ranks (the grid has no ep axis)."""

    def __init__(self):
        super().__init__()
        from zerostack.moe import MoE

        self.moe = MoE(8, nn.Linear(8, 8), num_experts=2, ep_size=2)

    def forward(self, x):
        return self.moe(x)[0]


def _refused_on_one_stage(rank, world):
    topo = Topology.build(pp=2)
    layers = [LayerSpec(nn.Linear, 8, 8), LayerSpec(_Experts)]
    model = PipelineModule(layers, topology=topo, loss_fn=lambda out, y: out.sum())
    try:
        zerostack.initialize(model=model, config=_config(1, 0))
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.distributed
def test_a_refusal_on_one_stage_is_every_stages():
    """Only the second stage holds a MoE layer whose ep_size the grid lacks: both stages raise
    its refusal at initialize (the first went on into the engine and waited there)."""
    out = run_distributed(_refused_on_one_stage, 2, timeout=60)
    assert out == ["MoE ep_size: the model's layers have 2, the topology ep 1"] * 2


@pytest.mark.distributed
def test_pipeline_engine_errors_and_eval():
    out = run_distributed(_errors, 2)
    assert out[0]["stages"] == "pipeline.stages: 4 but the PipelineModule has 2 stages"
    assert out[0]["chunks"] == "pipeline.virtual_stages: 2 but the PipelineModule has 1"
    for call in ("forward", "backward", "step"):
        assert out[0][call] == "pipeline engine: use engine.train_batch() / engine.eval_batch()"
    assert [o["kind"] for o in out] == [(True, True, False), (True, False, True)]
    assert out[0]["eval"] == out[1]["eval"] and 5.0 < out[0]["eval"] < 6.0  # ~ln(256), untrained


def _shape_batches(rank, world):
    from zerostack.comm import Comm

    calls, p2p = [], Comm.p2p

    def recording(self, ops, *, axis="pp"):
        calls.append([kind for kind, _, _ in ops])
        return p2p(self, ops, axis=axis)

    Comm.p2p = recording
    try:
        state, losses, stage = _train(rank, world, 2, 1, 1, "1f1b")
    finally:
        Comm.p2p = p2p
    return stage, calls


@pytest.mark.distributed
def test_each_p2p_batch_is_mirrored_by_its_peer():
    """Every batch of point-to-point ops one stage posts is posted as the same batch on the
    other side (its sends the peer's receives, batch for batch; the order within a batch is
    free, NCCL groups it): the shape handshake sent header and payload in one batch while the
    receiver took them in two."""
    (_, first), (_, second) = sorted(run_distributed(_shape_batches, world=2))
    mirror = {"send": "recv", "recv": "send"}
    assert first and [sorted(mirror[k] for k in b) for b in first] == [sorted(b) for b in second]


def _plain_engine(rank, world):
    engine, *_ = zerostack.initialize(
        model=tiny_gpt(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    return isinstance(engine, PipelineEngine), engine.is_first_stage(), engine.is_last_stage()


@pytest.mark.distributed
def test_only_an_engine_with_a_pipeline_is_a_pipeline_engine():
    """``PipelineEngine`` is DeepSpeed's name: ``isinstance`` holds for an engine whose runner is
    a pipeline's; a plain engine is one stage, first and last; nothing builds one directly."""
    assert run_distributed(_plain_engine, 1) == [(False, True, True)]
    with pytest.raises(TypeError, match="builds it for a PipelineModule"):
        PipelineEngine()


def _reshaped(rank, world):
    import zerostack.compat.deepspeed as deepspeed

    topo = Topology.build(pp=2)
    model = PipelineModule(gpt_layers(CFG), topology=topo, loss_fn=GPTLoss(topo))
    load_plain_state(model, tiny_gpt(cfg=CFG).state_dict(), CFG)
    engine, *_ = deepspeed.initialize(model=model, config=_config(B // GAS, 0))
    plain, out = tiny_gpt(cfg=CFG), []
    for step, block in enumerate((16, 8, 16)):
        x, y = batch(step, B, block)
        engine.reset_activation_shape()
        got = engine.eval_batch(iter([(x[i::GAS], y[i::GAS]) for i in range(GAS)])).item()
        with torch.no_grad():
            out.append((got, plain(x, y).item()))
    x, y = batch(3, B, 8)
    engine.reset_activation_shape()
    got = engine.train_batch(iter([(x[i::GAS], y[i::GAS]) for i in range(GAS)])).item()
    with torch.no_grad():
        out.append((got, plain(x, y).item()))
    return out


@pytest.mark.distributed
def test_reset_activation_shape_lets_the_next_batch_change_shape():
    """DeepSpeed's ``engine.reset_activation_shape()`` (its variable-batch example calls it
    before each batch): the stages learn the boundary shapes again, so batches of 16, 8 and 16
    tokens each give one process's loss (the stages would refuse the second otherwise)."""
    for got, want in run_distributed(_reshaped, 2)[1]:
        assert abs(got - want) <= 1e-5 * abs(want)
