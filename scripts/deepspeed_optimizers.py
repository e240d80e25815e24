"""DeepSpeed 0.19.8's compiled CPU optimizers on a fixed problem, recorded as golden figures for
tests/test_ds_optimizers.py (zerostack serves them as torch code: deepspeed.ops.lion,
deepspeed.ops.adagrad).

    DS_ACCELERATOR=cpu .peers/bin/python scripts/deepspeed_optimizers.py \
        --write tests/golden/deepspeed_optimizers.json

Each case: two fp32 parameters (a 33-element vector, so the kernels' vector tails run, and a
4x5 matrix), seeded, 4 steps with seeded gradients, two param groups (the second with its own
lr); the parameters after each step.
"""

from __future__ import annotations

import argparse
import json

import torch

CASES = {
    "DeepSpeedCPULion": {"lr": 0.05, "betas": [0.9, 0.99], "weight_decay": 0.1},
    "DeepSpeedCPUAdagrad": {"lr": 0.1, "eps": 1e-10, "weight_decay": 0.01},
}
STEPS = 4


def problem():
    """The parameters and each step's gradients (the same tensors for every engine)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(33, generator=g), torch.randn(4, 5, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(STEPS)]
    return params, grads


def run(cls, kwargs: dict) -> list[list[list[float]]]:
    """The parameters (flattened) after each step."""
    start, grads = problem()
    params = [torch.nn.Parameter(p.clone()) for p in start]
    groups = [{"params": [params[0]]}, {"params": [params[1]], "lr": kwargs["lr"] / 2}]
    opt = cls(groups, **{k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()})
    out = []
    for step in grads:
        for p, g in zip(params, step, strict=True):
            p.grad = g.clone()
        opt.step()
        out.append([p.detach().flatten().tolist() for p in params])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", required=True)
    args = parser.parse_args(argv)
    import deepspeed
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.lion import DeepSpeedCPULion

    classes = {"DeepSpeedCPULion": DeepSpeedCPULion, "DeepSpeedCPUAdagrad": DeepSpeedCPUAdagrad}
    record = {
        "command": "DS_ACCELERATOR=cpu .peers/bin/python scripts/deepspeed_optimizers.py "
        f"--write {args.write}",
        "versions": {"deepspeed": deepspeed.__version__, "torch": torch.__version__},
        "results": {name: run(classes[name], kw) for name, kw in CASES.items()},
    }
    with open(args.write, "w") as f:
        f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
