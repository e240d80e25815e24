"""ZeRO-3 leaf modules (DeepSpeed's ``set_z3_leaf_modules`` and ``zero_optimization.leaf_module``):
a mixture-of-experts block whose router sends each rank's tokens to different experts, gathered
as one unit. Counted on the transport's log (the all-gathers each rank posts per step: equal on
every rank, one for the whole block), and trained against one process (SGD, no clipping, 3
steps, 1e-5 relative per tensor, as test_data_parallel).

Without the flag the same model at stage 3 would post one gather per expert the router picked,
which differs between ranks: collectives that do not match (DeepSpeed hangs there, #7461)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerostack
from zerostack.zero.stage3.leaves import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

from tests.support.ranks import run_distributed

D, E, V, T, STEPS, LR = 16, 8, 32, 4, 3, 0.5


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, h):
        return self.down(F.gelu(self.up(h)))


class SparseMoeBlock(nn.Module):
    """Top-1 routing that calls only the experts some token picked (as Hugging Face's blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))

    def forward(self, h):
        flat = h.reshape(-1, D)
        probs = self.router(flat).softmax(-1)
        gate, pick = probs.max(-1)
        out = torch.zeros_like(flat)
        for e in pick.unique().tolist():
            rows = pick == e
            out[rows] = self.experts[e](flat[rows]) * gate[rows, None]
        return h + out.reshape(h.shape)


class MoeLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.moe = SparseMoeBlock()
        self.head = nn.Linear(D, V)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.moe(self.embed(x))).flatten(0, 1), y.flatten())


def _model() -> MoeLM:
    torch.manual_seed(0)
    return MoeLM()


def _batch(step: int, n: int):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, V, (n, T), generator=g)
    return x, torch.roll(x, 1, dims=1)


def _reference(world: int):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _batch(step, 2 * world)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _train(rank, world, how: str):
    model = _model()
    # no prefetch: each unit is its own gather, forward and backward
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0}
    if how == "call":
        set_z3_leaf_modules(model, [SparseMoeBlock])
    elif how == "config":
        zero["leaf_module"] = {"classes": ["SparseMoeBlock"]}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
    }
    engine, *_ = zerostack.initialize(model=model, config=cfg)
    log = engine.comm.log
    gathers = []
    for step in range(STEPS):
        x, y = _batch(step, 2 * world)
        x, y = x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]
        first = log.count
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        gathers.append(sum(r.op.startswith("all_gather") for r in log.since(first)))
    return {
        "weights": {k: v.clone() for k, v in engine.full_state_dict().items()},
        "gathers": gathers,
        "leaves": [type(m).__name__ for m in get_z3_leaf_modules(model)],
        "leaf_params": all(z3_leaf_parameter(p) for p in model.moe.parameters()),
        "other_params": any(z3_leaf_parameter(p) for p in model.head.parameters()),
    }


def _picks(rank: int) -> set[int]:
    """The experts the initial router sends rank ``rank``'s first micro-batch to."""
    model = _model()
    x, _ = _batch(0, 4)
    with torch.no_grad():
        h = model.embed(x[2 * rank : 2 * rank + 2])
        return set(model.moe.router(h).argmax(-1).flatten().tolist())


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["call", "config"])
def test_a_leaf_moe_block_is_one_gather_and_trains_as_one_process(how):
    assert _picks(0) != _picks(1)  # the ranks run different experts
    want = _reference(2)
    results = run_distributed(_train, 2, args=(how,))
    for out in results:
        assert out["leaves"] == ["SparseMoeBlock"]
        assert out["leaf_params"] and not out["other_params"]
        for name, value in want.items():
            got = out["weights"][name]
            assert torch.allclose(got, value, rtol=1e-5, atol=1e-6), name
    # every rank posts the same gathers whatever its router picked: embed, the whole MoE block,
    # head in forward, and again in backward
    assert results[0]["gathers"] == results[1]["gathers"] == [6] * STEPS


def test_the_leaf_flags():
    model = _model()
    assert set_z3_leaf_modules(model, ["SparseMoeBlock"]) == [model.moe]
    assert z3_leaf_module(model.moe) and not z3_leaf_module(model.head)
    assert unset_z3_leaf_modules(model, [SparseMoeBlock]) == [model.moe]
    assert get_z3_leaf_modules(model) == []
    qualified = f"{SparseMoeBlock.__module__}.{SparseMoeBlock.__qualname__}"
    assert set_z3_leaf_modules(model, [qualified]) == [model.moe]
    with pytest.raises(ValueError, match="no modules of type"):
        set_z3_leaf_modules(model, ["MixtralSparseMoeBlock"])
    assert set_z3_leaf_modules(model, ["Nothing"], raise_if_not_found=False) == []
    found, missing = set_z3_leaf_modules_by_name(model, ["moe.experts.0", "nope"], True, False)
    assert found == [model.moe.experts[0]] and missing == ["nope"]
    found, missing = set_z3_leaf_modules_by_suffix(model, ["up", "zzz"], True, False)
    assert found == [ex.up for ex in model.moe.experts] and missing == ["zzz"]
    with pytest.raises(TypeError, match="types or class names"):
        set_z3_leaf_modules(model, [3])


# --- register_external_parameter: a parameter reached without an attribute read --------------


class ListHead(nn.Module):
    """An output layer that holds the embedding's weight in a plain list: its forward never
    reads it as a module attribute, so stage 3 cannot see the read without registration."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.tied = [weight]
        self.bias = nn.Parameter(torch.zeros(V))

    def forward(self, h):
        return F.linear(h, self.tied[0], self.bias)


class TiedLM(nn.Module):
    def __init__(self, register: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, D)
        self.mix = nn.Linear(D, D)
        self.head = ListHead(self.embed.weight)
        if register == "before":  # as Transformers' models call it, while being built
            zerostack.zero.register_external_parameter(self.head, self.embed.weight)

    def forward(self, x, y):
        logits = self.head(torch.tanh(self.mix(self.embed(x))))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _external(rank, world, register: str):
    model = TiedLM(register)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerostack.initialize(model=model, config=cfg)
    if register == "after":
        zerostack.zero.register_external_parameter(model.head, model.embed.weight)
    for step in range(STEPS):
        x, y = _batch(step, 2 * world)
        loss = engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
        engine.backward(loss)
        engine.step()
    borrowed = [p is model.embed.weight for _, p in model.head.ds_external_parameters()]
    return {"weights": engine.full_state_dict(), "borrowed": borrowed}


@pytest.mark.distributed
@pytest.mark.parametrize("register", ["before", "after"])
def test_a_registered_external_parameter_is_gathered_with_its_user(register):
    model = TiedLM("none")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _batch(step, 4)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    for out in run_distributed(_external, 2, args=(register,)):
        assert out["borrowed"] == [True]
        for name, value in model.state_dict().items():
            assert torch.allclose(out["weights"][name], value, rtol=1e-5, atol=1e-6), name


def test_registering_refuses_what_is_not_a_parameter():
    model = TiedLM("none")
    with pytest.raises(RuntimeError, match="not a torch.nn.Parameter"):
        zerostack.zero.register_external_parameter(model.head, torch.zeros(2))
    zerostack.zero.register_external_parameter(model.head, model.embed.weight)
    zerostack.zero.unregister_external_parameter(model.head, model.embed.weight)
    with pytest.raises(RuntimeError, match="not a registered external parameter"):
        zerostack.zero.unregister_external_parameter(model.head, model.embed.weight)
