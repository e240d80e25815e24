"""DeepSpeed 0.19.8 with the config's ``"optimizer": {"type": "Muon"}`` on a tiny model,
recorded as golden figures for tests/test_muon.py.

    DS_ACCELERATOR=cpu .peers/bin/python scripts/muon_golden.py --write tests/golden/muon.json

One rank (gloo), 6 steps each, the loss of each step, each case in a process of its own. The
cases cover ZeRO 0-3, the model built under ``zero.Init`` (where DeepSpeed's Muon was off until
#8438), the optimizer offloaded, both Newton-Schulz methods, ``adam_w_mode`` off, every Muon key
away from its default somewhere, and one case with DeepSpeed's default clipping (1.0), which
DeepSpeed applies to the orthogonalised updates (see tests/test_muon.py). Which parameters took
Muon (``use_muon``) is recorded too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from _golden import TinyNet, emit

WIDTH, VOCAB, SEQ, MICRO, STEPS = 16, 32, 9, 4, 6
MUON = {"type": "Muon", "params": {"lr": 0.01, "muon_lr": 0.02, "adam_lr": 3e-3,
                                   "momentum": 0.9, "weight_decay": 0.01,
                                   "betas": [0.8, 0.95], "eps": 1e-8}}  # fmt: skip
STANDARD = {"type": "Muon", "params": {"lr": 0.01, "ns_method": "standard"}}
ADAM_L2 = {"type": "Muon", "params": {"lr": 0.01, "adam_w_mode": False, "weight_decay": 0.05}}
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
# DeepSpeed refuses Muon with reduce_scatter at ZeRO-3 ("cannot be used together")
S3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_scatter": False}
CASES = {
    "zero0": {"optimizer": MUON, "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0},
    "zero1": {"optimizer": MUON, "zero_optimization": {"stage": 1}, "gradient_clipping": 0.0},
    "zero2_standard": {"optimizer": STANDARD, "zero_optimization": {"stage": 2},
                       "gradient_clipping": 0.0},
    # the same without torch.compile (TORCHDYNAMO_DISABLE=1): DeepSpeed's own iteration in
    # bf16, eager, which zerostack's is (compiled, inductor fuses bf16 arithmetic in fp32)
    "zero2_standard_eager": {"optimizer": STANDARD, "zero_optimization": {"stage": 2},
                             "gradient_clipping": 0.0},
    "zero2_adam_l2": {"optimizer": ADAM_L2, "zero_optimization": {"stage": 2},
                      "gradient_clipping": 0.0},
    "zero3": {"optimizer": MUON, "zero_optimization": S3, "gradient_clipping": 0.0},
    "zero3_init": {"optimizer": MUON, "zero_optimization": S3, "gradient_clipping": 0.0},
    "zero2_offload": {"optimizer": MUON, "zero_optimization": {"stage": 2, **OFFLOAD},
                      "gradient_clipping": 0.0},
    "zero1_clipped": {"optimizer": MUON, "zero_optimization": {"stage": 1},
                      "gradient_clipping": 0.05},
}  # fmt: skip


def config(name: str) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            **CASES[name]}  # fmt: skip


def model() -> TinyNet:
    torch.manual_seed(0)
    return TinyNet(WIDTH, VOCAB)


def batches():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(STEPS)]


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
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29565", RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")  # fmt: skip
        import deepspeed

        cfg = config(args.case)
        if args.case.endswith("_init"):
            deepspeed.init_distributed(dist_backend="gloo")
            with deepspeed.zero.Init(config_dict_or_path=cfg):
                net = model()
        else:
            net = model()
        engine, *_ = deepspeed.initialize(model=net, config=cfg)
        muon = sorted(n for n, p in net.named_parameters() if p.use_muon)
        print("MUON " + json.dumps(muon))
        print("LOSSES " + json.dumps(train(engine)))
        return 0
    import subprocess

    import deepspeed

    command = " ".join(["DS_ACCELERATOR=cpu .peers/bin/python", *sys.argv])
    out = {"command": command, "deepspeed": deepspeed.__version__, "configs": {}, "cases": {},
           "use_muon": {}}  # fmt: skip
    for name in CASES:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if name.endswith("_eager"):
            env["TORCHDYNAMO_DISABLE"] = "1"
        run = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True,
                             text=True, env=env)  # fmt: skip
        if run.returncode:
            print(run.stdout[-3000:], run.stderr[-5000:], file=sys.stderr)
            raise SystemExit(f"case {name} failed")
        lines = run.stdout.splitlines()
        loss = next(x for x in lines if x.startswith("LOSSES "))
        out["configs"][name] = config(name)
        out["cases"][name] = json.loads(loss[len("LOSSES ") :])
        out["use_muon"][name] = json.loads(next(x for x in lines if x.startswith("MUON "))[5:])
    out["defaults"] = muon_defaults()
    return emit(out, args.write)


def muon_defaults() -> dict:
    """What DeepSpeed's MuonWithAuxAdam puts in a Muon group and an Adam group given none of
    their keys (``lr`` only where the config has none: the engine passes the config's)."""
    from deepspeed.runtime.zero.muon.original_muon import MuonWithAuxAdam

    muon, adam = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    opt = MuonWithAuxAdam([{"params": [muon], "use_muon": True},
                           {"params": [adam], "use_muon": False}])  # fmt: skip
    return {
        "muon": {k: v for k, v in opt.param_groups[0].items() if k != "params"},
        "adam": {k: list(v) if isinstance(v, tuple) else v
                 for k, v in opt.param_groups[1].items() if k != "params"},
    }  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
