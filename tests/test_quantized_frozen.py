"""DeepSpeed's Mixed Precision ZeRO++ (``zero_quantized_nontrainable_weights``, its tutorial's
``optimizer.quantize_nontrainable_params()``) on 2 gloo ranks: a LoRA-like model's frozen base
pieces held as int8 blocks.

- Training equals one process whose frozen weights were replaced by their block-quantized
  values (qwZ's spec written out element by element in test_zeropp.py, blocks from each rank's
  piece), with SGD and no clipping: trained parameters within 1e-5, frozen ones exact.
- The frozen pieces' bytes, found by the census of live storage: the payload formula (2 bytes a
  block of 32, 1 a value), against 4 bytes a value without the setting.
- A checkpoint loads back with the blocks unchanged; the method is a no-op once they are
  quantized, warns without the setting, and refuses parameters frozen after initialize.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerostack import ConfigError, load_config
from zerostack.zero.partition import piece_numel

from tests.support.census import baseline, take
from tests.support.ranks import run_distributed
from tests.test_zeropp import spec_round_trip

WORLD, B, STEPS, LR = 2, 8, 3, 0.5


class LoraNet(nn.Module):
    """A frozen base (two Linears) and a trained low-rank adapter beside the first."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base1, self.base2 = nn.Linear(40, 40), nn.Linear(40, 3)
        self.a, self.b = nn.Linear(40, 4, bias=False), nn.Linear(4, 40)
        for p in [*self.base1.parameters(), *self.base2.parameters()]:
            p.requires_grad_(False)

    def forward(self, x, y):
        h = torch.tanh(self.base1(x) + self.b(self.a(x)))
        return F.cross_entropy(self.base2(h), y)


FROZEN = ("base1.weight", "base1.bias", "base2.weight", "base2.bias")


def _data(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(B, 40, generator=g), torch.randint(0, 3, (B,), generator=g)


def _config(**zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": B // WORLD,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True, **zero},
    }


def _quantized(value: torch.Tensor) -> torch.Tensor:
    """``value`` with each rank's piece replaced by its qwZ round trip (the spec)."""
    flat, n = value.reshape(-1), value.numel()
    width = piece_numel(n, WORLD)
    padded = torch.zeros(width * WORLD).index_copy_(0, torch.arange(n), flat)
    pieces = [spec_round_trip(padded[r * width : (r + 1) * width]) for r in range(WORLD)]
    return torch.cat(pieces)[:n].view_as(value)


def _reference() -> dict[str, torch.Tensor]:
    model = LoraNet()
    with torch.no_grad():
        for name in FROZEN:
            p = model.get_parameter(name)
            p.copy_(_quantized(p))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        model(*_data(step)).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank, world, root, persistence):
    import zerostack.compat.deepspeed as deepspeed

    out = {}
    for quantized in (True, False):
        before = baseline()
        cfg = _config(stage3_param_persistence_threshold=persistence)
        cfg["zero_optimization"]["zero_quantized_nontrainable_weights"] = quantized
        engine, optimizer, *_ = deepspeed.initialize(model=LoraNet(), config=cfg)
        frozen = [engine.module.get_parameter(n) for n in FROZEN]
        census = take(engine, exclude=before)
        trained = sum(p._zs.piece.nbytes for p in engine.module.parameters() if p.requires_grad)
        out[quantized] = {"frozen_bytes": census.bytes["params"] - trained}
        log, x, y = engine.comm.log, *_data(0)
        first, per = len(log.records), B // world
        mine = slice(rank * per, (rank + 1) * per)
        engine.backward(engine(x[mine], y[mine]))
        out[quantized]["gathered"] = sum(
            r.bytes for r in log.records[first:] if r.op == "all_gather"
        )
        engine.destroy()
        if not quantized:
            continue
        engine, optimizer, *_ = deepspeed.initialize(model=LoraNet(), config=cfg)
        frozen = [engine.module.get_parameter(n) for n in FROZEN]
        out["payloads"] = [p._zs.payload.nbytes for p in frozen]
        out["widths"] = [p._zs.piece.numel() for p in frozen]
        out["ds_tensor"] = all(p.ds_tensor is p._zs.payload for p in frozen)
        out["again"] = optimizer.quantize_nontrainable_params()
        per = B // world
        for step in range(STEPS):
            x, y = _data(step)
            mine = slice(rank * per, (rank + 1) * per)
            engine.backward(engine(x[mine], y[mine]))
            engine.step()
        out["state"] = engine.full_state_dict()
        held = [p._zs.payload.clone() for p in frozen]
        engine.save_checkpoint(root, tag="t")
        again, *_ = deepspeed.initialize(model=LoraNet(), config=cfg)
        again.load_checkpoint(root, tag="t")
        out["reloaded"] = all(
            torch.equal(again.module.get_parameter(n)._zs.payload, h)
            for n, h in zip(FROZEN, held, strict=True)
        )
        out["reloaded_state"] = again.full_state_dict()
        bias = again.module.base2.bias
        with deepspeed.zero.GatheredParameters([bias], modifier_rank=0):
            bias.data.fill_(0.25)  # written back into its blocks
        out["written"] = again.full_state_dict()["base2.bias"]
        engine.module.a.weight.requires_grad_(False)  # frozen after initialize
        try:
            optimizer.quantize_nontrainable_params()
        except RuntimeError as exc:
            out["late"] = str(exc)
        engine.destroy()
        again.destroy()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("persistence", [0, 41])
def test_frozen_pieces_are_int8_blocks_and_training_is_the_quantized_models(persistence, tmp_path):
    """Persistence 41: the 40- and 3-element biases stay gathered (from the blocks)."""
    want = _reference()
    for out in run_distributed(_train, WORLD, (str(tmp_path), persistence)):
        for k, v in want.items():
            got = out["state"][k]
            if k in FROZEN:
                assert torch.equal(got, v), k
            else:
                assert (got - v).abs().max() <= 1e-5 * v.abs().max(), k
            assert torch.equal(out["reloaded_state"][k], got), k
        blocks = [-(-w // 32) for w in out["widths"]]
        formula = [2 * b + w + (w % 2) for b, w in zip(blocks, out["widths"], strict=True)]
        assert out["payloads"] == formula
        if persistence == 0:  # nothing gathered at rest: the census sees the pieces alone
            assert out[True]["frozen_bytes"] == sum(formula)
            assert out[False]["frozen_bytes"] == 4 * sum(out["widths"])
        assert out["ds_tensor"] and out["again"] == 0 and out["reloaded"]
        assert torch.equal(out["written"], _quantized(torch.full((3,), 0.25)))
        # base1.weight alone, gathered once, moves 4 bytes an element less its payload
        saved = 4 * out["widths"][0] - out["payloads"][0]
        assert out[False]["gathered"] - out[True]["gathered"] >= saved
        assert out["late"].startswith("quantize_nontrainable_params: 1 parameters were frozen")


def _unset(rank, world):
    import zerostack.compat.deepspeed as deepspeed

    cfg = _config()
    cfg["zero_optimization"]["zero_quantized_nontrainable_weights"] = False
    engine, optimizer, *_ = deepspeed.initialize(model=LoraNet(), config=cfg)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("zerostack").addHandler(handler)
    try:
        done = optimizer.quantize_nontrainable_params()
    finally:
        logging.getLogger("zerostack").removeHandler(handler)
    frozen = engine.module.base1.weight
    return done, [r.getMessage() for r in records], hasattr(frozen._zs, "payload")


@pytest.mark.distributed
def test_the_method_warns_and_does_nothing_without_the_setting():
    done, messages, quantized = run_distributed(_unset, 1)[0]
    assert done == 0 and not quantized
    assert messages == [
        "quantize_nontrainable_params() called with zero_quantized_nontrainable_weights "
        "disabled: nothing quantized"
    ]


@pytest.mark.parametrize(
    "zero, message",
    [
        ({"stage": 2}, "weights: quantizes stage 3's frozen pieces; set stage 3 \\(stage is 2\\)"),
        ({"offload_param": {"device": "cpu"}}, "weights: keeps frozen pieces quantized in device"),
    ],
)
def test_settings_that_cannot_hold_quantized_pieces_are_refused(zero, message):
    with pytest.raises(ConfigError, match=message):
        load_config(_config(**zero))


def test_writing_back_the_value_a_piece_holds_keeps_its_blocks():
    """Quantizing twice is not the identity: a block whose largest value is 1.0 gets the scale
    bf16_up(1 / 127) and 126 steps, and those 126 steps quantized again become 127 of a finer
    scale. A checkpoint of the run written back into its pieces must keep the blocks."""
    from zerostack.zero.stage3 import quantize
    from zerostack.zero.stage3.frozen_pieces import QuantizedPiece

    x = torch.linspace(-0.5, 1.0, 64)
    st = QuantizedPiece(torch.Size([64]), 64, x)
    held, value = st.payload.clone(), st.piece
    assert not torch.equal(quantize.pack([value]), held)  # quantized again, it would drift
    st.piece = value.clone()
    assert torch.equal(st.payload, held) and torch.equal(st.piece, value)
    st.write(torch.zeros(64))  # another value is quantized
    assert torch.equal(st.piece, torch.zeros(64))
