"""Run TRL's trainers (examples/trl_*.py, unmodified TRL scripts written for DeepSpeed) in each
case of :data:`CASES` on 2 gloo ranks, and print or record rank 0's logs.

    # the golden figures, once, where DeepSpeed 0.19.8 and TRL 1.16.0 are installed
    # (../shared/PEERS.md):
    DS_ACCELERATOR=cpu .peers/bin/python scripts/trl_runs.py --engine deepspeed \
        --write tests/golden/trl.json
    # zerostack, against them (the table in the docs):
    python scripts/trl_runs.py --engine zerostack --against tests/golden/trl.json

Under ``--engine zerostack`` a script runs as ``torchrun -m zerostack.as_deepspeed
examples/trl_grpo.py``; under ``deepspeed``, as ``torchrun examples/trl_grpo.py``.
tests/test_trl.py runs the same cases through :func:`run`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from hf_trainer_runs import _torchrun, finish  # noqa: E402

SCRIPTS = {
    name: os.path.join(ROOT, "examples", f"trl_{name}.py") for name in ("grpo", "dpo", "sft_lora")
}
KEYS = {
    "grpo": ("loss", "grad_norm", "reward", "reward_std", "kl"),
    "dpo": ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins",
            "logps/chosen", "logps/rejected"),
    "sft_lora": ("loss", "grad_norm", "mean_token_accuracy"),
}  # fmt: skip
"""What each step logs and the golden figures compare (those a trainer logs), per trainer."""

CASES: dict[str, dict] = {
    # name: trainer, ZeRO stage, script flags
    "grpo_zero3": {"trainer": "grpo", "stage": 3, "args": ["--fp32"]},
    "grpo_zero2": {"trainer": "grpo", "stage": 2, "args": ["--fp32"]},
    "grpo_zero3_sgd": {
        "trainer": "grpo",
        "stage": 3,
        "args": ["--fp32", "--optim", "sgd", "--lr", "0.5", "--max_grad_norm", "0"],
    },
    "grpo_zero3_bf16": {"trainer": "grpo", "stage": 3, "args": []},
    "dpo_zero3": {"trainer": "dpo", "stage": 3, "args": ["--fp32"]},
    "dpo_zero3_sgd": {
        "trainer": "dpo",
        "stage": 3,
        "args": ["--fp32", "--optim", "sgd", "--lr", "0.5", "--max_grad_norm", "0"],
    },
    "sft_lora_zero3": {"trainer": "sft_lora", "stage": 3, "args": ["--fp32"]},
    "sft_lora_zero2": {"trainer": "sft_lora", "stage": 2, "args": ["--fp32"]},
    "sft_lora_zero3_sgd": {
        "trainer": "sft_lora",
        "stage": 3,
        "args": ["--fp32", "--optim", "sgd", "--lr", "0.5", "--max_grad_norm", "0"],
    },
    "sft_lora_zero3_bf16": {"trainer": "sft_lora", "stage": 3, "args": []},
}
"""GRPO: 4 steps, 4 prompts of 4 generations a step over 2 ranks, ``model.generate`` (TRL takes
stage 3's hooks off around it), beta 0.1 (the reference model through ``prepare_deepspeed``),
TRL's defaults otherwise: AdamW at lr 1e-2, clipping at 1.0, gradient checkpointing, bf16 (the
``_bf16`` case; the others run in fp32, ``--fp32``). ``_sgd``: SGD without clipping, which
shows any constant factor in the gradient.

DPO (examples/trl_dpo.py): 4 steps of 2 pairs per rank, no ``ref_model`` given (TRL builds one
and prepares it through ``prepare_deepspeed``), beta 0.1. SFT with a PEFT LoRA
(examples/trl_sft_lora.py): r 4 on q and v over a frozen base, non-reentrant gradient
checkpointing (DeepSpeed issue #4332's case), 4 steps of 2 texts per rank. Both at TRL's
defaults otherwise, as GRPO."""


def ds_config(stage: int, **_) -> dict:
    """The DeepSpeed config of a case, with the Trainer's ``"auto"`` values."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": stage},
    }


def run(engine: str, case: dict, out: str, timeout: float = 300) -> dict:
    """One case; rank 0's result: ``logs`` (per step, the trainer's :data:`KEYS`) and, for
    GRPO, ``completions`` (rank 0's sampled completions, in order). Raises with the output when
    the run fails."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "ds_config.json")
    with open(path, "w") as f:
        json.dump(ds_config(**case), f)
    args = ["--out", out, "--deepspeed", path, *case["args"]]
    got = _torchrun(engine, SCRIPTS[case["trainer"]], args, timeout)
    keys = ("step", *KEYS[case["trainer"]])
    return {**got, "logs": [{k: e[k] for k in keys} for e in got["logs"]]}


def largest_differences(got: dict, want: dict) -> dict[str, float]:
    """Per logged figure (:data:`KEYS`), the largest relative difference over the steps (0
    where both are 0, as the first step's KL)."""
    out = {}
    for key in [k for k in got["logs"][0] if k != "step"]:
        diffs = []
        for a, b in zip(got["logs"], want["logs"], strict=True):
            if a[key] is None and b[key] is None:
                continue
            diffs.append(abs(a[key] - b[key]) / abs(b[key]) if b[key] else abs(a[key]))
        out[key] = max(diffs, default=0.0)
    return out


def table(results: dict, golden: dict) -> str:
    """Markdown: per case, the largest relative difference of each logged figure (loss and grad
    norm, then the trainer's own: the largest of them and which)."""
    rows = ["| case | steps | same samples | loss | grad_norm | the trainer's figures |"]
    rows.append("|---|---|---|---|---|---|")
    for name, got in results.items():
        want = golden.get(name)
        if want is None:
            continue
        diffs = largest_differences(got, want)
        same = "-"  # GRPO samples; DPO and SFT train on the data given
        if "completions" in got:
            same = "yes" if got["completions"] == want["completions"] else "no"
        own = {k: v for k, v in diffs.items() if k not in ("loss", "grad_norm")}
        worst = max(own, key=own.get)
        cells = f"{diffs['loss']:.1e} | {diffs['grad_norm']:.1e} | {own[worst]:.1e} ({worst})"
        rows.append(f"| {name} | {len(got['logs'])} | {same} | {cells} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["zerostack", "deepspeed"], required=True)
    parser.add_argument("--write", help="record the results in this JSON file")
    parser.add_argument("--against", help="compare with the results in this JSON file")
    parser.add_argument("-k", default="", help="only cases whose name contains this")
    args = parser.parse_args(argv)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in CASES.items():
            if args.k in name:
                results[name] = run(args.engine, case, os.path.join(tmp, name))
                print(name, json.dumps(results[name]["logs"]), flush=True)
    packages = ("deepspeed", "trl", "transformers", "accelerate", "peft", "torch")
    finish(args, results, packages, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
