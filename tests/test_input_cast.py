"""Inputs are cast as DeepSpeed 0.19.8 casts them (``engine._forward_prologue``, which calls
``_cast_inputs_half`` on the positional inputs when ``fp16.auto_cast`` is set, and nothing
else): with auto_cast every floating-point tensor among the positional arguments, nested in
lists, tuples and dicts too, becomes fp16, whatever the precision; integer tensors and keyword
arguments never change; without auto_cast nothing is cast, in fp16 and bf16 alike. The pipeline
engine casts its first stage's inputs by the same rule and never its labels."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerostack
from zerostack.engine.micro_batches import cast_inputs
from zerostack.pipeline import PipelineModule

from tests.support.ranks import run_distributed

F16, F32, I64, BOOL = torch.float16, torch.float32, torch.int64, torch.bool


class Probe(nn.Module):
    """Records the dtype of everything it is called with; the loss is one weight's square."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))
        self.seen: dict[str, object] = {}

    def forward(self, x, tokens, nested, labels, *, mask=None, scale=None):
        self.seen = {
            "x": x.dtype,
            "tokens": tokens.dtype,
            "nested": (
                nested["a"].dtype,
                nested["ids"].dtype,
                [t.dtype for t in nested["list"]],
                nested["name"],
            ),
            "labels": labels.dtype,
            "mask": mask.dtype,
            "scale": scale.dtype,
        }
        return self.w.float() ** 2


def _inputs():
    x = torch.randn(2, 3)
    tokens = torch.tensor([1, 2])
    nested = {
        "a": torch.randn(2),
        "ids": torch.tensor([3]),
        "list": [torch.randn(1), torch.tensor([True])],
        "name": "kept",
    }
    labels = torch.randn(2)  # float labels, passed positionally
    kwargs = {"mask": torch.tensor([True, False]), "scale": torch.randn(2)}
    return (x, tokens, nested, labels), kwargs


def _expected(cast: bool) -> dict:
    f = F16 if cast else F32
    return {
        "x": f,
        "tokens": I64,
        "nested": (f, I64, [f, BOOL], "kept"),
        "labels": f,
        "mask": BOOL,
        "scale": F32,  # a keyword argument: DeepSpeed's hook casts the positional inputs only
    }


CASES = {
    "fp32": ({}, False),
    "fp16": ({"fp16": {"enabled": True}}, False),
    "fp16 auto_cast": ({"fp16": {"enabled": True, "auto_cast": True}}, True),
    "bf16": ({"bf16": {"enabled": True}}, False),
    "fp32 auto_cast": ({"fp16": {"auto_cast": True}}, True),  # DeepSpeed casts then too
}


def _seen(rank, world):
    out = {}
    for name, (extra, _) in CASES.items():
        config = {"train_micro_batch_size_per_gpu": 2, **extra}
        model = Probe()
        engine, *_ = zerostack.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config
        )
        args, kwargs = _inputs()
        engine.backward(engine(*args, **kwargs))
        engine.step()
        out[name] = model.seen
    return out


@pytest.mark.distributed
def test_inputs_are_cast_as_deepspeed_casts_them():
    seen = run_distributed(_seen, 1)[0]
    for name, (_, cast) in CASES.items():
        assert seen[name] == _expected(cast), name


def test_cast_inputs_leaves_the_inputs_themselves_alone():
    args, _ = _inputs()
    assert cast_inputs(args, False) is args
    cast = cast_inputs(args, True)
    assert cast[0].dtype == F16 and args[0].dtype == F32
    assert torch.equal(cast[0], args[0].half()) and cast[1] is args[1]


class FirstLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.seen: list[torch.dtype] = []

    def forward(self, x):
        self.seen.append(x.dtype)
        return self.lin(x.to(self.lin.weight.dtype))


class LabelLoss:
    def __init__(self) -> None:
        self.seen: list[torch.dtype] = []

    def __call__(self, out, labels):
        self.seen.append(labels.dtype)
        return ((out.float() - labels.float()) ** 2).mean()


def _pipeline_seen(rank, world, auto_cast):
    loss = LabelLoss()
    model = PipelineModule([FirstLayer()], num_stages=1, loss_fn=loss)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "fp16": {"enabled": True, "auto_cast": auto_cast},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, *_ = zerostack.initialize(model=model, config=config)
    data = iter([(torch.randn(2, 3), torch.randn(2, 3)) for _ in range(2)])
    engine.train_batch(data)
    first = next(m for m in model.modules() if isinstance(m, FirstLayer))
    return first.seen, loss.seen


@pytest.mark.distributed
def test_pipeline_casts_the_first_stage_input_with_auto_cast_and_never_the_labels():
    inputs, labels = run_distributed(_pipeline_seen, 1, args=(True,))[0]
    assert (inputs, labels) == ([F16, F16], [F32, F32])
    inputs, labels = run_distributed(_pipeline_seen, 1, args=(False,))[0]
    assert (inputs, labels) == ([F32, F32], [F32, F32])
