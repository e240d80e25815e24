"""Run examples/lightning_trainer.py in each case of :data:`CASES` on 2 gloo ranks, and print or
record rank 0's results.

    # the golden figures, once, where DeepSpeed 0.19.8 is installed (../shared/PEERS.md):
    DS_ACCELERATOR=cpu .peers/bin/python scripts/lightning_runs.py --engine deepspeed \
        --write tests/golden/lightning.json
    # zerostack, against them (the table in docs/results/lightning_runs.md):
    python scripts/lightning_runs.py --engine zerostack --against tests/golden/lightning.json

A case names Lightning's DeepSpeed strategy (``deepspeed_stage_3``): under ``--engine zerostack``
the script runs as ``torchrun -m zerostack.as_deepspeed examples/lightning_trainer.py``, under
``deepspeed`` as ``torchrun examples/lightning_trainer.py``. Each case trains 2 epochs of 2
optimizer steps, saving a checkpoint at each epoch's end, then resumes from the first one
(``<case>_resumed``: the second epoch again) and, under zerostack, validates the last one in a
fresh process (DeepSpeed 0.19.8 fails there at ZeRO-3: ``DeepSpeedZeRoOffload`` has no
``_restore_from_bit16_weights``). tests/test_lightning.py runs the same cases through :func:`run`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hf_trainer_runs import ROOT, _torchrun, finish  # noqa: E402

SCRIPT = os.path.join(ROOT, "examples", "lightning_trainer.py")
SAVED = "epoch=0-step=2.ckpt"  # the end of the first epoch
LAST = "epoch=1-step=4.ckpt"

CASES: dict[str, dict] = {
    # name: the script's flags
    "stage3_gas2_sgd": {"strategy": "deepspeed_stage_3", "accumulate": 2, "optimizer": "sgd"},
    "stage2_gas1_adamw": {"strategy": "deepspeed_stage_2", "accumulate": 1, "optimizer": "adamw"},
    "stage2_bf16_adamw": {
        "strategy": "deepspeed_stage_2",
        "accumulate": 1,
        "optimizer": "adamw",
        "precision": "bf16-mixed",
    },
}
"""Lightning's DeepSpeed strategy by name; SGD shows a constant factor in the gradient (under
DeepSpeed's strategy, the loss is divided twice by the accumulation steps), AdamW does not.
bf16 runs at stage 2: at stage 3 DeepSpeed's ``zero.Init`` creates the parameters in bf16 before
the layer initialises them, and ``kaiming_uniform_`` drawn in bf16 differs from drawn in fp32
and rounded in a few elements (7 of 2048 here; zerostack's ``zero.Init`` gives the weights a
plain build would), so the runs would start apart."""


def flags(case: dict) -> list[str]:
    out = []
    for key, value in case.items():
        out += [f"--{key}", str(value)]
    return out


def run(
    engine: str,
    case: dict,
    out: str,
    *,
    resume: bool = False,
    validate: bool = False,
    timeout: float = 300,
) -> dict:
    """One run of the script: ``engine`` "zerostack" (under the runner for a DeepSpeed strategy,
    directly for zerostack's own and for Lightning's others, DDP) or "deepspeed" (real
    DeepSpeed). Trains and saves into ``out``; with ``resume``, fits again from the first
    epoch's checkpoint there; with ``validate``, only validates the last one."""
    args = flags(case)
    if resume:
        args += ["--resume", os.path.join(out, SAVED)]
    elif validate:
        args += ["--validate", os.path.join(out, LAST)]
    else:
        args += ["--save", out]
    if engine == "zerostack" and case["strategy"].startswith("deepspeed"):
        engine = "zerostack"  # _torchrun: under the runner
    elif engine == "zerostack":  # zerostack's own strategy (must exit 0), or a peer (ddp)
        engine = "plain" if case["strategy"].startswith("zerostack") else "peer"
    return _torchrun(engine, SCRIPT, args, timeout)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["zerostack", "deepspeed"], required=True)
    parser.add_argument("--write", help="record the results in this JSON file")
    parser.add_argument("--against", help="compare with the results in this JSON file")
    args = parser.parse_args(argv)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in CASES.items():
            out = os.path.join(tmp, name)
            results[name] = run(args.engine, case, out)
            results[f"{name}_resumed"] = run(args.engine, case, out, resume=True)
            if args.engine == "zerostack":
                results[f"{name}_validated"] = run(args.engine, case, out, validate=True)
            for key in (name, f"{name}_resumed", f"{name}_validated"):
                if key in results:
                    print(key, json.dumps(results[key]), flush=True)
    finish(args, results, ("deepspeed", "lightning", "torch"), table)
    return 0


def table(results: dict, golden: dict) -> str:
    """Markdown: per case, the largest relative difference of the losses and of the validation
    loss from DeepSpeed's (the fresh-process validation against DeepSpeed's after training)."""
    rows = ["| case | losses | loss, largest rel. diff | validation loss, rel. diff |"]
    rows.append("|---|---|---|---|")
    for name, got in results.items():
        want = golden.get(name.removesuffix("_validated"))
        if want is None:
            continue
        pairs = zip(got.get("losses", []), want["losses"] if "losses" in got else [], strict=True)
        diffs = [abs(a - b) / abs(b) for a, b in pairs]
        loss = f"{max(diffs):.1e}" if diffs else "-"
        val = abs(got["val_loss"] - want["val_loss"]) / want["val_loss"]
        rows.append(f"| {name} | {len(diffs)} | {loss} | {val:.1e} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
