"""Ulysses sequence parallelism: the all-to-all's layout and its inverse, DistributedAttention
against whole-sequence attention, the GPT at sp 2 and 4 (alone, with ZeRO-3 over dp 2, with tp 2)
against single-process training, bytes per attention, activation bytes per rank, the loader's
sequence shards, refusals.

Parity: plain SGD, no clipping (tests/support/parity.py says why), 3 steps, 1e-5 relative per
tensor: the sp ranks only regroup sums (the gradient of a parameter is summed over sequence shards).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerostack
from zerostack import ConfigError, Topology
from zerostack.comm.grid import comm_for
from zerostack.models import GPT, GPTConfig
from zerostack.sequence import DistributedAttention, seq_all_to_all, shard_sequence

from tests.support.models import batch, max_rel_diff
from tests.support.parity import CFG, STEPS, B, reference
from tests.support.ranks import run_distributed

S, BATCH, HEADS, DIM = 8, 2, 4, 3


def _global(seed: int, shape=(S, BATCH, HEADS, DIM)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _exchange(rank, world):
    """Rank r's shard of X [s, b, h, d] becomes the whole sequence of head chunk r; the
    gradient flows back to the sequence shard it came from."""
    topo = Topology.build(sp=world)
    n, m = S // world, HEADS // world
    x = _global(0)[rank * n : (rank + 1) * n].clone().requires_grad_(True)
    out = seq_all_to_all(x, topo, scatter_idx=2, gather_idx=0)
    expected = _global(0)[:, :, rank * m : (rank + 1) * m]
    g = _global(1)
    (out * g[:, :, rank * m : (rank + 1) * m]).sum().backward()
    back = seq_all_to_all(out.detach(), topo, scatter_idx=0, gather_idx=2)
    return (
        torch.equal(out, expected),
        torch.equal(x.grad, g[rank * n : (rank + 1) * n]),
        torch.equal(back, x.detach()),
        [(r.op, r.axis, r.bytes) for r in comm_for(topo).log.records],
    )


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_trades_sequence_shards_for_head_shards_and_back(world):
    for layout, grad, inverse, records in run_distributed(_exchange, world):
        assert layout and grad and inverse
        shard_bytes = S // world * BATCH * HEADS * DIM * 4
        assert records == [("all_to_all", "sp", shard_bytes)] * 3  # forward, backward, inverse


def _causal(q, k, v):  # [b, s, h, d]
    y = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    )
    return y.transpose(1, 2)


def _attention(rank, world, by_group):
    """DistributedAttention on sequence shards against attention over the whole sequence,
    outputs and the gradients of q, k, v; over the Topology and over a bare process group."""
    topo = Topology.build(sp=world)
    group = topo.group("sp") if by_group else topo
    shape = (BATCH, S, HEADS, DIM)  # [b, s, h, d]: sequence is dim 1
    qkv = [_global(10 + i, shape).requires_grad_(True) for i in range(3)]
    g = _global(20, shape)
    whole = _causal(*qkv)
    (whole * g).sum().backward()
    n = S // world
    mine = slice(rank * n, (rank + 1) * n)
    local = [t.detach()[:, mine].clone().requires_grad_(True) for t in qkv]
    out = DistributedAttention(_causal, group, scatter_idx=2, gather_idx=1)(*local)
    (out * g[:, mine]).sum().backward()
    out_diff = float((out - whole.detach()[:, mine]).abs().max())
    grad_diff = max(
        float((a.grad - b.grad[:, mine]).abs().max()) for a, b in zip(local, qkv, strict=True)
    )
    return out_diff, grad_diff


@pytest.mark.distributed
@pytest.mark.parametrize("world,by_group", [(2, False), (4, False), (2, True)])
def test_distributed_attention_is_attention_over_the_whole_sequence(world, by_group):
    for out_diff, grad_diff in run_distributed(_attention, world, args=(by_group,)):
        assert out_diff <= 1e-6 and grad_diff <= 1e-6, (out_diff, grad_diff)


def _train(rank, world, sp, tp, stage, via_config):
    config = {
        "train_micro_batch_size_per_gpu": None,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.0}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 5000,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 3000,
        },
    }
    dp = world // (tp * sp)  # the batch's replicas
    config["train_micro_batch_size_per_gpu"] = B // dp
    torch.manual_seed(0)
    if via_config:  # a plain GPT; initialize builds the grid and wires its attention
        model, topo = GPT(CFG), None
        config["sequence_parallel_size"] = sp
    else:
        topo = Topology.build(tp=tp, sp=sp)
        model = GPT(CFG, topology=topo)
    engine, *_ = zerostack.initialize(model=model, topology=topo, config=config)
    topo = engine.topology
    assert (topo.sp, topo.data_parallel_size, engine.dp_world_size) == (sp, dp, dp)
    per = B // dp
    out = []
    for step in range(STEPS):
        x, y = batch(step, B)
        lo = topo.data_parallel_rank * per
        x, y = shard_sequence((x[lo : lo + per], y[lo : lo + per]), topo)
        engine.backward(engine(x, y))
        engine.step()
        out.append(engine.full_state_dict())
    engine.destroy()
    return out if rank == 0 else None


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world,sp,tp,stage,via_config",
    [
        (2, 2, 1, 0, False),
        (4, 4, 1, 2, True),
        (4, 2, 1, 3, False),  # ZeRO-3 over dp 2 x sp 2
        (4, 2, 2, 1, False),  # tp 2 x sp 2: one head per rank
    ],
)
@pytest.mark.slow
def test_gpt_matches_single_process(world, sp, tp, stage, via_config):
    ref = reference("sgd", 1)
    states = run_distributed(_train, world, args=(sp, tp, stage, via_config))[0]
    for step, (state, (ref_state, _)) in enumerate(zip(states, ref, strict=True)):
        diff, name = max_rel_diff(state, ref_state)
        assert diff <= 1e-5, f"step {step}, {name}: relative difference {diff:.2e}"


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_gpt_under_a_pipeline_matches_single_process(schedule):
    """pp 2 x sp 2 (the composition matrix's row, alone): each stage's blocks attend over the
    whole sequence and the stages pass sequence shards."""
    from tests.support.matrix import Combo, measure

    combo = Combo(pp=2, dp=2, ep=1, tp=1, sp=2, megatron_sp=False, schedule=schedule, stage=1,
                  precision="fp32", offload="none")  # fmt: skip
    assert measure([combo])[1] == [("works", "")]


def _per_layer(rank, world, sp):
    """One forward and one backward of the GPT: what its Comm logged on the sp axis, what
    torch.distributed was handed, and the bytes saved for backward other than the parameters
    and scalars (the loss's own)."""
    topo = Topology.build(sp=sp) if sp > 1 else Topology.build()
    torch.manual_seed(0)
    model = GPT(CFG, topology=topo)
    params = {p.data_ptr() for p in model.parameters()}
    handed = []
    real = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        handed.append(input.numel() * input.element_size())
        return real(output, input, *args, **kwargs)

    x, y = batch(0, 4)
    x, y = shard_sequence((x, y), topo)
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params and t.numel() > 1:  # not a scalar
            saved.append(t.numel() * t.element_size())
        return t

    dist.all_to_all_single = counting
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(x, y)
        forward = [r.bytes for r in comm_for(topo).log.records if r.op == "all_to_all"]
        loss.backward()
    finally:
        dist.all_to_all_single = real
    both = [r.bytes for r in comm_for(topo).log.records if r.op == "all_to_all"]
    return forward, both, handed, sum(saved)


@pytest.mark.distributed
def test_bytes_per_attention_and_activations_per_rank():
    b, s, h = 4, CFG.block_size, CFG.d_model
    saved = {}
    for sp in (1, 2, 4):
        results = run_distributed(_per_layer, sp, args=(sp,))
        for forward, both, handed, _ in results:
            if sp > 1:
                # q, k, v in and the output back, b * s * h / sp elements each, per layer
                assert forward == [b * s * h // sp * 4] * (4 * CFG.n_layer)
                assert both == forward * 2  # backward: the reverse exchanges, as many bytes
                assert handed == both  # what torch.distributed was handed
            else:
                assert forward == both == handed == []
        saved[sp] = {r[3] for r in results}
        assert len(saved[sp]) == 1  # every rank alike
    # everything saved for backward is per token (attention's too: whole sequence, 1/sp of heads)
    assert saved[1] == {2 * x for x in saved[2]} == {4 * x for x in saved[4]}, saved


def _loader(rank, world):
    topo = Topology.build(sp=2)
    windows = [batch(i, 1)[0][0] for i in range(16)]  # 16 samples of 16 tokens
    dataset = [(w, w + 1) for w in windows]
    torch.manual_seed(0)
    engine, _, loader, _ = zerostack.initialize(
        model=GPT(CFG),
        topology=topo,
        training_data=dataset,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "sequence_parallel_size": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    x, y = next(iter(loader))
    return topo.data_parallel_rank, topo.rank("sp"), x, y, engine.train_batch_size()


@pytest.mark.distributed
def test_the_loader_hands_each_sp_rank_its_shard_of_the_same_samples():
    results = run_distributed(_loader, 4)
    windows = [batch(i, 1)[0][0] for i in range(16)]
    by_data = {}
    for data_rank, sp_rank, x, y, tbs in results:
        assert tbs == 4  # 2 per replica, 2 replicas: the sp ranks read one batch
        assert x.shape == (2, 8) and torch.equal(y, x + 1)
        by_data.setdefault(data_rank, {})[sp_rank] = x
    assert sorted(by_data) == [0, 1]
    seen = []
    for data_rank, shards in by_data.items():
        whole = torch.cat([shards[0], shards[1]], dim=1)
        sampler = torch.utils.data.DistributedSampler(
            range(16), num_replicas=2, rank=data_rank, shuffle=True, seed=0
        )
        expected = torch.stack([windows[i] for i in list(sampler)[:2]])
        assert torch.equal(whole, expected)
        seen.append(whole)
    assert not torch.equal(seen[0], seen[1])


def _refusals(rank, world):
    out = {}
    sgd = {"type": "SGD", "params": {"lr": 0.1}}
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": sgd}

    def attempt(name, model, **cfg):
        try:
            zerostack.initialize(model=model, config={**base, **cfg})
        except (ConfigError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"

    attempt("sp3", GPT(CFG), sequence_parallel_size=3)
    attempt("heads", GPT(GPTConfig(n_head=2, d_model=32, block_size=16)), sequence_parallel_size=4)
    attempt("plain", torch.nn.Linear(4, 4), sequence_parallel_size=2)
    topo = Topology.build(sp=2)
    attempt("disagree", GPT(CFG, topology=topo), sequence_parallel_size=4)
    return out


@pytest.mark.distributed
def test_bad_grids_are_refused_naming_the_key():
    out = run_distributed(_refusals, 4)[0]
    assert out == {
        "sp3": "ConfigError: sequence_parallel_size: 3 does not divide the data-parallel ranks, "
        "world 4 / (tp 1 * pp 1)",
        "heads": "ValueError: sequence_parallel_size: GPT's n_head 2 does not split into "
        "tp * sp = 1 * 4 head shards",
        "plain": "ConfigError: sequence_parallel_size: 2 needs a model whose attention exchanges "
        "sequence shards: zerostack.sequence.DistributedAttention layers, or a model with a "
        "parallelize(topology) method (zerostack.models.GPT)",
        "disagree": "ConfigError: sequence_parallel_size: 4 disagrees with the topology's sp (2)",
    }


def _engine(sp: int, stage: int):
    topo = Topology.build(sp=sp)
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": B // topo.data_parallel_size,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000},
    }
    engine, *_ = zerostack.initialize(model=GPT(CFG, topology=topo), config=config)
    return engine


def _step(engine, step: int) -> None:
    topo, per = engine.topology, B // engine.topology.data_parallel_size
    x, y = batch(step, B)
    lo = topo.data_parallel_rank * per
    x, y = shard_sequence((x[lo : lo + per], y[lo : lo + per]), topo)
    engine.backward(engine(x, y))
    engine.step()


def _resume(rank, world, root, stage):
    engine = _engine(2, stage)
    for step in range(2):
        _step(engine, step)
    engine.save_checkpoint(root, tag="sp2")
    _step(engine, 2)
    whole = engine.full_state_dict()
    engine.destroy()
    out = [whole]
    for sp in (2, 1):  # the same layout, then the same ranks as plain data parallelism
        engine = _engine(sp, stage)
        engine.load_checkpoint(root, tag="sp2")
        _step(engine, 2)
        out.append(engine.full_state_dict())
        engine.destroy()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 3])
def test_an_sp_checkpoint_resumes_exactly_and_loads_without_sp(stage, tmp_path):
    whole, same, plain = run_distributed(_resume, 2, args=(str(tmp_path), stage))[0]
    for name, t in whole.items():
        assert torch.equal(same[name], t), name
    diff, name = max_rel_diff(plain, whole)
    assert diff <= 1e-5, f"{name}: relative difference {diff:.2e}"


def test_a_sequence_that_does_not_split_is_refused():
    class Grid:  # what shard_sequence reads of a topology
        sp, ring = 2, 1

        def rank(self, axis):
            return 0

    with pytest.raises(ValueError) as e:
        shard_sequence((torch.zeros(2, 15), torch.zeros(2)), Grid())
    assert str(e.value) == (
        "sequence_parallel_size: a sequence of 15 (dim 1) does not split into 2 equal shards: a "
        "batch tensor of shape (2, 15)"
    )
    x, y = shard_sequence((torch.arange(8).view(2, 4), torch.zeros(2)), Grid())
    assert x.tolist() == [[0, 1], [4, 5]] and y.shape == (2,)  # dim 1 cut, 1-d tensors whole
