"""The ALST tutorial's context for Hugging Face models under torch's non-reentrant checkpoint
(``deepspeed.runtime.activation_checkpointing.offload_activations.
get_checkpoint_hidden_states_offloading_ctx_manager``, zerostack's
:mod:`zerostack.activation_checkpointing.offload_inputs`): on virtual CUDA the checkpointed
layers' hidden-state inputs leave the device, as the allocator's count shows, all but the last
``keep_last_count``; gradients are those of a run without it, bit for bit."""

from __future__ import annotations

import pytest
import torch

from zerostack.activation_checkpointing.offload_inputs import offload_checkpoint_inputs
from zerostack.compat.deepspeed.runtime.activation_checkpointing.offload_activations import (
    get_checkpoint_hidden_states_offloading_ctx_manager,
)

from tests.support.vcuda import MEMORY, virtual_cuda

transformers = pytest.importorskip("transformers")

LAYERS, BATCH, SEQ, HIDDEN = 4, 2, 32, 64


def _model(device: str = "cpu"):
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device)
    model.gradient_checkpointing_enable()
    model.train()
    return model


def _grads(model, ctx=None, device="cpu"):
    x = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    x = x.to(device)
    held = None
    with ctx if ctx is not None else torch.enable_grad():
        loss = model(input_ids=x, labels=x).loss
        held = MEMORY.allocated
        loss.backward()
    grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
    return loss.item(), grads, held


@pytest.mark.parametrize("keep_last", [0, 1, 2])
def test_hidden_states_leave_the_device_and_gradients_are_unchanged(keep_last):
    want_loss, want, _ = _grads(_model())
    layer = transformers.GradientCheckpointingLayer
    before = layer.__dict__.get("__call__")
    with virtual_cuda():
        plain_loss, plain, plain_held = _grads(_model("cuda"), device="cuda")
        ctx = get_checkpoint_hidden_states_offloading_ctx_manager(keep_last_count=keep_last)
        loss, grads, held = _grads(_model("cuda"), ctx, device="cuda")
        offloaded = ctx.offloaded
        again = _grads(_model("cuda"), ctx, device="cuda")  # one context reused, as the tutorial
    hidden_bytes = BATCH * SEQ * HIDDEN * 4
    assert offloaded == (LAYERS - keep_last) * hidden_bytes
    assert plain_held - held == offloaded  # the allocator holds that much less after forward
    assert loss == plain_loss == want_loss and again[0] == loss
    for name in want:
        assert torch.equal(grads[name], want[name]) and torch.equal(plain[name], want[name]), name
        assert torch.equal(again[1][name], want[name]), name
    assert layer.__dict__.get("__call__") is before  # the marker is gone with the context


def test_host_tensors_and_small_ones_stay():
    """A CPU run offloads nothing; below ``min_offload_bytes`` nothing moves either."""
    ctx = offload_checkpoint_inputs()
    loss, grads, _ = _grads(_model(), ctx)
    assert ctx.offloaded == 0
    with virtual_cuda():
        small = offload_checkpoint_inputs(min_offload_bytes=BATCH * SEQ * HIDDEN * 4 + 1)
        _grads(_model("cuda"), small, device="cuda")
        assert small.offloaded == 0


def test_bad_arguments_and_a_reentered_context_are_refused():
    with pytest.raises(ValueError, match="^keep_last_count must be an integer >= 0, got -1$"):
        offload_checkpoint_inputs(keep_last_count=-1)
    ctx = offload_checkpoint_inputs()
    with ctx:
        with pytest.raises(RuntimeError, match="this context is active already"):
            ctx.__enter__()
