"""DeepSpeed's ``param.ds_grad_is_ready`` as axolotl's tiled MLP uses it (its
``monkeypatch/tiled_mlp/base.py``, ALST's pattern): the MLP's backward recomputes and
backpropagates each tile with its own ``torch.autograd.backward``, setting the flag False on the
MLP's parameters for all tiles but the last, so that ZeRO takes each parameter's gradient once,
summed over the tiles. On 2 gloo ranks at stages 0-3, SGD without clipping: the weights equal
one process running the plain MLP on the whole batch (1e-5)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.support.ranks import run_distributed

pytestmark = pytest.mark.distributed  # every test here starts ranks

WORLD, B, T, D, STEPS, TILES = 2, 4, 8, 16, 3, 4


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class TiledMlp(torch.autograd.Function):
    """axolotl's TiledMLP, reduced to its gradient handling: forward without a graph, tile by
    tile along the sequence; backward recomputes each tile and backpropagates it alone."""

    @staticmethod
    def forward(ctx, mlp, x):
        ctx.mlp = mlp
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([mlp(t) for t in x.chunk(TILES, dim=1)], dim=1)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        params = list(ctx.mlp.parameters())
        x_grad = torch.zeros_like(x)
        for i, (t, g, xg) in enumerate(
            zip(x.chunk(TILES, 1), grad.chunk(TILES, 1), x_grad.chunk(TILES, 1), strict=True)
        ):
            for p in params:  # "Tell deepspeed not to add a new grad ... until the last shard"
                p.ds_grad_is_ready = i + 1 == TILES
            t = t.detach().requires_grad_(True)
            with torch.enable_grad():
                torch.autograd.backward(ctx.mlp(t), g)
            xg.copy_(t.grad)
        return None, x_grad


class Net(nn.Module):
    def __init__(self, tiled: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mlp, self.head = nn.Linear(D, D), Mlp(), nn.Linear(D, 3)
        self.tiled = tiled

    def forward(self, x, y):
        h = self.embed(x)
        if self.tiled:
            h = h + TiledMlp.apply(self.mlp, h)  # the parameters are no inputs: no edges
        else:
            h = h + self.mlp(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _data(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(B, T, D, generator=g), torch.randint(0, 3, (B, T), generator=g)


def _reference() -> dict[str, torch.Tensor]:
    model = Net(tiled=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        opt.zero_grad()
        model(*_data(step)).backward()
        opt.step()
    return model.state_dict()


def _train(rank, world, stage):
    import zerostack

    cfg = {
        "train_micro_batch_size_per_gpu": B // world,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerostack.initialize(model=Net(tiled=True), config=cfg)
    per = B // world
    for step in range(STEPS):
        x, y = _data(step)
        engine.backward(engine(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
        engine.step()
    return engine.full_state_dict()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_tiled_backward_is_taken_once_per_parameter(stage):
    want = _reference()
    for got in run_distributed(_train, WORLD, (stage,)):
        for k, v in want.items():
            assert (got[k] - v).abs().max() <= 1e-5 * v.abs().max(), (stage, k)
