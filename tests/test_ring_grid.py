"""Ring attention on the grid (``ring_parallel_size``): the reference GPT at sp 2 = ring 2,
sp 4 = Ulysses 2 x ring 2 and sp 4 = ring 4, under ZeRO 0-3 and beside dp, against
single-process training; under a pipeline; the exchanges it makes per attention (ring steps on
the 'ring' axis, all-to-alls on the 'ulysses' axis); each rank's tokens; refusals.

Parity: plain SGD, no clipping (tests/support/parity.py says why), 3 steps, 1e-5 relative per
tensor and on the gradient norm: the ring only regroups sums.
"""

from __future__ import annotations

import pytest
import torch

import zerostack
from zerostack import ConfigError, Topology
from zerostack.comm.grid import comm_for
from zerostack.models import GPT, GPTConfig
from zerostack.sequence import sequence_piece, sequence_unpiece, shard_sequence

from tests.support.models import batch, max_rel_diff
from tests.support.parity import CFG, STEPS, B, reference
from tests.support.ranks import run_distributed


def _train(rank, world, sp, ring, stage, via_config):
    config = {
        "train_micro_batch_size_per_gpu": B // (world // sp),
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.0}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000,
                              "stage3_param_persistence_threshold": 0},  # fmt: skip
    }
    torch.manual_seed(0)
    if via_config:  # a plain GPT: initialize builds the grid from the two keys
        model, topo = GPT(CFG), None
        config.update(sequence_parallel_size=sp, ring_parallel_size=ring)
    else:
        topo = Topology.build(sp=sp, ring=ring)
        model = GPT(CFG, topology=topo)
    engine, *_ = zerostack.initialize(model=model, topology=topo, config=config)
    topo = engine.topology
    assert (topo.sp, topo.ring, topo.data_parallel_size) == (sp, ring, world // sp)
    per = B // topo.data_parallel_size
    out = []
    for step in range(STEPS):
        x, y = batch(step, B)
        lo = topo.data_parallel_rank * per
        x, y = shard_sequence((x[lo : lo + per], y[lo : lo + per]), topo)
        engine.backward(engine(x, y))
        engine.step()
        state = engine.full_state_dict()
        out.append((state if rank == 0 else None, engine.get_global_grad_norm()))
    engine.destroy()
    return out


CASES = [  # world, sp, ring, ZeRO stage, via the config
    (2, 2, 2, 0, True),
    (2, 2, 2, 3, False),
    (4, 2, 2, 1, True),  # dp 2 x ring 2
    (4, 4, 2, 2, True),  # Ulysses 2 x ring 2
    (4, 4, 2, 3, False),
    (4, 4, 4, 3, True),  # ring 4: 8 zigzag chunks of 2 tokens
]


@pytest.mark.distributed
@pytest.mark.parametrize("world,sp,ring,stage,via_config", CASES)
def test_gpt_under_ring_attention_matches_single_process(world, sp, ring, stage, via_config):
    ref = reference("sgd", 1)
    for rank_out in run_distributed(_train, world, args=(sp, ring, stage, via_config)):
        for step, ((state, norm), (want, want_norm)) in enumerate(
            zip(rank_out, ref, strict=True)
        ):
            assert abs(norm - want_norm) <= 1e-5 * want_norm, (step, norm, want_norm)
            if state is not None:
                diff, name = max_rel_diff(state, want)
                assert diff <= 1e-5, f"step {step}, {name}: relative difference {diff:.2e}"


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_gpt_under_a_pipeline_with_ring_attention_matches_single_process(schedule):
    """pp 2 x ring 2: each stage's blocks attend around the ring and the stages pass the
    zigzag shards (the positions each stage adds are the shard's)."""
    from tests.support.matrix import Combo, measure

    combo = Combo(pp=2, dp=2, ep=1, tp=1, sp=2, megatron_sp=False, schedule=schedule, stage=1,
                  precision="fp32", offload="none", ring=2)  # fmt: skip
    assert measure([combo])[1] == [("works", "")]


def _traffic(rank, world, sp, ring):
    topo = Topology.build(sp=sp, ring=ring)
    torch.manual_seed(0)
    model = GPT(CFG, topology=topo)
    x, y = shard_sequence(batch(0, 2), topo)
    log = comm_for(topo).log.records
    loss = model(x, y)
    forward = [(r.op, r.axis, r.bytes) for r in log]
    loss.backward()
    return forward, [(r.op, r.axis, r.bytes) for r in log[len(forward) :]], x


@pytest.mark.distributed
@pytest.mark.parametrize("sp,ring", [(2, 2), (4, 2), (4, 4)])
def test_each_attention_passes_keys_and_values_around_the_ring(sp, ring):
    """Per layer, forward: Ulysses' four all-to-alls (q, k, v in, the output back) of the
    rank's tokens when ulysses > 1, and ring - 1 exchanges of k and v of the ring shard
    (S / ring tokens, heads / ulysses); backward adds k's and v's fp32 gradients to each
    exchange and one more exchange of the gradients home. The tokens are sequence_piece's."""
    u, b, s, h = sp // ring, 2, CFG.block_size, CFG.d_model
    kv = b * (s // ring) * (h // u) * 4  # k or v, or a gradient of one, in bytes
    a2a = [("all_to_all", "ulysses", b * s * h // sp * 4)] if u > 1 else []
    step = [(op, "ring", kv) for op in ("send", "send", "recv", "recv")]
    results = run_distributed(_traffic, sp, args=(sp, ring))
    for forward, backward, _ in results:
        assert forward == (a2a * 3 + step * (ring - 1) + a2a) * CFG.n_layer
        grads = [(op, "ring", kv) for op in ["send"] * 4 + ["recv"] * 4]
        home = [(op, "ring", kv) for op in ("send", "send", "recv", "recv")]
        assert backward == (a2a + grads * (ring - 1) + home + a2a * 3) * CFG.n_layer
    whole = sequence_unpiece([r[2] for r in results], 1, ring)
    assert torch.equal(whole, batch(0, 2)[0])
    assert [r[2].tolist() for r in results] == [
        sequence_piece(batch(0, 2)[0], 1, i, sp, ring).tolist() for i in range(sp)
    ]


def _refusals(rank, world):
    out = {}
    sgd = {"type": "SGD", "params": {"lr": 0.1}}
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": sgd}

    def attempt(name, model, **cfg):
        try:
            zerostack.initialize(model=model, config={**base, **cfg})
        except (ConfigError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"

    attempt("ring3", GPT(CFG), sequence_parallel_size=4, ring_parallel_size=3)
    attempt("dropout", GPT(GPTConfig(**{**vars(CFG), "dropout": 0.1})),
            sequence_parallel_size=2, ring_parallel_size=2)  # fmt: skip
    # 2 heads do not split over 4 Ulysses ranks, but over 2 they do: ring 2 takes the rest
    two_heads = GPTConfig(**{**vars(CFG), "n_head": 2})
    attempt("heads", GPT(two_heads), sequence_parallel_size=4)
    attempt("heads_ring", GPT(GPTConfig(**{**vars(CFG), "n_head": 1})),
            sequence_parallel_size=4, ring_parallel_size=2)  # fmt: skip
    topo = Topology.build(sp=4, ring=2)
    attempt("disagree", GPT(CFG, topology=topo), sequence_parallel_size=4, ring_parallel_size=4)
    out["fits"] = zerostack.initialize(model=GPT(two_heads), config={
        **base, "sequence_parallel_size": 4, "ring_parallel_size": 2})[0].topology.ulysses
    return out


@pytest.mark.distributed
def test_bad_ring_grids_are_refused_naming_the_keys():
    out = run_distributed(_refusals, 4)[0]
    assert out == {
        "ring3": "TopologyError: ring_parallel_size 3 does not divide sequence_parallel_size 4 "
        "(the sp ranks are ring groups of Ulysses ranks)",
        "dropout": "ConfigError: ring_parallel_size 2 with GPT dropout 0.1: ring attention has "
        "no attention dropout, so set dropout to 0",
        "heads": "ValueError: sequence_parallel_size: GPT's n_head 2 does not split into "
        "tp * sp = 1 * 4 head shards",
        "heads_ring": "ValueError: sequence_parallel_size: GPT's n_head 1 does not split into "
        "tp * Ulysses ranks (sp / ring) = 1 * 2 head shards",
        "disagree": "ConfigError: ring_parallel_size: 4 disagrees with the topology's ring (2)",
        "fits": 2,
    }


def test_a_sequence_that_does_not_split_into_zigzag_chunks_is_refused():
    class Grid:  # what shard_sequence reads of a topology
        sp, ring = 4, 2

        def rank(self, axis):
            return 0

    with pytest.raises(ValueError) as e:
        shard_sequence((torch.zeros(2, 10), torch.zeros(2)), Grid())
    assert str(e.value) == (
        "sequence_parallel_size: a sequence of 10 (dim 1) does not split into 2 * ring = 4 "
        "zigzag chunks, each ring shard into 2 Ulysses shards: a batch tensor of shape (2, 10)"
    )
    x, y = shard_sequence((torch.arange(16).view(2, 8), torch.zeros(2)), Grid())
    assert x.tolist() == [[0, 1], [8, 9]] and y.shape == (2,)  # dim 1 cut, 1-d tensors whole
