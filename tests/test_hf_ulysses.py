"""DeepSpeed ALST's Hugging Face entry points on zerostack's Ulysses
(``deepspeed.runtime.sequence_parallel.ulysses_sp``): a tiny HF Llama (4 heads, 2 kv heads) at
sp 2, written as DeepSpeed's ALST tutorial writes it (register_with_transformers, the data loader
adapter, ``deepspeed.initialize(mpu=...)``, the tutorial's token-weighted loss), against
single-process training on the whole sequence; the token-weighted loss when one shard has no
label; MQA (fewer kv heads than sp ranks) and packed documents against whole-sequence attention;
the refusals.

Parity: plain SGD, no clipping (tests/support/parity.py says why), 3 steps, 1e-5 relative per
tensor and for the gradient norm: the sp ranks only regroup sums.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.support.models import max_rel_diff
from tests.support.parity import global_norm
from tests.support.ranks import run_distributed

pytestmark = pytest.mark.distributed  # every test here starts ranks

VOCAB, SEQ, MICRO, STEPS, LR = 64, 32, 2, 3, 0.5


def _config(heads: int = 4, kv_heads: int = 2) -> LlamaConfig:
    return LlamaConfig(num_hidden_layers=2, hidden_size=16 * heads, intermediate_size=128,
                       num_attention_heads=heads, num_key_value_heads=kv_heads,
                       vocab_size=VOCAB, max_position_embeddings=SEQ)  # fmt: skip


def _model(kv_heads: int = 2):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(kv_heads=kv_heads), attn_implementation="sdpa")


def _batch(i: int, masked: bool) -> dict:
    """Global batch i; ``masked``: the first half of every row's labels ignored (a prompt)."""
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(100 + i))
    labels = ids.clone()
    if masked:
        labels[:, : SEQ // 2] = -100
    return {"input_ids": ids, "position_ids": torch.arange(SEQ).expand(MICRO, SEQ).clone(),
            "labels": labels}  # fmt: skip


@functools.cache
def _reference(masked: bool):
    """Single-process training on each whole batch: per step (weights, grad norm, loss)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for step in range(STEPS):
        loss = model(**_batch(step, masked)).loss
        loss.backward()
        norm = global_norm([p.grad for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        weights = {k: v.detach().clone() for k, v in model.named_parameters()}
        out.append((weights, norm, loss.item()))
    return out


def _alst(rank, world, stage, loss_kind, masked):
    """The ALST tutorial's script under zerostack: every rank's loader yields its own batches
    (rank r: global batches r, r + 2, ...); the adapter hands out batch i's shards at step i."""
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
        # a bucket below the largest parameter (4096): stage 3's buckets then have rows of
        # several widths, which the scratch pool once handed out in another bucket's shape
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 4000,
                              "stage3_param_persistence_threshold": 0},  # fmt: skip
        "sequence_parallel_size": world,
    }
    model = _model()
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=world,
        micro_batch_size=MICRO,
        seq_length=SEQ,
        seq_length_is_variable=True,
    )
    engine, *_ = deepspeed.initialize(
        config=config, model=model, model_parameters=model.parameters(), mpu=mpu
    )
    sp_group = mpu.get_sequence_parallel_group()
    sp_world_size = mpu.get_sequence_parallel_world_size()
    mine = [_batch(i, masked) for i in range(rank, 2 * STEPS, world)]
    dl = torch.utils.data.DataLoader(mine, batch_size=None)
    dl = UlyssesSPDataLoaderAdapter(dl, sp_rank=mpu.get_sequence_parallel_rank(),
                                    sp_group=sp_group, sp_world_size=sp_world_size,
                                    device=engine.device)  # fmt: skip
    out = []
    for _, batch in zip(range(STEPS), dl, strict=False):
        outputs = engine(**batch)
        shift_labels = batch["shift_labels"]
        if loss_kind == "tutorial":  # DeepSpeed's tutorial, word for word
            loss = engine.module.loss_function(
                logits=outputs.logits, labels=None, shift_labels=shift_labels,
                vocab_size=engine.module.config.vocab_size,
            )  # fmt: skip
            losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
            good_tokens = (shift_labels != -100).view(-1).sum()
            good_tokens_per_rank = torch.distributed.nn.functional.all_gather(
                good_tokens, group=sp_group
            )
            total_loss = sum(losses_per_rank[r] * good_tokens_per_rank[r]
                             for r in range(sp_world_size))  # fmt: skip
            loss = total_loss / max(sum(good_tokens_per_rank), 1)
        else:
            loss = ulysses_sp_loss(outputs.logits, shift_labels, sp_group)
        engine.backward(loss)
        engine.step()
        state = engine.full_state_dict()
        out.append((state if rank == 0 else None, engine.get_global_grad_norm(), loss.item()))
    assert engine.topology.sp == world and engine.topology.tp == 1
    engine.destroy()
    return out


def _compare(results, masked):
    ref = _reference(masked)
    for rank_out in results:
        for step, ((state, norm, loss), (want, want_norm, want_loss)) in enumerate(
            zip(rank_out, ref, strict=True)
        ):
            assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (step, loss, want_loss)
            assert abs(norm - want_norm) <= 1e-5 * want_norm, (step, norm, want_norm)
            if state is not None:
                diff, name = max_rel_diff(state, want)
                assert diff <= 1e-5, f"step {step}, {name}: relative difference {diff:.2e}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_alst_script_matches_single_process_training(stage):
    """At every ZeRO stage the gradient norm matches, not only the weights (issue 34 reports
    DeepSpeed 0.19.8's ALST doubling the Ulysses gradients at ZeRO 1 and 2, which Adam hides)."""
    _compare(run_distributed(_alst, 2, args=(stage, "tutorial", False)), masked=False)


def test_loss_is_the_mean_over_every_shards_labelled_tokens():
    """The first half of each row is ignored: sp rank 0's shard holds no label at all, rank 1's
    all of them. ulysses_sp_loss is the whole sequence's mean (no NaN on rank 0)."""
    _compare(run_distributed(_alst, 2, args=(2, "helper", True)), masked=True)


def _objective(logits: torch.Tensor) -> torch.Tensor:
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(7))
    return (logits * w).sum()


def _packed_positions() -> torch.Tensor:
    """Row 0: one sequence; row 1: documents of 12 and 20 tokens (positions restart)."""
    return torch.stack([torch.arange(SEQ), torch.cat([torch.arange(12), torch.arange(20)])])


def _attention_cases(rank, world):
    """MQA (1 kv head, sp 2: repeated to one per rank) and packed documents (sdpa: causal
    within each document) against the whole sequence, forward and gradients."""
    import torch.distributed as dist

    from zerostack.sequence.hf_ulysses import UlyssesSPAttentionHF

    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(3))
    pos = _packed_positions()
    model = _model(kv_heads=1)
    # the reference, before Ulysses is registered: row 1 as its two documents, run apart
    rows = [model(input_ids=ids[:1]).logits[0]]
    rows.append(torch.cat([model(input_ids=ids[1:, :12]).logits[0],
                           model(input_ids=ids[1:, 12:]).logits[0]]))  # fmt: skip
    whole = torch.stack(rows)
    _objective(whole).backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world, MICRO)
    n = SEQ // world
    mine = slice(rank * n, (rank + 1) * n)
    logits = model(input_ids=ids[:, mine], position_ids=pos[:, mine]).logits
    w = torch.randn(whole.shape, generator=torch.Generator().manual_seed(7))
    (logits * w[:, mine]).sum().backward()  # the ranks' parts add up to the objective
    out_diff = float((logits - whole.detach()[:, mine]).abs().max())
    grad_diff = 0.0
    for k, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        grad_diff = max(grad_diff, float((g - want[k]).norm() / want[k].norm()))
    return out_diff, grad_diff, model.model.layers[0].self_attn.num_key_value_groups


def test_mqa_and_packed_documents_match_whole_sequence_attention():
    for out_diff, grad_diff, groups in run_distributed(_attention_cases, 2):
        assert out_diff <= 1e-5 and grad_diff <= 1e-5, (out_diff, grad_diff)
        assert groups == 4  # the module's own again (2 inside the call: one kv head per rank)


def _refusals(rank, world):
    import zerostack
    from zerostack.sequence.hf_ulysses import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    errors = []
    cfg = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": world,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}  # fmt: skip
    try:  # sp 2 on a Hugging Face model whose attention nobody wrapped
        zerostack.initialize(model=_model(), config=cfg)
    except zerostack.ConfigError as e:
        errors.append(str(e))
    model = _model()
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world, 1)
    try:  # the config's sp against the mpu's
        zerostack.initialize(model=model, config={**cfg, "sequence_parallel_size": 1}, mpu=mpu)
    except zerostack.ConfigError as e:
        errors.append(str(e))

    class DeepSpeedStyle:  # DeepSpeed's parallel_state_sp: model-parallel getters are sp's
        initialize_sequence_parallel = None
        get_sequence_parallel_world_size = get_model_parallel_world_size = lambda: world
        get_sequence_parallel_group = get_model_parallel_group = mpu.get_sequence_parallel_group

    engine, *_ = zerostack.initialize(model=model, config=cfg, mpu=DeepSpeedStyle)
    errors.append((engine.topology.sp, engine.topology.tp))  # a grid of its own, sp from it
    odd = {"input_ids": torch.zeros(1, SEQ - 1, dtype=torch.long),
           "position_ids": torch.arange(SEQ - 1)[None]}  # fmt: skip
    dl = UlyssesSPDataLoaderAdapter([odd], rank, mpu.get_sequence_parallel_group(), world, "cpu")
    try:
        next(dl)
    except ValueError as e:
        errors.append(str(e))
    group = mpu.get_sequence_parallel_group()
    try:
        no_pos = [{"input_ids": odd["input_ids"]}]
        next(UlyssesSPDataLoaderAdapter(no_pos, rank, group, world, "cpu"))
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_refusals_name_the_problem():
    from zerostack.sequence.hf_ulysses import UlyssesSPAttentionHF

    for heads, kv, match in [(3, 3, "head count 3 is not divisible by sequence_parallel_size 2"),
                             (4, 3, "kv head count 3 is not divisible")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            UlyssesSPAttentionHF.register_with_transformers(_config(heads, kv), "sdpa", 2, 1)
    with pytest.raises(ValueError, match="'eager' is not supported by Ulysses"):
        UlyssesSPAttentionHF.register_with_transformers(_config(), "eager", 2, 1)
    model = _model()
    with pytest.raises(ValueError, match="does not match model config attn_implementation"):
        UlyssesSPAttentionHF.register_with_transformers(model, "flash_attention_2", 2, 1)
    with pytest.raises(ValueError, match="seq_length 33 is not divisible"):
        UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, seq_length=33)
    assert UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 1, 1) is None
    for errors in run_distributed(_refusals, 2):
        no_wrap, disagree, sizes, odd, no_positions = errors
        assert "UlyssesSPAttentionHF.register_with_transformers" in no_wrap
        assert disagree == ("sequence_parallel_size: 1 disagrees with the mpu's "
                            "sequence-parallel size (2)")  # fmt: skip
        assert sizes == (2, 1)
        assert "sequence length 31 is not divisible by sequence_parallel_size 2" in odd
        assert "a batch needs 'position_ids'" in no_positions

