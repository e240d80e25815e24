"""The GPT under tensor (and sequence) parallelism, alone and with ZeRO over dp, against
single-process fp32 training; its communication per layer; its random streams.

Parity tolerance 1e-5 relative per tensor after 5 AdamW steps with clipping on, as for data
parallelism: the split layers only regroup floating-point sums (~1e-7 per step).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerostack
from zerostack import ConfigError, Topology
from zerostack.checkpointing import checkpoint
from zerostack.comm.grid import comm_for
from zerostack.models import GPT, GPTConfig
from zerostack.models.gpt_tp import join_state_dicts, split_state_dict, tp_spec
from zerostack.plan.cost import tp_collectives
from zerostack.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    get_rng_tracker,
    model_parallel_seed,
    partition_spec,
)

from tests.support.models import batch, max_rel_diff, reference_train, tiny_gpt
from tests.support.ranks import run_distributed

pytestmark = pytest.mark.distributed  # every test here starts ranks

# 4 heads so that tp = 4 keeps one head per rank; no biases (see common.TINY).
CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, d_model=32, bias=False)
STEPS, B, CLIP = 5, 8, 0.5


def _config(micro: int, stage: int, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 5000,
            "stage3_param_persistence_threshold": 0,
        },
        **extra,
    }


def _train(rank, world, tp, stage, sp=False, via_config=False):
    if via_config:  # a plain model, split by initialize from tensor_parallel.autotp_size
        model, topo = tiny_gpt(cfg=CFG), None
        extra = {"tensor_parallel": {"autotp_size": tp}}
    else:
        topo = Topology.build(tp=tp)
        torch.manual_seed(0)
        model, extra = GPT(CFG, topology=topo, sequence_parallel=sp), {}
    dp = world // tp
    engine, *_ = zerostack.initialize(
        model=model, topology=topo, config=_config(B // dp, stage, **extra)
    )
    topo = engine.topology
    per = B // dp
    norms = []
    for step in range(STEPS):
        x, y = batch(step, B)
        lo = topo.dp_rank * per
        engine.backward(engine(x[lo : lo + per], y[lo : lo + per]))
        engine.step()
        norms.append(engine.get_global_grad_norm())
    state = engine.full_state_dict()
    return (state, norms) if rank == 0 else None


def _reference_norm() -> float:
    model = tiny_gpt(cfg=CFG)
    x, y = batch(0, B)
    model(x, y).backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))


@pytest.mark.parametrize(
    "world,tp,stage,sp",
    [
        (2, 2, 0, False),
        (4, 4, 0, False),
        (2, 2, 0, True),
        (4, 2, 1, False),
        (4, 2, 2, False),
        (4, 2, 3, False),
        (4, 2, 2, True),
        (4, 2, 3, True),
    ],
)
@pytest.mark.slow
def test_gpt_matches_single_process(world, tp, stage, sp):
    ref = reference_train(STEPS, B, clip=CLIP, cfg=CFG)
    state, norms = run_distributed(_train, world, args=(tp, stage, sp))[0]
    diff, name = max_rel_diff(state, ref)
    assert diff <= 1e-5, f"{name}: relative difference {diff:.2e}"
    # The first step's norm is the reference's: tp-split parameters counted once per slice,
    # replicated ones once in all (not once per tp rank).
    ref_norm = _reference_norm()
    assert abs(norms[0] - ref_norm) <= 1e-5 * ref_norm, (norms[0], ref_norm)


def test_tp_size_from_the_config_splits_a_plain_model():
    ref = reference_train(STEPS, B, clip=CLIP, cfg=CFG)
    state, _ = run_distributed(_train, 4, args=(2, 1), kwargs={"via_config": True})[0]
    diff, name = max_rel_diff(state, ref)
    assert diff <= 1e-5, f"{name}: relative difference {diff:.2e}"


# ------------------------------------------------------------------------ shards and conversion
def _shards(rank, world):
    topo = Topology.build(tp=world)
    torch.manual_seed(0)
    tp_model = GPT(CFG, topology=topo)
    specs = {n: partition_spec(p) for n, p in tp_model.named_parameters()}
    return {k: v.detach().clone() for k, v in tp_model.state_dict().items()}, specs


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_model_holds_the_slices_of_the_plain_model(tp):
    plain = {k: v.detach() for k, v in tiny_gpt(cfg=CFG).state_dict().items()}
    results = run_distributed(_shards, tp)
    expected = split_state_dict(plain, tp)
    for rank, (state, specs) in enumerate(results):
        assert state.keys() == expected[rank].keys()
        for name, t in state.items():
            assert torch.equal(t, expected[rank][name]), f"tp rank {rank}: {name}"
        for name, spec in specs.items():  # the pure name rule agrees with the layers
            assert spec == tp_spec(name), name
    joined = join_state_dicts([s for s, _ in results])
    assert all(torch.equal(joined[k], plain[k]) for k in plain)


# ------------------------------------------------------------------------ communication
def _count(rank, world, sp):
    topo = Topology.build(tp=world)
    torch.manual_seed(0)
    model = GPT(CFG, topology=topo, sequence_parallel=sp)
    b, s, h = 2, CFG.block_size, CFG.d_model
    x, y = batch(0, b)
    full = b * s * h * 4  # bytes of one b x s x h activation (CommLog counts the full buffer)
    log = comm_for(topo).log

    def counts(fn):
        start = len(log.records)
        fn()
        return {
            op: sum(
                1 for r in log.records[start:] if r.axis == "tp" and r.op == op and r.bytes == full
            )
            for op in ("all_reduce", "all_gather", "reduce_scatter")
        }

    # One transformer layer alone, forward + backward.
    block = model.blocks[0]
    inp = torch.randn(b, s // world if sp else s, h, requires_grad=True)
    per_block = counts(lambda: block(inp).sum().backward())
    # The whole model: the embedding leaves the tp region (1 forward) and the head enters it
    # (1 backward), besides the layers.
    whole = counts(lambda: model(x, y).backward())
    return per_block, whole


@pytest.mark.parametrize("sp", [False, True])
def test_comm_per_layer(sp):
    per_block, whole = run_distributed(_count, 2, args=(sp,))[0]
    L = CFG.n_layer
    if not sp:
        assert per_block == {"all_reduce": 4, "all_gather": 0, "reduce_scatter": 0}
        assert whole == {"all_reduce": 4 * L + 2, "all_gather": 0, "reduce_scatter": 0}
        # an all-reduce is two ring passes (a reduce-scatter and an all-gather)
        assert 2 * whole["all_reduce"] == tp_collectives(L, sequence_parallel=False)[0]
    else:  # each all-reduce becomes an all-gather + reduce-scatter pair, and the two column
        # layers (and the output layer) gather their input again in backward: they keep only
        # their sequence shard for it
        assert per_block == {"all_reduce": 0, "all_gather": 6, "reduce_scatter": 4}
        assert whole == {"all_reduce": 0, "all_gather": 6 * L + 3, "reduce_scatter": 4 * L + 2}
        # the planner's cost model charges what the CommLog counts
        assert whole["all_gather"] + whole["reduce_scatter"] == tp_collectives(L)[0]


# ------------------------------------------------------------------------ activation memory
def _saved_bytes(rank, world, sp):
    """Bytes of the distinct storages one transformer layer's forward saves for backward, not
    counting the parameters' own (a census through autograd's saved-tensor hooks)."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=4, d_model=64, bias=True)
    model = GPT(cfg)
    if world > 1:
        model.parallelize(Topology.build(tp=world), sequence_parallel=sp)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    x = torch.randn(2, cfg.block_size // (world if sp else 1), cfg.d_model, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.blocks[0](x)
    return sum(saved.values())


def test_sequence_parallel_layer_keeps_one_tp_th_of_its_activations():
    """Korthikanti et al.: with sequence parallelism a layer keeps exactly 1/tp of what it keeps
    on one rank (the column layers save their input's sequence shard, not the gathered input);
    without it, the LayerNorm and the column layers' inputs stay whole on every rank."""
    one = _saved_bytes(0, 1, False)
    for tp in (2, 4):
        with_sp = run_distributed(_saved_bytes, tp, args=(True,))[0]
        without = run_distributed(_saved_bytes, tp, args=(False,))[0]
        assert with_sp * tp == one, (tp, with_sp, one)
        assert without > with_sp


# ------------------------------------------------------------------------ random streams
def _masks(rank, world):
    topo = Topology.build(tp=world)
    model_parallel_seed(1234, topo)
    ones = torch.ones(4096)
    outside = (F.dropout(ones, 0.5) > 0).float()
    with get_rng_tracker().fork():
        inside = (F.dropout(ones, 0.5) > 0).float()
    both = torch.stack([outside, inside])
    gathered = [torch.empty_like(both) for _ in range(world)]
    dist.all_gather(gathered, both, group=topo.group("tp"))
    same_outside = all(torch.equal(g[0], gathered[0][0]) for g in gathered)
    same_inside = any(torch.equal(g[1], gathered[0][1]) for g in gathered[1:])
    return same_outside, same_inside


def test_dropout_masks_differ_inside_split_regions_and_agree_outside():
    for same_outside, same_inside in run_distributed(_masks, 2):
        assert same_outside and not same_inside


def _recompute(rank, world):
    """A split region with dropout under checkpoint gives the gradients of the plain run."""
    topo = Topology.build(tp=world)
    torch.manual_seed(0)
    fc = ColumnParallelLinear(16, 64, topology=topo)
    proj = RowParallelLinear(64, 16, topology=topo)

    def region(x):
        with get_rng_tracker().fork():
            h = F.dropout(F.gelu(fc(x)), 0.3)
        return F.dropout(proj(h), 0.3)

    grads = []
    for wrap in (lambda x: region(x), lambda x: checkpoint(region, x)):
        model_parallel_seed(7, topo)
        x = torch.randn(4, 16, requires_grad=True)
        wrap(x).square().sum().backward()
        grads.append([x.grad.clone(), fc.weight.grad.clone(), proj.weight.grad.clone()])
        fc.zero_grad()
        proj.zero_grad()
    return all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_checkpoint_replays_tensor_parallel_dropout():
    assert all(run_distributed(_recompute, 2))


def _short_training(rank, world, dropout, extra):
    topo = Topology.build(tp=2)
    cfg = GPTConfig(**{**CFG.__dict__, "dropout": dropout})
    torch.manual_seed(0)
    model = GPT(cfg, topology=topo, sequence_parallel=True)
    micro = 8 // topo.dp
    engine, *_ = zerostack.initialize(model=model, topology=topo, config=_config(micro, 2, **extra))
    losses = []
    for step in range(8):
        x, y = batch(step % 2, 8)
        lo = topo.dp_rank * micro
        loss = engine(x[lo : lo + micro], y[lo : lo + micro])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "world,dropout,extra",
    [(2, 0.2, {}), (4, 0.0, {"bf16": {"enabled": True}}), (4, 0.0, {"fp16": {"enabled": True}})],
)
@pytest.mark.slow
def test_gpt_trains_and_tp_ranks_agree_on_the_loss(world, dropout, extra):
    """With dropout (tp stream inside split regions) and in bf16 / fp16 over tp 2 x dp 2."""
    results = run_distributed(_short_training, world, args=(dropout, extra))
    for r in range(0, world, 2):  # replicated values agree bit for bit across the tp ranks
        assert results[r] == results[r + 1]
    first, last = results[0][:2], results[0][-2:]
    assert sum(last) < sum(first) - 0.2, results[0]


# ------------------------------------------------------------------------ set-up errors
class _MPU:
    def __init__(self, tp: int, ranks: list[list[int]]) -> None:
        self.tp = tp
        self.groups = [dist.new_group(r) for r in ranks]
        self.mine = next(g for g, r in zip(self.groups, ranks, strict=True) if dist.get_rank() in r)

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_model_parallel_group(self):
        return self.mine


def _setup_errors(rank, world):
    zerostack.init_distributed()
    out = {}
    cases = {
        "config vs topology": lambda: zerostack.initialize(
            model=GPT(CFG, topology=Topology.build(tp=2)),
            config=_config(4, 0, tensor_parallel={"autotp_size": 4}),
        ),
        "plain module": lambda: zerostack.initialize(
            model=torch.nn.Linear(4, 4), config=_config(4, 0, tensor_parallel={"autotp_size": 2})
        ),
        "mpu layout": lambda: zerostack.initialize(
            model=tiny_gpt(cfg=CFG), mpu=_MPU(2, [[0, 2], [1, 3]]), config=_config(4, 0)
        ),
    }
    for name, fn in cases.items():
        try:
            fn()
            out[name] = None
        except ConfigError as exc:
            out[name] = str(exc)
    # A matching mpu works: tp from the mpu, dp from what is left, the loader samples by dp rank.
    engine, _, loader, _ = zerostack.initialize(
        model=tiny_gpt(cfg=CFG),
        mpu=_MPU(2, [[0, 1], [2, 3]]),
        config=_config(2, 0),
        training_data=list(zip(*batch(0, 16), strict=True)),
    )
    out["sizes"] = (engine.topology.tp, engine.dp_world_size)
    out["sampler"] = (loader.sampler.num_replicas, loader.sampler.rank, engine.topology.dp_rank)
    out["first"] = next(iter(loader))[0]
    return out


def test_setup_errors_and_mpu():
    results = run_distributed(_setup_errors, 4)
    out = results[0]
    assert out["config vs topology"] == (
        "tensor_parallel.autotp_size: tensor-parallel size 4 disagrees with the topology (2)"
    )
    assert "tp=2 needs a tensor-parallel model" in out["plain module"]
    assert "mpu: its tensor-parallel group of this rank is ranks [0, 2]" in out["mpu layout"]
    for r in results:
        assert r["sizes"] == (2, 2)
        assert r["sampler"][0] == 2 and r["sampler"][1] == r["sampler"][2]
    # tp peers (ranks 0 and 1) read the same batch; the dp peer (rank 2) another one
    assert torch.equal(results[0]["first"], results[1]["first"])
    assert not torch.equal(results[0]["first"], results[2]["first"])


# ---------------------------------------------------------------- AutoTP's shared region entry
def _shared_entry(rank, world):
    from zerostack.tensor_parallel.autotp import TPLinear

    topo = Topology.build(tp=world)
    log = comm_for(topo).log
    torch.manual_seed(0)
    q, k = (TPLinear(nn.Linear(8, 8), mode="column", topology=topo) for _ in range(2))
    x = torch.randn(3, 8, requires_grad=True)
    with torch.no_grad():  # an entry made without grad is not reused with it
        q(x)
    start = len(log.records)
    (q(x).sum() + k(x).sum()).backward()
    once = [r.op for r in log.records[start:] if r.axis == "tp"]
    separately = x.grad.clone()
    x.grad = None
    q(x).sum().backward()
    k(x).sum().backward()
    return once, torch.allclose(x.grad, separately, rtol=0, atol=1e-6), x.grad.abs().sum().item()


def test_column_layers_reading_one_input_all_reduce_its_gradient_once():
    """AutoTP: q and k read the same x; their input gradients are summed, then all-reduced
    once (the all-reduce is linear: the same gradient as one all-reduce each). An entry made
    under no_grad is not reused with grad on (x still gets its gradient)."""
    for once, equal, size in run_distributed(_shared_entry, 2):
        assert once == ["all_reduce"] and equal and size > 0
