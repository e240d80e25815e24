"""A user's ``torch.autocast`` around the forward, with an fp32 config (the usual GPU idiom), at
every ZeRO stage and with tensor + sequence parallelism. CPU autocast (bf16) has the mechanism
CUDA's has: forward's linear computes in bf16 and backward runs outside the context.

Stage 3 routes ``nn.Linear`` through zerostack's own autograd Function (it saves the weight
parameter, not a view of its gathered storage), and sequence parallelism through another; both
replay forward's autocast state in backward (they crashed with "expected m1 and m2 to have the
same dtype" before). Stages 1-3 equal stage 0, which runs torch's own linear, to the last bit;
tp 2 with sequence parallelism (dp 1: every rank sees the whole batch) is within 1e-4 of one
process under the same autocast on every loss (1.3e-5 measured: the row-parallel layers sum
bf16 partial products in another order). SGD, no clipping.
"""

from __future__ import annotations

import pytest
import torch

import zerostack
from zerostack import Topology
from zerostack.models import GPT, GPTConfig

from tests.support.models import batch, tiny_gpt
from tests.support.ranks import run_distributed

pytestmark = pytest.mark.distributed  # every test here starts ranks

CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, d_model=32, bias=False)
STEPS, B, TOL_TP = 3, 8, 1e-4


def _train(rank, world, stage, tp):
    topo = Topology.build(tp=tp) if tp > 1 else None
    torch.manual_seed(0)
    model = GPT(CFG, topology=topo, sequence_parallel=True) if tp > 1 else tiny_gpt(cfg=CFG)
    dp = world // tp
    config = {
        "train_micro_batch_size_per_gpu": B // dp,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerostack.initialize(model=model, topology=topo, config=config)
    lo = engine.topology.dp_rank * (B // dp)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, B)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = engine(x[lo : lo + B // dp], y[lo : lo + B // dp])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.full_state_dict()


def _one_process() -> list[float]:
    model = tiny_gpt(cfg=CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, B)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stage", [pytest.param(s, marks=pytest.mark.slow) for s in (1, 2)] + [3])
def test_autocast_trains_at_every_stage_as_at_stage_0(stage):
    want = run_distributed(_train, 2, args=(0, 1))
    got = run_distributed(_train, 2, args=(stage, 1))
    for (losses, state), (ref_losses, ref_state) in zip(got, want, strict=True):
        assert losses == ref_losses
        assert state.keys() == ref_state.keys()
        for k in ref_state:
            assert torch.equal(state[k], ref_state[k]), k


def test_autocast_with_tensor_and_sequence_parallelism():
    want = _one_process()
    for stage in (0, 3):
        for losses, _ in run_distributed(_train, 2, args=(stage, 2)):
            assert all(abs(a - b) <= TOL_TP * b for a, b in zip(losses, want, strict=True)), (
                stage,
                losses,
                want,
            )
