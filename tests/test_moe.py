"""Mixture of experts at ep 1: the gates against a token-by-token spec written here (routing,
capacity, which tokens drop, weights, the auxiliary loss), the layer against a loop over tokens,
the MoE GPT under ZeRO 0, 2 and 3 at dp 2 against single-process training, the optimizer's
parameter groups, refusals.

Gating is per rank (DeepSpeed's): capacity counts the tokens of the rank's micro-batch. The
single-process reference therefore runs each rank's micro-batch through the model on its own
and averages the losses: the same tokens meet the same capacity, so the same tokens drop.
Parity: plain SGD, no clipping, 3 steps, 1e-5 relative per tensor.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

import zerostack
from zerostack.models import GPT, GPTConfig
from zerostack.moe import MoE, split_params_into_different_moe_groups_for_optimizer
from zerostack.moe.sharded_moe import top1gating, top2gating

from tests.support.models import batch, max_rel_diff
from tests.support.ranks import run_distributed

E = 4


def _logits(tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(tokens, E, generator=torch.Generator().manual_seed(seed)) * 2


def spec_gate(logits, k, factor, min_capacity, drop=True):
    """Token by token, in order: each token's k choices (highest probability first; a second
    choice queues behind every first choice); an expert takes a choice while it has a free slot
    (capacity ceil(S / E * factor * k), at least min_capacity; the largest demand when nothing
    drops). Top-1's weight is the probability, top-2's the probability over those of the
    token's kept choices. Returns {(token, expert): (slot, weight)}, the counts before
    dropping, the capacity and the auxiliary loss."""
    probs = torch.softmax(logits.double(), dim=1)
    s = logits.shape[0]
    order = torch.argsort(probs, dim=1, descending=True)
    choices = [[int(order[t, j]) for j in range(k)] for t in range(s)]
    counts = [0] * E
    for t in range(s):
        for e in choices[t]:
            counts[e] += 1
    capacity = max(math.ceil(s / E * factor * k), min_capacity) if drop else max(counts)
    taken, kept = [0] * E, {}
    for j in range(k):  # all first choices, then all second choices
        for t in range(s):
            e = choices[t][j]
            if taken[e] < capacity:
                kept[(t, e)] = taken[e]
                taken[e] += 1
    out = {}
    for t in range(s):
        mine = [e for e in choices[t] if (t, e) in kept]
        # top-2 weights are renormalised over the choices kept (one left: weight 1)
        total = sum(float(probs[t, e]) for e in mine) if k == 2 else 1.0
        for e in mine:
            out[(t, e)] = (kept[(t, e)], float(probs[t, e]) / total)
    first = [choices[t][0] for t in range(s)]
    routed = [first.count(e) / s for e in range(E)]
    mean_prob = probs.mean(dim=0).tolist()
    aux = sum(p * f for p, f in zip(mean_prob, routed, strict=True))
    aux = aux * E if k == 1 else aux / E * E * E
    return out, counts, capacity, aux


def _as_dict(combine):
    nz = combine.nonzero().tolist()
    return {(t, e): (c, float(combine[t, e, c])) for t, e, c in nz}


@pytest.mark.parametrize(
    "k,factor,min_capacity,drop",
    [
        (1, 8.0, 4, True),
        (1, 1.0, 2, True),
        (1, 1.0, 2, False),
        (2, 4.0, 4, True),
        (2, 0.5, 1, True),
    ],
)
def test_gates_route_drop_and_weigh_as_the_spec(k, factor, min_capacity, drop):
    logits = _logits(24)
    if k == 1:
        got = top1gating(logits, factor, min_capacity, drop_tokens=drop, use_rts=False)
    else:
        got = top2gating(logits, factor, min_capacity, drop, top2_2nd_expert_sampling=False)
    l_aux, combine, dispatch, counts = got
    want, want_counts, capacity, want_aux = spec_gate(logits, k, factor, min_capacity, drop)
    assert combine.shape == (24, E, capacity)
    assert torch.equal(dispatch, combine.bool())
    assert counts.tolist() == want_counts
    routed = _as_dict(combine)
    assert routed.keys() == want.keys()
    for key, (slot, weight) in want.items():
        assert routed[key][0] == slot and abs(routed[key][1] - weight) < 1e-6, key
    assert abs(float(l_aux) - want_aux) < 1e-6
    if factor <= 1.0 and drop:
        assert len(routed) < 24 * k  # the case drops tokens
    if not drop:
        assert len(routed) == 24 * k


def test_random_token_selection_keeps_a_capacity_of_each_experts_tokens():
    logits = _logits(40, seed=3)
    torch.manual_seed(0)
    _, combine, _, counts = top1gating(logits, 1.0, 2, use_rts=True)
    capacity = combine.shape[2]
    chosen = torch.argmax(logits, dim=1)
    for e in range(E):
        kept = combine[:, e].sum(dim=1).nonzero().flatten().tolist()
        assert len(kept) == min(int(counts[e]), capacity)
        assert all(int(chosen[t]) == e for t in kept)
        slots = sorted(int(combine[t, e].nonzero()) for t in kept)
        assert slots == list(range(len(kept)))  # the kept tokens fill slots 0.. in order


class _Expert(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = torch.nn.Linear(d, 2 * d)
        self.proj = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


@pytest.mark.parametrize("k,residual", [(1, False), (2, False), (2, True)])
def test_the_layer_is_a_weighted_sum_of_each_tokens_experts(k, residual):
    torch.manual_seed(0)
    d = 8
    moe = MoE(d, _Expert(d), num_experts=E, k=k, capacity_factor=0.75, min_capacity=1,
              use_residual=residual, use_rts=False, top2_2nd_expert_sampling=False)  # fmt: skip
    x = torch.randn(3, 6, d)
    out, l_aux, counts = moe(x)
    tokens = x.reshape(-1, d)
    logits = moe.deepspeed_moe.gate.wg(tokens)
    kept, want_counts, _, want_aux = spec_gate(logits.detach(), k, 0.75, 1)
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    want = torch.zeros_like(tokens)
    for (t, e), (_, w) in kept.items():
        want[t] += w * experts[e](tokens[t])
    if residual:
        coef = torch.softmax(moe.coefficient(tokens), dim=-1)
        want = want * coef[:, :1] + moe.mlp(tokens) * coef[:, 1:]
    assert torch.allclose(out.reshape(-1, d), want, atol=1e-6)
    assert counts.tolist() == want_counts and abs(float(l_aux.detach()) - want_aux) < 1e-6
    assert len(kept) < tokens.shape[0] * k  # some tokens dropped, and still the same output


CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, d_model=32, bias=False,
                moe_every=2, num_experts=E, moe_min_capacity=1)  # fmt: skip
B, STEPS, LR, DP = 8, 3, 0.5, 2


def _cfg(k: int, factor: float) -> GPTConfig:
    import dataclasses

    return dataclasses.replace(CFG, moe_k=k, moe_capacity_factor=factor)


def _distinct_experts(model: GPT, first: int = 0) -> None:
    """Make expert ``first + l`` (the model's local expert l) differ from the others: copies
    of one MLP otherwise, which would hide a token sent to the wrong expert."""
    with torch.no_grad():
        for block in model.blocks:
            if block.l_aux is None and not hasattr(block.mlp, "deepspeed_moe"):
                continue
            for i, expert in enumerate(block.mlp.deepspeed_moe.experts.deepspeed_experts):
                g = torch.Generator().manual_seed(100 + first + i)
                for p in expert.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.02)


def _reference(cfg: GPTConfig, dp: int = DP):
    """Single process: per step, the mean of each rank's micro-batch loss, one SGD step. Also
    the first step's gradient norm."""
    torch.manual_seed(0)
    model = GPT(cfg)
    _distinct_experts(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    per, norm = B // dp, None
    for step in range(STEPS):
        x, y = batch(step, B)
        losses = [model(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]) for r in range(dp)]
        (sum(losses) / dp).backward()
        if norm is None:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.named_parameters()}, norm


def _train(rank, world, cfg, stage):
    torch.manual_seed(0)
    model = GPT(cfg)
    e_local = E // cfg.moe_ep_size
    ep_rank = rank % cfg.moe_ep_size  # ep is inner to dp on the grid (tp is 1 here)
    _distinct_experts(model, first=ep_rank * e_local)
    engine, *_ = zerostack.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": B // world,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "zero_optimization": {
                "stage": stage,
                "reduce_bucket_size": 5000,
                "stage3_param_persistence_threshold": 0,
            },
        },
    )
    topo = engine.topology
    assert (topo.ep, topo.rank("ep"), topo.data_parallel_rank) == (cfg.moe_ep_size, ep_rank, rank)
    per, norm = B // world, None
    for step in range(STEPS):
        x, y = batch(step, B)
        engine.backward(engine(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
        engine.step()
        norm = engine.get_global_grad_norm() if norm is None else norm
    state = {}
    for name, value in engine.full_state_dict().items():  # local expert l is ep_rank * e_local + l
        found = re.match(r"(.*deepspeed_experts\.)(\d+)(\..*)", name)
        if found:
            name = f"{found[1]}{ep_rank * e_local + int(found[2])}{found[3]}"
        state[name] = value
    engine.destroy()
    return state, norm


@pytest.mark.distributed
@pytest.mark.parametrize(
    "k,factor,stage",
    [(1, 4.0, 0), (1, 0.5, 2), (2, 4.0, 3), (2, 0.5, 0)],
    ids=["top1-stage0", "top1-drops-stage2", "top2-stage3", "top2-drops-stage0"],
)
def test_moe_gpt_matches_single_process(k, factor, stage):
    cfg = _cfg(k, factor)
    ref, _ = _reference(cfg)
    for state, _ in run_distributed(_train, DP, args=(cfg, stage)):
        diff, name = max_rel_diff(state, ref)
        assert diff <= 1e-5, f"{name}: relative difference {diff:.2e}"


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world,ep,k,factor,stage",
    [(2, 2, 1, 0.5, 0), (2, 2, 2, 4.0, 2), (4, 2, 1, 0.5, 1), (4, 2, 2, 0.5, 2),
     (4, 4, 1, 0.5, 2), (4, 4, 2, 0.5, 0), (4, 2, 2, 0.5, 3), (4, 4, 1, 0.5, 3)],
    ids=["ep2-top1-drops-stage0", "ep2-top2-stage2", "dp2xep2-top1-drops-stage1",
         "dp2xep2-top2-drops-stage2", "ep4-top1-drops-stage2", "ep4-top2-drops-stage0",
         "dp2xep2-top2-drops-stage3", "ep4-top1-drops-stage3"],
)  # fmt: skip
@pytest.mark.slow
def test_expert_parallel_gpt_matches_single_process(world, ep, k, factor, stage):
    """Experts split over 2 ep ranks (alone, and beside dp 2) and over 4 (one each): every
    rank's weights, its experts renamed to their global index, are the single-process run's;
    the gradient norm counts the shared parameters once and every expert once."""
    import dataclasses

    cfg = dataclasses.replace(_cfg(k, factor), moe_ep_size=ep)
    ref, ref_norm = _reference(dataclasses.replace(cfg, moe_ep_size=1), dp=world)
    results = run_distributed(_train, world, args=(cfg, stage))
    merged = {}
    for state, norm in results:
        for name, value in state.items():
            if name in merged:  # held by several ranks: alike
                assert torch.equal(merged[name], value), name
            merged[name] = value
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (norm, ref_norm)
    diff, name = max_rel_diff(merged, ref)
    assert diff <= 1e-5, f"{name}: relative difference {diff:.2e}"


@pytest.mark.distributed
@pytest.mark.parametrize("stage,megatron_sp", [(0, False), (2, False), (1, True), (3, True)])
def test_expert_parallel_gpt_beside_tensor_parallelism_matches_single_process(stage, megatron_sp):
    """ep 2 x tp 2 (the composition matrix's row, alone): attention and dense MLPs split over
    tp, each MoE block's experts replicated over it and split over ep; the loss carries the
    auxiliary loss under tp as without it. With Megatron's sequence parallelism each tp rank
    routes its own part of the sequence (the reference gates each part apart), the gate's and
    experts' gradients summed over tp, the auxiliary loss the parts' mean."""
    from tests.support.matrix import Combo, measure

    combo = Combo(pp=1, dp=1, ep=2, tp=2, sp=1, megatron_sp=megatron_sp, schedule="",
                  stage=stage, precision="fp32", offload="none")  # fmt: skip
    assert measure([combo])[1] == [("works", "")]


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 3])
def test_expert_parallel_gpt_with_ulysses_matches_single_process(stage):
    """dp 2 (sp 2 inside) x ep 2: each sp rank routes its own sequence shard's tokens (gates,
    capacity and auxiliary loss per rank); the reference runs each shard through the gates
    apart (tests/support/matrix.py)."""
    from tests.support.matrix import Combo, measure

    combo = Combo(pp=1, dp=2, ep=2, tp=1, sp=2, megatron_sp=False, schedule="", stage=stage,
                  precision="fp32", offload="none")  # fmt: skip
    assert measure([combo])[1] == [("works", "")]


@pytest.mark.distributed
@pytest.mark.parametrize("schedule,stage", [("1f1b", 1), ("interleaved", 3)])
def test_expert_parallel_gpt_under_a_pipeline_matches_single_process(schedule, stage):
    """pp 2 x ep 2: each stage's MoE blocks exchange tokens over its own ep group, and their
    auxiliary losses join the loss's backward on whichever stage they are (1F1B: a MoE block
    on each stage; interleaved: a stage without any, and one on the last chunk)."""
    from tests.support.matrix import Combo, measure

    combo = Combo(pp=2, dp=1, ep=2, tp=1, sp=1, megatron_sp=False, schedule=schedule,
                  stage=stage, precision="fp32", offload="none")  # fmt: skip
    assert measure([combo])[1] == [("works", "")]


@pytest.mark.distributed
@pytest.mark.parametrize("schedule,stage", [("1f1b", 1), ("interleaved", 3)])
def test_megatron_sp_beside_experts_under_a_pipeline_on_8_ranks(schedule, stage):
    """pp 2 x ep 2 x tp 2 with Megatron's sequence parallelism: each stage's MoE blocks route
    each tp rank's part of the sequence; a block's auxiliary loss (its ``side_loss``) is the
    parts' mean, as the GPT's own."""
    from tests.support.matrix import Combo, measure

    combo = Combo(pp=2, dp=1, ep=2, tp=2, sp=1, megatron_sp=True, schedule=schedule,
                  stage=stage, precision="fp32", offload="none")  # fmt: skip
    assert measure([combo], world=8)[1] == [("works", "")]


def _ep2(**zero):
    """The MoE GPT at ep 2 (seeded) and a config with these zero_optimization keys."""
    import dataclasses

    cfg = dataclasses.replace(_cfg(1, 1.0), moe_ep_size=2)
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": zero,
    }
    return GPT(cfg), config


def _refusal(model, config) -> str | None:
    """What ``initialize`` refuses, as worded (None: it accepts)."""
    try:
        zerostack.initialize(model=model, config=config)
    except zerostack.ConfigError as exc:
        return str(exc)
    return None


def _hpz_with_ep(rank, world):
    return _refusal(*_ep2(stage=3, zero_hpz_partition_size=2))


@pytest.mark.distributed
def test_hpz_beside_expert_parallelism_is_refused():
    assert run_distributed(_hpz_with_ep, 4) == [
        "zero_optimization.zero_hpz_partition_size with MoE ep_size 2: hpZ's secondary "
        "partitions are not built beside expert parallelism yet"
    ] * 4


def _zero_init_with_ep(rank, world):
    import dataclasses

    config = _ep2(stage=3)[1]
    with zerostack.zero.Init(config_dict_or_path=config):
        model = GPT(dataclasses.replace(_cfg(1, 0.5), moe_ep_size=2))
    return _refusal(model, config)


@pytest.mark.distributed
def test_a_moe_model_built_under_zero_init_is_refused():
    """A MoE model built under zero.Init (at ep 1 too) fails in its first forward, a gate's
    weight read ungathered: refused at initialize, with the way round."""
    assert run_distributed(_zero_init_with_ep, 2) == [
        "zero.Init with a MoE model: a gate's weight is read before zero.Init's pieces are "
        "gathered (not yet); build the model outside zero.Init"
    ] * 2


def _zero_init_on_another_grid(rank, world):
    from tests.support.models import tiny_gpt

    config = _ep2(stage=3)[1]
    with zerostack.zero.Init(topology=zerostack.Topology.build(tp=2)):  # cut over 2 ranks
        model = tiny_gpt()
    return _refusal(model, config)  # dp 4


@pytest.mark.distributed
def test_pieces_cut_over_other_ranks_than_the_grids_are_refused():
    for said in run_distributed(_zero_init_on_another_grid, 4):
        assert said == (
            "zero.Init with this grid (ep 1, tp 1, pp 1): it cut each parameter over 2 ranks, "
            "the grid's ZeRO-3 over 4; build the model outside zero.Init, or give zero.Init "
            "this grid's topology"
        ), said


def test_the_loss_carries_the_auxiliary_loss_and_drops_happen_where_asked():
    torch.manual_seed(0)
    model = GPT(_cfg(1, 0.5))
    x, y = batch(0, 4)
    loss = model(x, y)
    moe = model.blocks[1].mlp.deepspeed_moe
    logits = model(x)
    ce = F.cross_entropy(logits.flatten(0, -2), y.reshape(-1))
    assert abs(float(loss - ce) - 0.01 * float(moe.l_aux)) < 1e-6
    capacity = math.ceil(4 * 16 / E * 0.5)
    assert int(moe.exp_counts.max()) > capacity  # an expert overflowed: tokens dropped
    assert model.blocks[0].l_aux is None  # the first block is dense


def test_expert_parameters_get_groups_of_their_own():
    torch.manual_seed(0)
    model = GPT(CFG)
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"name": "all", "params": list(model.parameters()), "lr": 0.1}]
    )
    assert [g["name"] for g in groups] == ["all", "ep_size_1"]  # DeepSpeed 0.19's name
    assert list(groups[1]) == ["name", "params", "lr", "moe"]  # in DeepSpeed's order
    assert groups[1]["moe"] is True and groups[1]["lr"] == 0.1
    experts = {id(p) for p in model.blocks[1].mlp.deepspeed_moe.experts.parameters()}
    assert {id(p) for p in groups[1]["params"]} == experts
    assert len(groups[0]["params"]) + len(experts) == len(list(model.parameters()))
    with pytest.raises(ValueError, match=r"param_groups\[0\]: has no 'name'"):
        split_params_into_different_moe_groups_for_optimizer([{"params": []}])


def _bf16(rank, world):
    import dataclasses

    cfg = dataclasses.replace(_cfg(2, 1.0), moe_ep_size=2)
    torch.manual_seed(0)
    engine, *_ = zerostack.initialize(
        model=GPT(cfg),
        config={
            "train_micro_batch_size_per_gpu": 4,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
            "zero_optimization": {"stage": 2},
        },
    )
    losses = []
    for step in range(12):
        x, y = batch(step % 2 * 10 + rank, 4)  # two batches a rank, again and again
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    gate = engine.module.blocks[1].mlp.deepspeed_moe.gate.wg.weight
    return losses, gate.dtype


@pytest.mark.distributed
def test_bf16_expert_parallel_training_learns():
    """bf16 at ep 2 (stage 2): the gate computes in the model's dtype, its logits and the
    routing in fp32, and the loss on the same two batches falls."""
    for losses, dtype in run_distributed(_bf16, 2):
        assert dtype == torch.bfloat16
        assert all(math.isfinite(x) for x in losses)
        assert losses[-1] < losses[0] - 0.5, losses


def _ep_does_not_divide(rank, world):
    import dataclasses

    from zerostack.config import ConfigError

    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CFG, moe_ep_size=4))
    sgd = {"type": "SGD", "params": {"lr": 0.1}}
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": sgd}
    try:
        zerostack.initialize(model=model, config=config)
    except ConfigError as e:
        return str(e)


@pytest.mark.distributed
def test_an_ep_size_that_does_not_divide_the_ranks_is_refused():
    for message in run_distributed(_ep_does_not_divide, 2):
        assert message == (
            "MoE ep_size: 4 does not divide the data-parallel ranks, world 2 / (tp 1 * pp 1)"
        )


def test_what_is_not_built_is_refused():
    with pytest.raises(ValueError, match="MoE: num_experts 3 does not split into ep_size 2"):
        MoE(8, _Expert(8), num_experts=3, ep_size=2)
    with pytest.raises(ValueError, match="MoE: k 3: only top-1 and top-2"):
        MoE(8, _Expert(8), num_experts=4, k=3)
    with pytest.raises(ValueError, match="moe_every does not combine with checkpoint_every"):
        GPTConfig(moe_every=1, num_experts=2, checkpoint_every=1)


def _ep_bytes(rank, world):
    model, config = _ep2(stage=2)
    engine, *_ = zerostack.initialize(model=model, config=config)
    log = engine.comm.log
    x, y = batch(rank, 2)
    first = len(log.records)
    engine.backward(engine(x, y))
    engine.step()
    exchanged = [(r.axis, r.bytes) for r in log.records[first:] if r.op == "all_to_all"]
    moe = engine.module.blocks[1].mlp.deepspeed_moe
    expert_bytes = sum(p.numel() * p.element_size() for p in moe.experts.parameters())
    engine.destroy()
    return exchanged, expert_bytes


@pytest.mark.distributed
def test_expert_parallel_bytes_and_memory():
    """ep 2: per MoE layer, forward and backward each exchange the dispatched slots and the
    outputs (experts x capacity x d_model floats a rank, each way); each rank holds half of
    the experts' bytes."""
    results = run_distributed(_ep_bytes, 2)
    tokens = 2 * CFG.block_size  # a rank's micro-batch
    capacity = max(math.ceil(tokens / E * 1.0), CFG.moe_min_capacity)
    slots = E * capacity * CFG.d_model * 4
    whole = sum(  # every expert of the layer, as one rank holds them at ep 1
        p.numel() * 4 for p in GPT(CFG).blocks[1].mlp.deepspeed_moe.experts.parameters()
    )
    for exchanged, expert_bytes in results:
        assert exchanged == [("ep", slots)] * 4  # dispatch, combine; their backwards
        assert 2 * expert_bytes == whole  # half the experts on each of 2 ep ranks


def _engine_at(ep: int, stage: int):
    import dataclasses

    cfg = dataclasses.replace(_cfg(2, 0.5), moe_ep_size=ep)
    torch.manual_seed(0)
    model = GPT(cfg)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
    }
    return zerostack.initialize(model=model, config=config)[0]


def _train_step(engine, step: int) -> None:
    x, y = batch(step * 10 + engine.topology.data_parallel_rank, 2)
    engine.backward(engine(x, y))
    engine.step()


def _ep_checkpoint(rank, world, root, saved_at, loaded_at):
    """Train at ep 2 (dp 2) at ZeRO stage ``saved_at``, save; the next step's weights; then the
    same step after loading at ep 2 at stage ``loaded_at``; and one loss on a fixed batch after
    loading at ep 1, 2 and 4."""
    engine = _engine_at(2, saved_at)
    for step in range(2):
        _train_step(engine, step)
    engine.save_checkpoint(root, tag="ep2")
    probe = batch(99, 2)
    with torch.no_grad():
        saved_loss = float(engine(*probe))
    _train_step(engine, 2)
    after = engine.full_state_dict()
    engine.destroy()
    engine = _engine_at(2, loaded_at)  # another stage, the same ep: the next step is the same
    engine.load_checkpoint(root, tag="ep2")
    _train_step(engine, 2)
    resumed = engine.full_state_dict()
    engine.destroy()
    losses = {}
    for ep in (1, 2, 4):
        engine = _engine_at(ep, loaded_at)
        engine.load_checkpoint(root, tag="ep2", load_optimizer_states=False)
        with torch.no_grad():
            losses[ep] = float(engine(*probe))
        engine.destroy()
    # custom_load_fn at ep 2 and 4: src is this rank's module's own state (its experts under
    # their local index), which load_state_dict takes as it is
    for ep in (2, 4):
        engine = _engine_at(ep, loaded_at)
        keys = []

        def custom(src, dst, keys=keys):
            keys.append(sorted(src) == sorted(dst.state_dict()))
            dst.load_state_dict(src)

        engine.load_checkpoint(root, tag="ep2", load_optimizer_states=False, custom_load_fn=custom)
        with torch.no_grad():
            losses[f"custom ep {ep}"] = float(engine(*probe))
        engine.destroy()
        assert keys == [True], keys
    return saved_loss, losses, max_rel_diff(resumed, after)[0]


@pytest.mark.distributed
@pytest.mark.parametrize("saved_at,loaded_at", [(2, 3), (3, 1)])
def test_an_ep_checkpoint_resumes_and_loads_at_ep_1_and_4(tmp_path, saved_at, loaded_at):
    """Experts are saved under their global index: an ep 2 checkpoint resumes (at another ZeRO
    stage, 3 among them), and loads at ep 1 (every rank every expert) and ep 4 (one each) to the
    same model, also through a ``custom_load_fn`` at ep 2 and 4."""
    for saved_loss, losses, resumed_diff in run_distributed(
        _ep_checkpoint, 4, args=(str(tmp_path), saved_at, loaded_at)
    ):
        assert resumed_diff <= 1e-6, resumed_diff
        for ep, loss in losses.items():
            assert abs(loss - saved_loss) <= 1e-6 * saved_loss, (ep, loss, saved_loss)


def _ep_reductions(rank, world, stage):
    from collections import Counter

    from zerostack.utils import safe_get_full_fp32_param, safe_get_full_grad

    model, config = _ep2(stage=stage, reduce_bucket_size=2000)  # a few buckets
    config["gradient_accumulation_steps"] = 2
    engine, *_ = zerostack.initialize(model=model, config=config)
    log = engine.comm.log
    first = log.count
    for m in range(2):
        x, y = batch(2 * m + rank, 2)
        engine.backward(engine(x, y))
        if m == 1:  # between backward and step: the window's whole gradient, ep-averaged
            read = log.count
            grad = safe_get_full_grad(engine.module.wpe.weight)
            reading = range(read, log.count)  # the read's own collectives are not the step's
        engine.step()
    calls = Counter(
        (r.op, r.axis)
        for r in log.since(first)
        if r.op in ("all_reduce", "reduce_scatter") and r.seq not in reading
    )
    shared = [fg for fg in engine.zero.flat.groups if fg.cut.axis == "dp_ep"]
    assert {p for fg in shared for p in fg.params} == engine.replicas.ep_shared
    buckets = sum(len(fg.buckets) for fg in shared)
    n_shared = len(engine.replicas.ep_shared)
    weight = engine.module.wpe.weight  # whole on every rank (stages 0-2), its state cut
    read = safe_get_full_fp32_param(weight)
    assert torch.equal(read, weight.detach()), float((read - weight).abs().max())
    engine.destroy()
    return calls, buckets, n_shared, grad


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_shared_gradients_are_reduced_over_dp_and_ep_at_once_in_buckets(stage):
    """At ep 2 (dp 1) the gradients every ep rank holds are reduced over the dp x ep ranks in
    one collective per bucket: all-reduced (stage 0) or reduce-scattered (stages 1-2) once per
    window, at every micro-step at stage 2 (2 here); the experts' (dp 1) are not reduced at
    all, and over ep alone only the gradient norm is summed. A shared parameter's gradient read
    before the step is the average over ep (the same on both ranks, which read different
    batches). Its fp32 master read whole (safe_get_full_fp32_param) is the parameter."""
    results = run_distributed(_ep_reductions, 2, args=(stage,))
    for calls, buckets, n_shared, _ in results:
        assert 1 < buckets < n_shared, (buckets, n_shared)  # bucketed, not per parameter
        reduce = "all_reduce" if stage == 0 else "reduce_scatter"
        want = {(reduce, "dp_ep"): buckets * (2 if stage == 2 else 1), ("all_reduce", "ep"): 1}
        if stage > 0:  # the norm of sharded gradients: summed over dp (of 1) and ep
            want[("all_reduce", "dp")] = 1
        assert calls == want, (calls, want)
    assert torch.equal(results[0][3], results[1][3])


def _ep_census(rank, world, stage):
    from zerostack.moe import is_moe_param

    from tests.support import census

    before = census.baseline()
    model, config = _ep2(stage=stage)
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    engine, *_ = zerostack.initialize(model=model, config=config)
    x, y = batch(rank, 2)
    engine.backward(engine(x, y))
    engine.step()
    held = census.take(engine, exclude=before).bytes
    params = list(engine.module.parameters())
    shared = sum(p.numel() for p in params if not is_moe_param(p))
    experts = sum(p.numel() for p in params if is_moe_param(p))  # this ep rank's
    masters = len(engine.zero.masters())
    engine.destroy()
    return held, shared, experts, masters


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 2])
def test_no_rank_holds_the_shared_state_twice_at_ep_2(stage):
    """dp 2 x ep 2, AdamW in fp32: a census of live storage finds on each rank the optimizer
    state (two fp32 moments) of a quarter of the parameters every ep rank holds and of half of
    its own experts: the shared state is cut over all 4 ranks, as DeepSpeed's data-parallel
    group does, not held by both ep ranks. At stage 2 the gradients held are the same pieces
    (fp32). Slack: a piece's padding (< 8 elements a master) and Adam's step counters."""
    for held, shared, experts, masters in run_distributed(_ep_census, 4, args=(stage,)):
        piece = shared / 4 + experts / 2  # elements of this rank's masters
        assert 8 * piece <= held["optimizer"] <= 8 * (piece + 8 * masters) + 4 * masters, (
            held,
            piece,
        )
        if stage == 2:
            assert 4 * piece <= held["grads"] <= 4 * (piece + 8 * masters), (held, piece)
