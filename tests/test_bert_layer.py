"""``deepspeed.DeepSpeedTransformerLayer`` (zerostack.models.bert_layer) against references:
post-LN against Hugging Face's ``BertLayer``, pre-LN against a BERT layer written here from
DeepSpeedExamples' ``training/bing_bert/nvidia/modelingpreln.py``, the initialisation against
DeepSpeed's formula, dropout's on/off rule and the configs DeepSpeed's kernel refuses.

The parity tolerance is 1e-5 in fp32: the two sides do the same operations in a different order
(one qkv matmul against three, a different GELU formula), a few ulps apart. In training mode the
parity holds too: both draw their three dropout masks from torch's generator, of the same shapes
in the same order, so a dropout in the wrong place shows."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn

from zerostack.models.bert_layer import (
    PARAMETERS,
    DeepSpeedTransformerConfig,
    DeepSpeedTransformerLayer,
)

H, HEADS, INTER, B, S = 32, 4, 64, 2, 5
TOL = 1e-5


def config(**kw) -> DeepSpeedTransformerConfig:
    args = dict(batch_size=B, hidden_size=H, intermediate_size=INTER, heads=HEADS,
                attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1, num_hidden_layers=2,
                initializer_range=0.02, pre_layer_norm=False)
    return DeepSpeedTransformerConfig(**{**args, **kw})


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states, BERT's extended mask (the second sample's last two tokens are padding)
    and an upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, generator=g)
    keep = torch.ones(B, S)
    keep[1, -2:] = 0
    mask = (1.0 - keep)[:, None, None, :] * -10000.0
    return x, mask, torch.randn(B, S, H, generator=g)


def randomise(module: nn.Module, seed: int = 1) -> None:
    """Weights and biases ~ N(0, 0.2), norm scales ~ N(1, 0.2): away from their initial values,
    so every one shows, and activations of order 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            one = "LayerNorm" in name and name.endswith("weight")
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if one else 0.0))


def ds_layer(cfg, weights, biases) -> DeepSpeedTransformerLayer:
    """The layer from ``initial_weights``/``initial_biases`` (copies, so its gradients are its
    own), then the q, k, v biases DeepSpeed does not take from ``initial_biases``."""
    own = lambda ts: [nn.Parameter(t.detach().clone()) for t in ts]  # noqa: E731
    layer = DeepSpeedTransformerLayer(cfg, own(weights), own(biases))
    assert torch.count_nonzero(layer.attn_qkvb) == 0  # DeepSpeed ignores initial_biases[0:3]
    with torch.no_grad():
        layer.attn_qkvb.copy_(torch.cat([b.detach() for b in biases[:3]]))
    return layer


def run(module, x, mask, grad_out, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and input gradient; the same dropout draws each call (a fixed torch seed)."""
    torch.manual_seed(7)
    x = x.clone().requires_grad_()
    out = module(x, mask, **kw)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad_out)
    return out.detach(), x.grad


def check_parity(ds, ref_out, ref_x_grad, ds_out, ds_x_grad, ref_grads: dict) -> None:
    assert torch.allclose(ds_out, ref_out, atol=TOL, rtol=0), (ds_out - ref_out).abs().max()
    assert torch.allclose(ds_x_grad, ref_x_grad, atol=TOL, rtol=0)
    for name in PARAMETERS:
        got, want = getattr(ds, name).grad, ref_grads[name]
        assert torch.allclose(got, want, atol=TOL, rtol=0), (name, (got - want).abs().max())


# --- post-LN: Hugging Face's BertLayer -------------------------------------------------------


def hf_bert_layer(train: bool) -> nn.Module:
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    hf_cfg = BertConfig(hidden_size=H, num_attention_heads=HEADS, intermediate_size=INTER,
                        hidden_act="gelu_new",  # the tanh GELU, as DeepSpeed's kernel computes it
                        attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.1,
                        attn_implementation="eager")
    layer = BertLayer(hf_cfg)
    randomise(layer)
    return layer.train(train)


@pytest.mark.parametrize("train", [False, True])
def test_post_ln_matches_hugging_face_bert_layer_forward_and_gradients(train):
    hf = hf_bert_layer(train)
    a, o, i = hf.attention.self, hf.attention.output, hf.output
    # DeepSpeed's order: q, k, v, attention output, attention norm, intermediate, output, norm
    mods = [a.query, a.key, a.value, o.dense, o.LayerNorm, hf.intermediate.dense, i.dense,
            i.LayerNorm]
    ds = ds_layer(config(), [m.weight for m in mods], [m.bias for m in mods]).train(train)
    x, mask, grad_out = inputs()
    ref_out, ref_x_grad = run(hf, x, mask, grad_out)
    ds_out, ds_x_grad = run(ds, x, mask, grad_out)
    cat = lambda ts: torch.cat([t.grad for t in ts])  # noqa: E731
    pairs = zip(PARAMETERS[2:], [w for m in mods[3:] for w in (m.weight, m.bias)], strict=True)
    grads = {name: p.grad for name, p in pairs}
    grads |= {"attn_qkvw": cat([m.weight for m in mods[:3]]),
              "attn_qkvb": cat([m.bias for m in mods[:3]])}
    check_parity(ds, ref_out, ref_x_grad, ds_out, ds_x_grad, grads)


# --- pre-LN: DeepSpeedExamples' modelingpreln.BertLayer -------------------------------------


class PreLNBertLayer(nn.Module):
    """``BertLayer`` of DeepSpeedExamples' ``training/bing_bert/nvidia/modelingpreln.py``
    (its BertSelfAttention, BertSelfOutput, BertIntermediate and BertOutput inlined): layer norm
    before attention and before the MLP, the residuals added after, no norm on the output
    (its BertEncoder's FinalLayerNorm follows the last layer). GELU is the tanh form here, the
    kernel's; modelingpreln's own is erf."""

    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = (nn.Linear(H, H) for _ in range(3))
        self.attn_out = nn.Linear(H, H)
        self.PreAttentionLayerNorm = nn.LayerNorm(H, eps=1e-12)
        self.PostAttentionLayerNorm = nn.LayerNorm(H, eps=1e-12)
        self.inter = nn.Linear(H, INTER)
        self.out = nn.Linear(INTER, H)
        self.dropout = nn.Dropout(0.1)

    def heads(self, t):
        return t.view(B, S, HEADS, H // HEADS).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask):
        ln = self.PreAttentionLayerNorm(hidden_states)
        q, k, v = (self.heads(f(ln)) for f in (self.query, self.key, self.value))
        scores = torch.matmul(q, k.permute(0, 1, 3, 2)) / math.sqrt(H // HEADS) + attention_mask
        probs = self.dropout(nn.Softmax(dim=-1)(scores))
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).reshape(B, S, H)
        intermediate_input = hidden_states + self.dropout(self.attn_out(ctx))
        t = self.inter(self.PostAttentionLayerNorm(intermediate_input))
        t = 0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t.pow(3))))
        return self.dropout(self.out(t)) + intermediate_input


@pytest.mark.parametrize("train", [False, True])
def test_pre_ln_matches_modelingpreln_bert_layer_forward_and_gradients(train):
    ref = PreLNBertLayer()
    randomise(ref)
    ref.train(train)
    # pre-LN: the kernel's norm_w is the pre-attention norm, attn_nw the pre-MLP one
    mods = [ref.query, ref.key, ref.value, ref.attn_out, ref.PostAttentionLayerNorm, ref.inter,
            ref.out, ref.PreAttentionLayerNorm]
    ds = ds_layer(config(pre_layer_norm=True), [m.weight for m in mods], [m.bias for m in mods])
    ds.train(train)
    x, mask, grad_out = inputs(seed=3)
    ref_out, ref_x_grad = run(ref, x, mask, grad_out)
    ds_out, ds_x_grad = run(ds, x, mask, grad_out)
    pairs = zip(PARAMETERS[2:], [w for m in mods[3:] for w in (m.weight, m.bias)], strict=True)
    grads = {name: p.grad for name, p in pairs}
    grads |= {"attn_qkvw": torch.cat([m.weight.grad for m in mods[:3]]),
              "attn_qkvb": torch.cat([m.bias.grad for m in mods[:3]])}
    check_parity(ds, ref_out, ref_x_grad, ds_out, ds_x_grad, grads)


# --- initialisation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "local_rank, adjust, adjusted",
    [(0, True, True), (-1, True, False), (0, False, False)],
)
def test_default_initialisation_is_deepspeeds(local_rank, adjust, adjusted):
    """Weights ~ N(0, initializer_range), biases 0, norms 1; attn_ow and output_w at
    initializer_range / sqrt(2 * layers) with adjust_init_range, where DeepSpeed adjusts: only
    on local_rank 0."""
    torch.manual_seed(0)
    cfg = config(hidden_size=128, intermediate_size=512, num_hidden_layers=8,
                 local_rank=local_rank, adjust_init_range=adjust)
    layer = DeepSpeedTransformerLayer(cfg)
    assert [n for n, _ in layer.named_parameters()] == list(PARAMETERS)
    std = 0.02
    out_std = std / math.sqrt(2.0 * 8) if adjusted else std
    for name, want in (("attn_qkvw", std), ("inter_w", std), ("attn_ow", out_std),
                       ("output_w", out_std)):
        w = getattr(layer, name).detach()
        assert w.std().item() == pytest.approx(want, rel=0.05), name
        assert abs(w.mean().item()) < want * 0.05, name
    for name in ("attn_qkvb", "attn_ob", "attn_nb", "inter_b", "output_b", "norm_b"):
        assert torch.count_nonzero(getattr(layer, name)) == 0, name
    assert torch.all(layer.attn_nw == 1) and torch.all(layer.norm_w == 1)


def test_layer_ids_count_and_a_layer_deep_copies():
    first = DeepSpeedTransformerLayer(config())
    second = DeepSpeedTransformerLayer(config())
    assert second.config.layer_id == first.config.layer_id + 1
    assert DeepSpeedTransformerLayer.layer_id == second.config.layer_id + 1
    clone = copy.deepcopy(second)  # DeepSpeedExamples build their encoders so
    x, mask, _ = inputs()
    assert torch.equal(clone.eval()(x, mask), second.eval()(x, mask))


def test_config_from_dict_and_json_file_utf16_or_utf8(tmp_path):
    cfg = DeepSpeedTransformerConfig()
    assert (cfg.layer_norm_eps, cfg.pre_layer_norm, cfg.adjust_init_range) == (1e-12, True, True)
    assert (cfg.fp16, cfg.return_tuple, cfg.training, cfg.local_rank) == (False, False, True, -1)
    d = {"hidden_size": 16, "heads": 2, "initializer_range": 0.02, "pre_layer_norm": False}
    assert DeepSpeedTransformerConfig.from_dict(d).intermediate_size == 64
    for encoding in ("utf-16", "utf-8"):
        path = tmp_path / f"{encoding}.json"
        path.write_text(json.dumps(d), encoding=encoding)
        cfg = DeepSpeedTransformerConfig.from_json_file(str(path))
        assert (cfg.hidden_size, cfg.heads, cfg.pre_layer_norm) == (16, 2, False)
    with pytest.raises(ValueError, match="did you mean 'heads'"):
        DeepSpeedTransformerConfig.from_dict({"head": 2})


# --- dropout, outputs, dtypes ---------------------------------------------------------------


@pytest.mark.parametrize("pre_ln", [False, True])
@pytest.mark.parametrize("ratio", ["attn_dropout_ratio", "hidden_dropout_ratio"])
def test_dropout_in_training_only_while_autograd_records(pre_ln, ratio):
    rates = {"attn_dropout_ratio": 0.0, "hidden_dropout_ratio": 0.0, ratio: 0.1}
    layer = DeepSpeedTransformerLayer(config(pre_layer_norm=pre_ln, **rates))
    x, mask, _ = inputs()
    layer.train()
    assert not torch.equal(layer(x, mask), layer(x, mask))
    with torch.no_grad():  # the kernel drops out only when training and recording
        no_grad = layer(x, mask)
    layer.eval()
    assert torch.equal(layer(x, mask), layer(x, mask))
    assert torch.equal(layer(x, mask), no_grad)
    quiet = copy.deepcopy(layer).train()
    setattr(quiet.config, ratio, 0.0)
    assert torch.equal(quiet(x, mask), no_grad)


def test_return_tuple_grads_hook_and_half_precision():
    layer = DeepSpeedTransformerLayer(config(return_tuple=True)).eval()
    x, mask, grad_out = inputs()
    (out,) = layer(x, mask)
    grads = []
    layer.zero_grad()
    layer(x, mask, grads=grads)[0].backward(grad_out)
    tags = {tag: g for g, tag in grads}
    assert set(tags) == {"V_W", "V_B", "O_W", "O_B", "N2_W", "N2_B", "int_W", "int_B", "out_W",
                         "out_B", "norm_W", "norm_B"}
    assert torch.equal(tags["V_W"], layer.attn_qkvw.grad[2 * H :])
    assert torch.equal(tags["out_W"], layer.output_w.grad)
    low = copy.deepcopy(layer).to(torch.bfloat16)
    (low_out,) = low(x.to(torch.bfloat16), mask)
    assert low_out.dtype == torch.bfloat16
    assert torch.allclose(low_out.float(), out, atol=0.1)


# --- what is refused -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"hidden_size": 30}, "not divisible by heads 4"),
        ({"heads": -1}, "heads must be > 0"),
        ({"hidden_size": 65540, "intermediate_size": 4}, "takes at most 65536"),
        ({"initializer_range": -1}, "initializer_range must be >= 0"),
        ({"local_rank": 0, "num_hidden_layers": -1}, "num_hidden_layers must be > 0"),
    ],
)
def test_bad_configs_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        DeepSpeedTransformerLayer(config(**kw))


def test_bad_arguments_are_refused():
    layer = DeepSpeedTransformerLayer(config())
    x, mask, _ = inputs()
    w = [torch.zeros(H, H)] * 4 + [torch.ones(H), torch.zeros(INTER, H), torch.zeros(H, INTER),
                                   torch.ones(H)]
    with pytest.raises(ValueError, match="together, 8 tensors each"):
        DeepSpeedTransformerLayer(config(), initial_weights=w)
    with pytest.raises(ValueError, match=r"inter_w: shape \(64, 32\), the config says"):
        DeepSpeedTransformerLayer(config(intermediate_size=48), w, [torch.zeros(len(t)) for t in w])
    with pytest.raises(ValueError, match="head_mask not supported"):
        layer(x, mask, head_mask=torch.ones(HEADS))
    with pytest.raises(ValueError, match="boolean"):
        layer(x, mask == 0)
    with pytest.raises(ValueError, match=r"\[batch, seq, 32\]"):
        layer(x[..., :16], mask)
    untrainable = DeepSpeedTransformerLayer(config(attn_dropout_ratio=-1))
    untrainable.eval()(x, mask)  # the kernel reads no ratio in eval
    with pytest.raises(ValueError, match="attn_dropout_ratio must be in"):
        untrainable.train()(x, mask)


def test_served_as_deepspeed_names():
    import zerostack.compat.deepspeed as deepspeed
    from zerostack.compat.deepspeed.ops.transformer import DeepSpeedTransformerLayer as served

    assert deepspeed.DeepSpeedTransformerLayer is served is DeepSpeedTransformerLayer
    assert deepspeed.DeepSpeedTransformerConfig is DeepSpeedTransformerConfig
    assert deepspeed.ops.transformer.DeepSpeedTransformerConfig is DeepSpeedTransformerConfig
