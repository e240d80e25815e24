"""``tensor_parallel.partition_config``: DeepSpeed's custom AutoTP specs split a model of any
architecture, and training equals one process's.

The model is DeepSpeedExamples' custom-pattern case (training/tensor_parallel/custom_patterns):
a fused ``attention.query_key_value``, ``attention.dense``, ``mlp.dense_h_to_4h`` and
``mlp.dense_4h_to_h``, its attention reading its own ``num_heads`` and ``hidden_size`` (which
AutoTP divides by tp, as DeepSpeed's does).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerostack.config import ConfigError
from zerostack.config.load import load_config

from tests.support.ranks import run_distributed

H, HEADS, VOCAB, SEQ = 8, 4, 16, 6


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.hidden_size = HEADS, H
        self.query_key_value = nn.Linear(H, 3 * H)
        self.dense = nn.Linear(H, H)

    def forward(self, x):
        b, s, _ = x.shape
        head = self.hidden_size // self.num_heads
        q, k, v = (t.view(b, s, self.num_heads, head).transpose(1, 2)
                   for t in self.query_key_value(x).chunk(3, dim=-1))  # fmt: skip
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(b, s, self.hidden_size))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.attention = Attention()
        self.mlp = nn.Module()
        self.mlp.dense_h_to_4h, self.mlp.dense_4h_to_h = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.mlp.dense_4h_to_h(nn.functional.gelu(self.mlp.dense_h_to_4h(self.ln2(x))))


class Neo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.lm_head = nn.Linear(H, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(x)
        flat = logits[:, :-1].reshape(-1, VOCAB)
        return nn.functional.cross_entropy(flat, ids[:, 1:].reshape(-1))


SPECS = {
    "use_default_specs": False,
    "layer_specs": [
        {"patterns": [r".*(self_attention|attention)\.query_key_value\.weight$"],
         "partition_type": "column", "shape": [3, -1], "partition_dim": 0},
        {"patterns": [r".*(self_attention|attention)\.dense\.weight$"], "partition_type": "row"},
        {"patterns": [r".*mlp\.dense_h_to_4h\.weight$"], "partition_type": "COLUMN"},
        {"patterns": [r".*mlp\.dense_4h_to_h\.weight$"], "partition_type": "row"},
    ],
}  # fmt: skip


def _train(rank, world, tp, specs):
    import zerostack.compat.deepspeed as deepspeed

    torch.manual_seed(0)
    cfg = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
           "gradient_clipping": 0.0}  # fmt: skip
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp, "partition_config": specs}
    engine, *_ = deepspeed.initialize(model=Neo(), config=cfg)
    shapes = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
    heads = engine.module.layers[0].attention.num_heads
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    full = {k: v.clone() for k, v in engine.full_state_dict().items()}
    return losses, full, shapes, heads


@pytest.mark.distributed
def test_custom_specs_train_as_one_process():
    """tp=2 by the specs (a fused q/k/v split part by part, its attention's head count halved)
    trains as one process does (SGD, no clipping): the losses, and the whole weights after."""
    ((want, whole, _, heads1),) = run_distributed(_train, world=1, args=(1, None))
    ranks = run_distributed(_train, world=2, args=(2, SPECS))
    for losses, full, shapes, heads in ranks:
        assert losses == pytest.approx(want, rel=1e-5)
        for name, value in whole.items():
            torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6)
        assert shapes["layers.0.attention.query_key_value.weight"] == (3 * H // 2, H)
        assert shapes["layers.0.attention.dense.weight"] == (H, H // 2)
        assert shapes["lm_head.weight"] == (VOCAB, H)  # no spec: whole
        assert (heads1, heads) == (HEADS, HEADS // 2)


def _refusal(rank, world, specs):
    import zerostack.compat.deepspeed as deepspeed

    cfg = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
           "tensor_parallel": {"autotp_size": 2, "partition_config": specs}}  # fmt: skip
    try:
        deepspeed.initialize(model=Neo(), config=cfg)
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.distributed
def test_unmatched_layers_strict_mode_model_types_and_embeddings():
    """strict_mode names the first linear layer no spec matches; a spec for other model types
    matches nothing; an embedding a spec would split is refused."""
    strict = {**SPECS, "strict_mode": True}
    other = {"layer_specs": [{**s, "model_types": ["llama"]} for s in SPECS["layer_specs"]]}
    embed = {"layer_specs": [*SPECS["layer_specs"], {"patterns": [r"embed\.weight"]}]}
    got = [run_distributed(_refusal, world=2, args=(s,))[0] for s in (strict, other, embed)]
    assert got[0] == ("tensor_parallel.partition_config: no layer_spec matches lm_head.weight "
                      "(strict_mode)")  # fmt: skip
    assert got[1] == "tensor_parallel.partition_config: no layer_spec matches a linear layer"
    assert got[2].startswith("tensor_parallel.partition_config: embed.weight is an embedding")


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"shape": [[4, 2, 2], -1]}, "shape: [[4, 2, 2], -1]: zerostack splits [n, -1]"),
        ({"partition_type": "row", "shape": [3, -1]}, "shape: [3, -1]: zerostack splits"),
        ({"partition_dim": 1}, "partition_dim: 1: zerostack splits a column layer along dim"),
        ({"gather_output": True}, "gather_output: not supported"),
        ({"grad_allreduce": True}, "grad_allreduce: not supported"),
        ({"patterns": ["("]}, "patterns: '(' is no regular expression"),
        ({"partition_type": "diagonal"}, "partition_type"),
    ],
)  # fmt: skip
def test_specs_zerostack_cannot_serve_are_refused_naming_the_key(spec, message):
    cfg = {"train_batch_size": 1, "tensor_parallel": {"partition_config": {
        "layer_specs": [{"patterns": [".*"], **spec}]}}}  # fmt: skip
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    assert str(e.value).startswith("tensor_parallel.partition_config.layer_specs[0].")
    assert message in str(e.value)


def test_an_unknown_key_in_a_spec_is_left_out_under_the_facade_and_refused_natively():
    """DeepSpeed reads partition_config key by key (AutoTPConfig.from_dict) and ignores one it
    does not know: the facade leaves it out and names it; native zerostack refuses it."""
    spec = {"patterns": [".*"], "partition_typ": "row"}
    cfg = {"train_batch_size": 1,
           "tensor_parallel": {"partition_config": {"layer_specs": [spec], "zz": 1}}}  # fmt: skip
    got = load_config(cfg, unknown_keys="as_deepspeed")
    assert sorted(got.ignored_keys) == [
        "tensor_parallel.partition_config.layer_specs.0.partition_typ",
        "tensor_parallel.partition_config.zz",
    ]
    assert got.tensor_parallel.partition_config.layer_specs[0].partition_type == "column"
    with pytest.raises(ConfigError, match=r"layer_specs\[0\]\.partition_typ: unknown key"):
        load_config({"tensor_parallel": {"partition_config": {"layer_specs": [spec]}}})


def _shapes(rank, world, specs):
    import zerostack.compat.deepspeed as deepspeed

    cfg = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
           "tensor_parallel": {"autotp_size": 2, "partition_config": specs}}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=Neo(), config=cfg)
    return {n: tuple(p.shape) for n, p in engine.module.named_parameters()}


@pytest.mark.distributed
def test_the_first_matching_spec_wins():
    """A skip spec listed before the column spec that also matches keeps the layer whole."""
    first = {"patterns": [r".*dense_h_to_4h\.weight$"], "partition_type": "skip"}
    specs = {"layer_specs": [first, *SPECS["layer_specs"]]}
    shapes = run_distributed(_shapes, world=2, args=(specs,))[0]
    assert shapes["layers.0.mlp.dense_h_to_4h.weight"] == (4 * H, H)
    assert shapes["layers.0.mlp.dense_4h_to_h.weight"] == (H, 2 * H)  # row: still split
