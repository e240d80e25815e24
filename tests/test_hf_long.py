"""A Hugging Face model with everything long-context training stacks on it: Ulysses and ring
attention, the MLP tiled (``TiledMLP``, patched into the Llama MLP as ArcticTraining's
``enable_tiled_mlp_compute`` does), the logits and loss tiled (``TiledFusedLogitsLoss`` on the base
model's hidden states, as ArcticTraining calls it, ``"sum"`` over the sp ranks' tokens), and the
layers' activation checkpoints kept in CPU memory (``gradient_checkpointing_enable()`` and the
config's ``"activation_checkpointing": {"cpu_checkpointing": true}``), under ZeRO-3 and ZeRO-1,
against single-process training on the whole sequence (tests/test_hf_ring.py's reference).

Parity: plain SGD, no clipping, 3 steps, 1e-5 relative per tensor and on the gradient norm and
the loss. The tiled paths and the host copies are counted, so a run that skipped them fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.ranks import run_distributed
from tests.test_hf_ring import LR, MICRO, SEQ, STEPS, _batch, _compare, _model, _reference

pytestmark = pytest.mark.distributed  # every test here starts ranks

TILES = 4


def _tile_llama_mlps(calls: list) -> None:
    """The Llama MLP's forward as a TiledMLP over ``TILES`` tiles (counted in ``calls``)."""
    from transformers.models.llama import modeling_llama

    from zerostack.compat.deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def tiled_forward(self, x):
        calls.append(x.shape)
        params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
        return TiledMLP.apply(mlp_forward, self, x, TILES, params)

    modeling_llama.LlamaMLP.forward = tiled_forward


def _logits_loss(model, x, y):
    """One tile's summed cross-entropy (ArcticTraining's fused loss function, summing)."""
    return F.cross_entropy(model.lm_head(x).float().flatten(0, -2), y.flatten(), reduction="sum")


def _long(rank, world, ring, stage):
    import zerostack.compat.deepspeed as deepspeed
    from zerostack import activation_checkpointing
    from zerostack.compat.deepspeed.runtime.sequence_parallel.ulysses_sp import (
        TiledFusedLogitsLoss,
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
    )

    mlp_calls, host = [], []
    _tile_llama_mlps(mlp_calls)
    real_host_empty = activation_checkpointing.host_empty

    def counting_host_empty(numel, dtype):
        host.append(numel)
        return real_host_empty(numel, dtype)

    activation_checkpointing.host_empty = counting_host_empty
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 4000,
                              "stage3_param_persistence_threshold": 0},  # fmt: skip
        "activation_checkpointing": {"cpu_checkpointing": True},
        "sequence_parallel_size": world,
        "ring_parallel_size": ring,
    }
    model = _model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=world,
        micro_batch_size=MICRO, seq_length=SEQ, ring_parallel_size=ring,
    )  # fmt: skip
    engine, *_ = deepspeed.initialize(config=config, model=model, mpu=mpu)
    group = mpu.get_sequence_parallel_group()
    mine = [_batch(i, False) for i in range(rank, world * STEPS, world)]
    dl = UlyssesSPDataLoaderAdapter(torch.utils.data.DataLoader(mine, batch_size=None),
                                    mpu.get_sequence_parallel_rank(), group, world,
                                    engine.device)  # fmt: skip
    out = []
    for _, batch in zip(range(STEPS), dl, strict=False):
        hidden = engine.module.model(input_ids=batch["input_ids"],
                                     position_ids=batch["position_ids"]).last_hidden_state
        labels = batch["shift_labels"]
        total = TiledFusedLogitsLoss.apply(_logits_loss, engine.module, hidden, labels, None,
                                           TILES, [engine.module.lm_head.weight], "sum")
        good = (labels != -100).sum()
        totals = torch.distributed.nn.functional.all_gather(total, group=group)
        goods = torch.distributed.nn.functional.all_gather(good, group=group)
        loss = sum(totals) / sum(goods)
        engine.backward(loss)
        engine.step()
        state = engine.full_state_dict()
        out.append((state if rank == 0 else None, engine.get_global_grad_norm(), loss.item()))
    engine.destroy()
    return out, len(mlp_calls), len(host)


@pytest.mark.parametrize("world,ring,stage", [(2, 2, 3), (2, 1, 3), (4, 2, 3), (2, 2, 1)])
def test_tiled_mlp_tiled_loss_and_cpu_checkpoints_match_single_process(world, ring, stage):
    results = run_distributed(_long, world, args=(ring, stage))
    for _, mlp_calls, host_copies in results:
        # per step, 2 layers: the forward and the recomputation of each layer's MLP
        assert mlp_calls == 2 * 2 * STEPS, mlp_calls
        # each checkpointed layer keeps its hidden states in host memory, once per forward
        assert host_copies >= 2 * STEPS, host_copies
    _compare([r[0] for r in results], _reference(False))


def _no_checkpointed_layer(rank, world):
    import zerostack

    config = {"train_micro_batch_size_per_gpu": 1, "activation_checkpointing":
              {"cpu_checkpointing": True}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    try:
        zerostack.initialize(model=_model(), config=config)
    except zerostack.ConfigError as e:
        return str(e)


def test_cpu_checkpointing_on_a_model_that_checkpoints_nothing_is_refused():
    assert run_distributed(_no_checkpointed_layer, 1) == [
        "activation_checkpointing.cpu_checkpointing: the Hugging Face model checkpoints no "
        "layer, so nothing would be kept on the CPU; call model.gradient_checkpointing_enable() "
        "before initialize"
    ]
