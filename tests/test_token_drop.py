"""Random-LTD (zerostack.data.token_drop) against DeepSpeed 0.19.8 and against plain indexing.

tests/golden/random_ltd.json holds DeepSpeed's own runs (scripts/random_ltd_golden.py, its three
CUDA kernels replaced by the torch index operations they compute): zerostack under the facade
trains the same model to the same losses, kept lengths and layer-token counts. The wrapper's
gather and scatter are checked against per-sample indexing, outputs and gradients; sharding
composes (stage 3 on 2 ranks equals stage 0); the schedule survives a checkpoint.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from torch import nn

from zerostack.config import ConfigError
from zerostack.data import token_drop

from tests.support.ranks import run_distributed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
import random_ltd_golden as golden  # noqa: E402

GOLDEN = json.load(open(os.path.join(os.path.dirname(__file__), "golden", "random_ltd.json")))


def _facade_run(rank, world, name):
    import zerostack.compat.deepspeed as deepspeed
    from zerostack.compat.deepspeed.runtime.data_pipeline.data_routing.helper import (
        convert_to_random_ltd,
    )

    engine, *_ = deepspeed.initialize(model=golden.model(name),
                                      config=golden.config(golden.CASES[name]))  # fmt: skip
    return golden.train(engine, name, convert_to_random_ltd, lambda e: e.module_state_dict())


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(golden.CASES))
def test_training_equals_deepspeeds(name):
    """Decoder (no mask, [batch, seq, h], SGD at stage 0) and encoder (padding mask gathered,
    [seq, batch, h], Adam at stage 1): DeepSpeed's losses step by step, its kept lengths
    (4 = 5 rounded down to seq_per_step, up to the sequence), its layer-token counts and its
    state dict names (the wrappers out)."""
    want = GOLDEN["cases"][name]
    (got,) = run_distributed(_facade_run, world=1, args=(name,))
    assert got["kept"] == want["kept"] and got["consumed"] == want["consumed"]
    assert got["state_dict"] == want["state_dict"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert min(want["kept"]) < golden.SEQ  # tokens were dropped on the way


def _by_indexing(layer, x, idx, batch_first, **kwargs):
    """The wrapped layer's result, written with per-sample indexing: the kept tokens through
    the layer, the rest as they were."""
    out = x.clone()
    for b in range(idx.shape[0]):
        keep = idx[b].long()
        if batch_first:
            out[b, keep] = layer(x[b : b + 1, keep], **kwargs)[0]
        else:
            out[keep, b] = layer(x[keep, b : b + 1], **kwargs)[:, 0]
    return out


@pytest.mark.parametrize("batch_first", [True, False])
def test_gather_and_scatter_equal_per_sample_indexing(batch_first):
    """One wrapped layer's output and every gradient (input and weights) equal the indexing
    reference's, on the same draw: the layer's path at kept positions, identity elsewhere."""
    torch.manual_seed(0)
    layer = golden.Block(seq_first=not batch_first)
    shape = (3, golden.SEQ, golden.WIDTH) if batch_first else (golden.SEQ, 3, golden.WIDTH)
    x = torch.randn(shape, requires_grad=True)
    idx, _ = token_drop.sample_tokens(5, golden.SEQ, 3, 1, "cpu")
    part = token_drop.gather_tokens(x, idx[0], batch_first)
    got = token_drop.scatter_tokens(x, layer(part), idx[0], batch_first)
    x_ref = x.detach().clone().requires_grad_(True)
    want = _by_indexing(layer, x_ref, idx[0], batch_first)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    w = torch.randn(shape)
    g_got = torch.autograd.grad((got * w).sum(), [x, *layer.parameters()])
    g_want = torch.autograd.grad((want * w).sum(), [x_ref, *layer.parameters()])
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    untouched = torch.ones(golden.SEQ, dtype=torch.bool)
    untouched[idx[0][0].long()] = False
    row = (lambda t: t[0]) if batch_first else (lambda t: t[:, 0])
    assert torch.equal(row(g_got[0])[untouched], row(w)[untouched])  # identity: w itself


def test_sampling_is_sorted_distinct_and_masks_follow():
    """Each row of the draw: distinct positions in order; a decoder's mask is cut to the kept
    length, an encoder's gathered at each sample's kept rows and columns."""
    mask = torch.randn(2, 1, 9, 9)
    torch.manual_seed(3)
    idx, dec = token_drop.sample_tokens(4, 9, 2, 3, "cpu", mask)
    assert idx.shape == (3, 2, 4) and idx.dtype == torch.int32
    for row in idx.reshape(-1, 4):
        assert row.unique().numel() == 4 and torch.equal(row, row.sort().values)
    assert torch.equal(dec, mask[:, :, :4, :4])
    torch.manual_seed(3)
    idx2, enc = token_drop.sample_tokens(4, 9, 2, 3, "cpu", mask, encoder=True)
    assert torch.equal(idx, idx2) and len(enc) == 3
    for layer in range(3):
        for b in range(2):
            keep = idx[layer, b].long()
            assert torch.equal(enc[layer][b, 0], mask[b, 0][keep][:, keep])
    with pytest.raises(ValueError, match="encoder needs the attention mask"):
        token_drop.sample_tokens(4, 9, 2, 1, "cpu", None, encoder=True)


def _ranks_run(rank, world, stage, root):
    """The decoder case on 2 ranks (each rank its own data) at ``stage``; a checkpoint of the
    schedule after 5 steps, loaded into a fresh engine."""
    import zerostack.compat.deepspeed as deepspeed
    from zerostack.compat.deepspeed.runtime.data_pipeline.data_routing.helper import (
        convert_to_random_ltd,
    )

    name = "decoder_sgd_stage0"
    cfg = golden.config(golden.CASES[name])
    cfg["zero_optimization"] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    engine, *_ = deepspeed.initialize(model=golden.model(name), config=cfg)
    engine = convert_to_random_ltd(engine, golden.Block)
    torch.manual_seed(1)
    losses = []
    for step, (ids, labels, _) in enumerate(golden.batches()):
        ids = (ids + rank) % golden.VOCAB
        loss = engine(ids, labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == 4:
            engine.save_checkpoint(root, tag="ltd")
            saved = dict(engine.random_ltd_scheduler.state_dict())
    fresh, *_ = deepspeed.initialize(model=golden.model(name), config=cfg)
    convert_to_random_ltd(fresh, golden.Block)
    fresh.load_checkpoint(root, tag="ltd")
    return losses, saved, fresh.random_ltd_scheduler.state_dict()


@pytest.mark.distributed
def test_sharded_stages_drop_the_same_tokens_and_the_schedule_is_checkpointed(tmp_path):
    """Stage 3 on 2 ranks trains as stage 0 does (the same draws, sharded parameters); the
    schedule's state after 5 steps comes back from the checkpoint."""
    base = run_distributed(_ranks_run, world=2, args=(0, str(tmp_path / "s0")))
    sharded = run_distributed(_ranks_run, world=2, args=(3, str(tmp_path / "s3")))
    for (l0, saved, loaded), (l3, _, _) in zip(base, sharded, strict=True):
        assert l3 == pytest.approx(l0, rel=1e-5)
        want = GOLDEN["cases"]["decoder_sgd_stage0"]
        assert loaded == saved and saved["current_value"] == want["kept"][4]
        assert saved["consumed_layer_tokens"] == want["consumed"][4] * 2  # twice the batch


def _gpt2_run(rank, world):
    """Hugging Face's GPT-2 blocks (they get their mask by position) under random-LTD: the
    logits equal per-block indexing on the same draw."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    import zerostack.compat.deepspeed as deepspeed
    from zerostack.compat.deepspeed.runtime.data_pipeline.data_routing.helper import (
        convert_to_random_ltd,
        save_without_random_ltd,
    )

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=3, n_head=2,
                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)  # fmt: skip
    model = GPT2LMHeadModel(cfg)
    names = list(model.state_dict())
    ds = golden.config(golden.CASES["decoder_sgd_stage0"])
    ltd = ds["data_efficiency"]["data_routing"]["random_ltd"]
    ltd.update(total_layer_num=3, random_ltd_layer_id=[1, 2], model_mask_name="attention_mask")
    engine, *_ = deepspeed.initialize(model=model, config=ds)
    convert_to_random_ltd(engine, GPT2Block)
    ids = torch.randint(0, 32, (2, 12))
    got = engine(input_ids=ids).logits  # step 0: 4 of 12 tokens kept
    kept = engine.random_ltd_scheduler.state["sample_idx"]
    inner = engine.module.transformer
    x = inner.wte(ids) + inner.wpe(torch.arange(12))
    for i, block in enumerate(inner.h):
        layer = block.random_ltd_layer
        if i == 0:
            x = layer(x)
        else:
            x = _by_indexing(layer, x, kept[i - 1], True)
    want = engine.module.lm_head(inner.ln_f(x))
    return got.detach(), want.detach(), list(save_without_random_ltd(engine)) == names


@pytest.mark.distributed
def test_hugging_face_gpt2_blocks_with_positional_mask():
    """DeepSpeedExamples' GPT-2 case: DeepSpeed 0.19.8's wrapper takes only the hidden states
    by position, and transformers 5 passes GPT-2's blocks their mask by position (a TypeError
    there); here the arguments are bound by name and the logits equal per-block indexing."""
    ((got, want, names_back),) = run_distributed(_gpt2_run, world=1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert names_back


def _refused(rank, world, cfg_update, native):
    from transformers import GPT2Config, GPT2LMHeadModel

    import zerostack
    import zerostack.compat.deepspeed as deepspeed

    cfg = golden.config(golden.CASES["decoder_sgd_stage0"])
    cfg.update(cfg_update)
    init = zerostack.initialize if native else deepspeed.initialize
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=2,
                                       n_head=2))  # fmt: skip
    try:
        init(model=model, config=cfg)
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.distributed
def test_refusals():
    """Natively, and beside tensor parallelism: one line naming the setting and why."""
    (native,) = run_distributed(_refused, world=1, args=({}, True))
    assert native.startswith("data_efficiency.data_routing.random_ltd: DeepSpeed's "
                             "convert_to_random_ltd")  # fmt: skip
    tp = run_distributed(_refused, world=2, args=({"tensor_parallel": {"autotp_size": 2}}, False))
    assert all(t is not None and "random_ltd with tp 2" in t for t in tp)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"random_ltd_layer_id": [1]}, "random_ltd.random_ltd_layer_id: names 1 layers"),
        ({"model_type": "both"}, "random_ltd.model_type"),
        ({"layer_token_lr_schedule": {"enabled": True}}, "layer_token_lr_schedule.enabled"),
        ({"random_ltd_schedule": {"min_value": 20, "max_value": 12, "schedule_type":
          "fixed_linear", "schedule_config": {"require_steps": 6, "seq_per_step": 2}}},
         "min_value: 20 is above max_value 12"),
    ],
)  # fmt: skip
def test_config_errors_name_the_key(change, message):
    from zerostack.config.load import load_config

    cfg = golden.config(golden.CASES["decoder_sgd_stage0"])
    cfg["data_efficiency"]["data_routing"]["random_ltd"].update(change)
    cfg["train_batch_size"] = 4
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(cfg)


def test_eval_and_full_length_run_every_token():
    """In evaluation, or once every token is kept, a wrapped layer is the layer itself."""
    torch.manual_seed(0)
    block = golden.Block(seq_first=False)
    wrapped = token_drop.RandomLayerTokenDrop(block)
    ltd = golden.config(golden.CASES["decoder_sgd_stage0"])["data_efficiency"]
    cfg = {**ltd["data_routing"]["random_ltd"], "global_batch_size": 4, "micro_batch_size": 4,
           "layer_token_lr_schedule": {"enabled": False}}  # fmt: skip
    sched = token_drop.RandomLTDScheduler(cfg)
    wrapped.init_config(cfg, sched, 0)
    x = torch.randn(2, golden.SEQ, golden.WIDTH)
    wrapped.eval()
    assert torch.equal(wrapped(x), block(x))
    wrapped.train()
    assert not torch.allclose(wrapped(x), block(x))  # 4 of 12 kept: the others pass unchanged
    sched.set_current_seq(golden.SEQ)
    assert torch.equal(wrapped(x), block(x))
    with pytest.raises(ValueError, match="random_ltd_layer_num 2 must be equivalent"):
        token_drop.initialize_layers(nn.Sequential(wrapped), cfg, sched)


def test_schedule_equals_deepspeeds():
    """Kept lengths (rounded down to seq_per_step, capped at max_value) and layer-tokens
    counted once per step however many micro-steps read it: DeepSpeed's figures."""
    assert golden.schedule(token_drop.RandomLTDScheduler) == GOLDEN["schedule"]


def _post_process(rank, world):
    import zerostack.compat.deepspeed as deepspeed

    data = [(torch.full((2,), float(i)), torch.tensor(i % 3)) for i in range(8)]
    cfg = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, loader, _ = deepspeed.initialize(model=nn.Linear(2, 3), config=cfg,
                                                training_data=data)  # fmt: skip
    before = [b[0].tolist() for b in loader]
    calls = []
    engine.set_data_post_process_func(lambda batch, state: calls.append(state) or batch * 0)
    after = [b[0].tolist() for b in engine.training_dataloader]
    return before, after, calls, engine.training_dataloader.post_process_func is not None


@pytest.mark.distributed
def test_set_data_post_process_func_as_deepspeed_without_curriculum_learning():
    """The loader keeps the function; DeepSpeed's loader applies it only under curriculum
    learning (its ``if self.curriculum_learning_enabled`` branch; refused here), so the
    batches are unchanged and it is never called."""
    ((before, after, calls, kept),) = run_distributed(_post_process, world=1)
    assert kept and calls == [] and before == after and len(before) == 4


def test_a_mask_passed_by_position_is_found_by_name():
    """A block that gets its mask by position drops the same tokens, with the same mask cut,
    as one that gets it by keyword (DeepSpeed's wrapper takes only the hidden states by
    position)."""
    torch.manual_seed(0)
    block = golden.Block(seq_first=False)
    wrapped = token_drop.RandomLayerTokenDrop(block)
    ltd = golden.config(golden.CASES["encoder_adam_stage1_seq_first"])["data_efficiency"]
    cfg = {**ltd["data_routing"]["random_ltd"], "hidden_state_order": "batch_seq_dim",
           "global_batch_size": 2, "micro_batch_size": 2}  # fmt: skip
    cfg["layer_token_lr_schedule"] = {"enabled": False}
    wrapped.init_config(cfg, token_drop.RandomLTDScheduler(cfg), 0)
    x = torch.randn(2, golden.SEQ, golden.WIDTH)
    mask = torch.zeros(2, 1, golden.SEQ, golden.SEQ)
    mask[:, :, :, 3:] = -1e4
    torch.manual_seed(5)
    by_position = wrapped(x, mask)
    torch.manual_seed(5)
    by_keyword = wrapped(x, attention_mask=mask)
    torch.manual_seed(5)
    unmasked = wrapped.random_ltd_layer(x)  # the draw aside: the mask matters to the block
    assert torch.equal(by_position, by_keyword) and not torch.allclose(by_position, unmasked)
    with pytest.raises(ValueError, match="encoder needs the attention mask"):
        wrapped(x)
