"""DeepSpeed 0.19.8 with 16-bit master weights and optimizer states (``bf16``'s
``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``, ``fp16``'s
``fp16_master_weights_and_grads``) on a tiny model, recorded as golden figures for
tests/test_sixteen_bit_masters.py.

    DS_ACCELERATOR=cpu .peers/bin/python scripts/sixteen_bit_golden.py \
        --write tests/golden/sixteen_bit_masters.json

One rank (gloo), 8 steps each, each case in a process of its own: the loss of each step and,
after it, the sum of squares of every weight in float64 (the losses are bf16 and coarse; the
sum moves with the last bit of any weight). The cases: bf16 masters with bf16 moments at ZeRO
1, 2 and 3 (DeepSpeed's FusedAdam on the 16-bit partitions), with the optimizer offloaded
(DeepSpeedCPUAdam, fp32 moments, and bf16 moments), and the bf16 run with fp32 masters beside
them (the numbers the 16-bit runs depart from). No fp16 case: DeepSpeed refuses fp16 on a CPU
without oneDNN's fp16 ("Type fp16 is not supported on your device"), this machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from _golden import TinyNet, emit

WIDTH, VOCAB, SEQ, MICRO, STEPS = 16, 32, 9, 4, 8
ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-6,
                                     "weight_decay": 0.01}}  # fmt: skip
MASTERS = {"enabled": True, "bf16_master_weights_and_grads": True}
STATES = {**MASTERS, "bf16_optimizer_states": True}
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
S3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
CASES = {
    "bf16_states_zero1": {"bf16": STATES, "zero_optimization": {"stage": 1}},
    "bf16_states_zero2": {"bf16": STATES, "zero_optimization": {"stage": 2}},
    "bf16_states_zero3": {"bf16": STATES, "zero_optimization": S3},
    "bf16_zero2_offload": {"bf16": MASTERS, "zero_optimization": {"stage": 2, **OFFLOAD}},
    "bf16_states_zero2_offload": {"bf16": STATES,
                                  "zero_optimization": {"stage": 2, **OFFLOAD}},
    "bf16_zero3_offload": {"bf16": MASTERS, "zero_optimization": {**S3, **OFFLOAD}},
    "bf16_fp32_masters_zero2": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}},
}  # fmt: skip


def config(name: str) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0, "optimizer": ADAMW, **CASES[name]}  # fmt: skip


def model() -> TinyNet:
    torch.manual_seed(0)
    return TinyNet(WIDTH, VOCAB)


def batches():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(STEPS)]


def fingerprint(weights) -> float:
    """The sum of squares of every weight, in float64."""
    return float(sum(w.detach().double().square().sum() for w in weights))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", help="write the JSON here (default: print it)")
    ap.add_argument("--case", help="run this case alone and print its figures")
    args = ap.parse_args(argv)
    if args.case:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29566", RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")  # fmt: skip
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model(), config=config(args.case))
        params = list(engine.module.parameters())
        losses, sums = [], []
        for ids in batches():
            loss = engine(ids)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if engine.zero_optimization_stage() == 3:
                with deepspeed.zero.GatheredParameters(params):
                    sums.append(fingerprint(params))
            else:
                sums.append(fingerprint(params))
        print("FIGURES " + json.dumps({"losses": losses, "sum_sq": sums}))
        return 0
    import subprocess

    import deepspeed

    command = " ".join(["DS_ACCELERATOR=cpu .peers/bin/python", *sys.argv])
    out = {"command": command, "deepspeed": deepspeed.__version__, "cases": {}}
    for name in CASES:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        run = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True,
                             text=True, env=env)  # fmt: skip
        if run.returncode:
            print(run.stdout[-3000:], run.stderr[-5000:], file=sys.stderr)
            raise SystemExit(f"case {name} failed")
        line = next(x for x in run.stdout.splitlines() if x.startswith("FIGURES "))
        out["cases"][name] = {"config": config(name), **json.loads(line[len("FIGURES ") :])}
    return emit(out, args.write)


if __name__ == "__main__":
    raise SystemExit(main())
