"""Hugging Face models under ring attention, and Ulysses x ring (``register_with_transformers(...,
ring_parallel_size=r)``): a tiny HF Llama (2 layers, hidden 64, 4 heads, 2 kv heads) at sp 2
Ulysses, sp 2 ring and sp 4 = 2 Ulysses x 2 ring, under ZeRO-3, written as DeepSpeed's ALST
script writes it (the adapter, ``initialize(mpu=...)``, the loss over the sp group), against
single-process training on the whole sequence; the same with padding-free packed rows (documents
restarting their positions), whose reference runs every document apart; refusals.

Parity: plain SGD, no clipping (tests/support/parity.py says why), 3 steps, 1e-5 relative per
tensor and on the gradient norm and the loss.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.support.models import max_rel_diff
from tests.support.parity import global_norm
from tests.support.ranks import run_distributed

pytestmark = pytest.mark.distributed  # every test here starts ranks

VOCAB, SEQ, MICRO, STEPS, LR = 64, 32, 2, 3, 0.5
# documents per row when packed: cuts inside and across the zigzag chunks of ring 2 (8 tokens)
PACKED = [[7, 25], [12, 9, 11]]


def _model(dropout: float = 0.0):
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=SEQ, attention_dropout=dropout)  # fmt: skip
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _documents(packed: bool) -> list[list[int]]:
    return PACKED if packed else [[SEQ]] * MICRO


def _batch(i: int, packed: bool) -> dict:
    """Global batch i. Packed: positions restart at each document, whose first token's label
    is -100 (the document before it does not predict it)."""
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(100 + i))
    labels, positions = ids.clone(), []
    for row, docs in enumerate(_documents(packed)):
        positions.append(torch.cat([torch.arange(n) for n in docs]))
        for start in torch.tensor(docs).cumsum(0)[:-1].tolist():
            labels[row, start] = -100
    return {"input_ids": ids, "position_ids": torch.stack(positions), "labels": labels}


@functools.cache
def _reference(packed: bool):
    """One process, every document run on its own: per step (weights, grad norm, loss), the
    loss the mean over every predicted token of the batch."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for step in range(STEPS):
        ids = _batch(step, packed)["input_ids"]
        total, count = 0.0, 0
        for row, docs in enumerate(_documents(packed)):
            for doc in ids[row].split(docs):
                logits = model(input_ids=doc[None]).logits[0]
                total = total + F.cross_entropy(logits[:-1].float(), doc[1:], reduction="sum")
                count += doc.numel() - 1
        loss = total / count
        loss.backward()
        norm = global_norm([p.grad for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(({k: v.detach().clone() for k, v in model.named_parameters()}, norm,
                    loss.item()))  # fmt: skip
    return out


def _alst(rank, world, ring, stage, packed):
    """DeepSpeed's ALST script, import changed, plus ``ring_parallel_size``; rank r's loader
    yields global batches r, r + world, ... and the adapter hands out batch i at step i."""
    import zerostack.compat.deepspeed as deepspeed
    from zerostack.compat.deepspeed.runtime.sequence_parallel.ulysses_sp import (
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
        ulysses_sp_loss,
    )

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 4000,
                              "stage3_param_persistence_threshold": 0},  # fmt: skip
        "sequence_parallel_size": world,
        "ring_parallel_size": ring,
    }
    model = _model()
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=world,
        micro_batch_size=MICRO, seq_length=SEQ, ring_parallel_size=ring,
    )  # fmt: skip
    engine, *_ = deepspeed.initialize(config=config, model=model, mpu=mpu)
    group = mpu.get_sequence_parallel_group()
    groups = deepspeed.utils.groups  # what ALST code asks after initialize: every sp rank
    assert groups._get_sequence_parallel_world_size() == world
    assert groups._get_sequence_parallel_rank() == mpu.get_sequence_parallel_rank()
    assert groups._get_sequence_parallel_group() is group
    mine = [_batch(i, packed) for i in range(rank, world * STEPS, world)]
    dl = UlyssesSPDataLoaderAdapter(torch.utils.data.DataLoader(mine, batch_size=None),
                                    mpu.get_sequence_parallel_rank(), group, world,
                                    engine.device)  # fmt: skip
    out = []
    for _, batch in zip(range(STEPS), dl, strict=False):
        loss = ulysses_sp_loss(engine(**batch).logits, batch["shift_labels"], group)
        engine.backward(loss)
        engine.step()
        state = engine.full_state_dict()
        out.append((state if rank == 0 else None, engine.get_global_grad_norm(), loss.item()))
    topo = engine.topology
    assert (topo.sp, topo.ring, topo.ulysses) == (world, ring, world // ring)
    engine.destroy()
    return out


CASES = [  # world (= sp), ring, packed
    (2, 1, False),  # Ulysses 2
    (2, 2, False),  # ring 2
    (4, 2, False),  # Ulysses 2 x ring 2
    (2, 1, True),
    (2, 2, True),
    (4, 2, True),
]


@pytest.mark.parametrize("world,ring,packed", CASES)
def test_alst_with_ring_matches_single_process_training_at_zero_3(world, ring, packed):
    _compare(run_distributed(_alst, world, args=(ring, 3, packed)), _reference(packed))


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_ring_matches_at_the_other_zero_stages_gradient_norm_included(stage):
    _compare(run_distributed(_alst, 2, args=(2, stage, True)), _reference(True))


def _compare(results, ref):
    for rank_out in results:
        for step, ((state, norm, loss), (want, want_norm, want_loss)) in enumerate(
            zip(rank_out, ref, strict=True)
        ):
            assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (step, loss, want_loss)
            assert abs(norm - want_norm) <= 1e-5 * want_norm, (step, norm, want_norm)
            if state is not None:
                diff, name = max_rel_diff(state, want)
                assert diff <= 1e-5, f"step {step}, {name}: relative difference {diff:.2e}"


def _refused(rank, world):
    from zerostack.sequence.hf_ulysses import UlyssesSPAttentionHF

    out = []
    for kwargs in ({"ring_parallel_size": 3}, {"ring_parallel_size": 2, "seq_length": 30}):
        try:
            UlyssesSPAttentionHF.register_with_transformers(_model(), "sdpa", world, 1, **kwargs)
        except ValueError as e:
            out.append(str(e))
    model = _model(dropout=0.1)
    UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world, 1,
                                                    ring_parallel_size=2)  # fmt: skip
    model.train()
    ids = torch.zeros(1, SEQ // world, dtype=torch.long)
    try:
        model(input_ids=ids, position_ids=torch.arange(SEQ // world)[None])
    except ValueError as e:
        out.append(str(e))
    return out


def test_what_ring_attention_cannot_do_is_refused_by_name():
    for errors in run_distributed(_refused, 2):
        assert errors == [
            "register_with_transformers: ring_parallel_size 3 does not divide "
            "sequence_parallel_size 2",
            "register_with_transformers: seq_length 30 is not divisible by "
            "sequence_parallel_size 2 and 2 * ring_parallel_size 4",
            "ring attention: dropout=0.1 is not supported; it needs 0 or None (the model's "
            "config sets it)",
        ]
