"""DeepSpeed 0.19.8 with the config's ``"optimizer": {"type": "Lion"}`` and ``"Adagrad"`` on a
tiny model, recorded as golden figures for tests/test_optimizer_types.py.

    DS_ACCELERATOR=cpu .peers/bin/python scripts/optimizer_types_golden.py \
        --write tests/golden/optimizer_types.json

One rank (gloo), 6 steps each, the loss of each step, each case in a process of its own. The
cases cover what DeepSpeed builds for each type: torch's Adagrad at ZeRO 1 and 3, and with the
optimizer offloaded DeepSpeedCPUAdagrad and DeepSpeedCPULion (C++ kernels). Lion is offloaded in
every case: DeepSpeed's FusedLion has no CPU implementation ("This op had not been implemented on
CPU backend"), and its update is the CPU Lion's. Every key of each type's params that DeepSpeed's
class takes is set away from its default somewhere, and one case per type keeps DeepSpeed's
default clipping (1.0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from _golden import TinyNet, emit

WIDTH, VOCAB, SEQ, MICRO, STEPS = 16, 32, 9, 4, 6
LION = {"type": "Lion", "params": {"lr": 2e-3, "betas": [0.8, 0.95], "weight_decay": 0.1}}
ADAGRAD = {
    "type": "Adagrad",
    "params": {
        "lr": 0.05,
        "eps": 1e-8,
        "weight_decay": 0.01,
        "lr_decay": 0.02,
        "initial_accumulator_value": 0.1,
    },
}
ADAGRAD_CPU = {"type": "Adagrad", "params": {"lr": 0.05, "eps": 1e-8, "weight_decay": 0.01}}
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
CASES = {
    "lion_zero2_offload": {"optimizer": LION, "zero_optimization": {"stage": 2, **OFFLOAD},
                           "gradient_clipping": 0.0},
    "lion_zero3_offload_clipped": {"optimizer": LION, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0, **OFFLOAD}},
    "adagrad_zero1": {"optimizer": ADAGRAD, "zero_optimization": {"stage": 1},
                      "gradient_clipping": 0.0},
    "adagrad_zero3_clipped": {"optimizer": ADAGRAD, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}},
    "adagrad_zero2_offload": {"optimizer": ADAGRAD_CPU, "zero_optimization": {
        "stage": 2, **OFFLOAD}, "gradient_clipping": 0.0},
}  # fmt: skip


def config(name: str) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            **CASES[name]}  # fmt: skip


def model() -> TinyNet:
    torch.manual_seed(0)
    return TinyNet(WIDTH, VOCAB)


def batches():
    """Each step's inputs hold every token once, so every weight has a gradient: DeepSpeed's
    Lion kernels move an element whose update direction is exactly zero by a whole lr
    (FusedLion up, the CPU Lion down for +0.0: ``-copysign(lr, 0.0)``), where the paper's
    ``sign(0) = 0`` and zerostack's Lion leave it (tests/test_optimizer_types.py names it)."""
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(STEPS):
        inputs = torch.randperm(VOCAB, generator=g).reshape(MICRO, SEQ - 1)
        last = torch.randint(0, VOCAB, (MICRO, 1), generator=g)
        out.append(torch.cat([inputs, last], dim=1))
    return out


def train(engine) -> list[float]:
    losses = []
    for ids in batches():
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", help="write the JSON here (default: print it)")
    ap.add_argument("--case", help="run this case alone and print its losses")
    args = ap.parse_args(argv)
    if args.case:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29564", RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")  # fmt: skip
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model(), config=config(args.case))
        print("OPTIMIZER " + type(engine.optimizer.optimizer
                                  if hasattr(engine.optimizer, "optimizer")
                                  else engine.optimizer).__name__)  # fmt: skip
        print("LOSSES " + json.dumps(train(engine)))
        return 0
    import subprocess

    import deepspeed

    out = {"command": " ".join(["DS_ACCELERATOR=cpu .peers/bin/python", *sys.argv]),
           "deepspeed": deepspeed.__version__, "cases": {}, "optimizers": {}}  # fmt: skip
    for name in CASES:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        run = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True,
                             text=True, env=env)  # fmt: skip
        if run.returncode:
            print(run.stdout[-3000:], run.stderr[-5000:], file=sys.stderr)
            raise SystemExit(f"case {name} failed")
        lines = run.stdout.splitlines()
        loss = next(x for x in lines if x.startswith("LOSSES "))
        out["cases"][name] = json.loads(loss[len("LOSSES ") :])
        out["optimizers"][name] = next(x for x in lines if x.startswith("OPTIMIZER ")).split()[1]
    out["zero_gradient"] = zero_gradient()
    return emit(out, args.write)


def zero_gradient() -> dict:
    """DeepSpeedCPULion's step on gradients +0.0, -0.0 and 1.0 (weights 1.0, lr 0.1, no decay):
    the weights after it."""
    from deepspeed.ops.lion import DeepSpeedCPULion

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([0.0, -0.0, 1.0])
    DeepSpeedCPULion([p], lr=0.1).step()
    return {"grad": ["+0.0", "-0.0", "1.0"], "lr": 0.1, "after": p.detach().tolist()}


if __name__ == "__main__":
    raise SystemExit(main())
