"""DeepSpeed 0.19.8 with ``torch_autocast`` on a tiny model, recorded as golden figures for
tests/test_torch_autocast.py.

    DS_ACCELERATOR=cpu .peers/bin/python scripts/torch_autocast_golden.py \
        --write tests/golden/torch_autocast.json

One rank (gloo), 6 steps each, the loss of each step, each case in a process of its own (a
ZeRO-3 engine leaves DeepSpeed's patched linear behind, which changes the next engine's
autocast figures). The cases: DeepSpeedExamples'
bf16_master_weight baseline made autocast (the bf16 block, ZeRO-3, AdamW, ``"dtype":
"torch.bfloat16"``), the bf16 block at ZeRO-1 with SGD, fp32 weights at stage 0 with SGD, and
the first case without autocast (the figures autocast changes: layer norm, softmax and the loss
run in fp32 under it). The ZeRO-3 case turns off ``memory_efficient_linear``: DeepSpeed's own
linear function then adds the bias after the bf16 product is rounded, where ``F.linear``
rounds once (a difference in the last bit under autocast that zerostack does not copy).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from _golden import TinyNet, emit

WIDTH, VOCAB, SEQ, MICRO, STEPS = 16, 32, 8, 4, 6
AUTOCAST = {"enabled": True, "dtype": "torch.bfloat16"}
ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                     "weight_decay": 0.01}}  # fmt: skip
SGD = {"type": "SGD", "params": {"lr": 0.05}}
CASES = {
    "bf16_zero3_adamw": {"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0, "memory_efficient_linear": False},
        "optimizer": ADAMW, "torch_autocast": AUTOCAST},
    "bf16_zero1_sgd": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
                       "optimizer": SGD, "torch_autocast": AUTOCAST},
    "fp32_zero0_sgd": {"zero_optimization": {"stage": 0}, "optimizer": SGD,
                       "gradient_clipping": 0.0,
                       "torch_autocast": {"enabled": True, "dtype": "bf16"}},
    "bf16_zero3_adamw_no_autocast": {"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}, "optimizer": ADAMW},
}  # fmt: skip


def config(name: str) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "zero_allow_untested_optimizer": True,
            **CASES[name]}  # fmt: skip


def train(engine) -> list[float]:
    g = torch.Generator().manual_seed(11)
    losses = []
    for _ in range(STEPS):
        loss = engine(torch.randint(0, VOCAB, (MICRO, SEQ), generator=g))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def model() -> TinyNet:
    """The weights rounded to bf16 values: DeepSpeed makes its fp32 masters from the weights
    cast to bf16, zerostack from the fp32 weights themselves; with values bf16 holds exactly
    the two are the same, and the figures compare autocast alone."""
    torch.manual_seed(0)
    net = TinyNet(WIDTH, VOCAB)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(p.bfloat16().float())
    return net


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", help="write the JSON here (default: print it)")
    ap.add_argument("--case", help="run this case alone and print its losses")
    args = ap.parse_args(argv)
    if args.case:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29563", RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")  # fmt: skip
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model(), config=config(args.case))
        print("LOSSES " + json.dumps(train(engine)))
        return 0
    import subprocess

    import deepspeed

    out = {"command": " ".join(["DS_ACCELERATOR=cpu .peers/bin/python", *sys.argv]),
           "deepspeed": deepspeed.__version__, "cases": {}}  # fmt: skip
    for name in CASES:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as the test's ranks: bf16 sums in order
        run = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True,
                             text=True, check=True, env=env)  # fmt: skip
        line = next(x for x in run.stdout.splitlines() if x.startswith("LOSSES "))
        out["cases"][name] = json.loads(line[len("LOSSES ") :])
    return emit(out, args.write)


if __name__ == "__main__":
    raise SystemExit(main())
