"""Run DeepSpeed's ALST tutorial script (examples/alst_tutorial.py) in each case of
:data:`CASES` on 2 gloo ranks (sp 2, ZeRO-3), and print or record rank 0's figures.

    # the golden figures, once, where DeepSpeed 0.19.8 is installed (../shared/PEERS.md):
    DS_ACCELERATOR=cpu .peers/bin/python scripts/alst_tutorial_runs.py --engine deepspeed \
        --write tests/golden/alst_tutorial.json
    # zerostack, against them:
    python scripts/alst_tutorial_runs.py --engine zerostack \
        --against tests/golden/alst_tutorial.json

Under ``--engine zerostack`` the script runs as ``torchrun -m zerostack.as_deepspeed
examples/alst_tutorial.py``; under ``deepspeed``, as ``torchrun examples/alst_tutorial.py``.
tests/test_alst_tutorial.py runs the same cases through :func:`run`.
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

SCRIPT = os.path.join(ROOT, "examples", "alst_tutorial.py")
KEYS = ("loss", "grad_norm")

CASES: dict[str, list[str]] = {
    "tutorial": [],
    "tutorial_sgd": ["--sgd"],
    "tiled_offload": ["--tiled_mlp", "--offload_checkpoints"],
    "tiled_offload_sgd": ["--tiled_mlp", "--offload_checkpoints", "--sgd"],
}
"""The script's flags per case: the tutorial's Part 1 loop (its config's Adam at lr 1e-3), with
torch's SGD at lr 0.5 (``_sgd``: no momentum, no clipping, so a constant factor in the gradient
shows), and with Part 2's tiled MLP and checkpoint-offload context around Transformers'
gradient checkpointing (``tiled_offload``). 4 iterations each (2 samples, sp 2)."""


def run(engine: str, flags: list[str], out: str, timeout: float = 300) -> dict:
    """One case; rank 0's ``figures`` (per iteration: loss, grad norm). Raises with the output
    when the run fails."""
    os.makedirs(out, exist_ok=True)
    return _torchrun(engine, SCRIPT, ["--model", os.path.join(out, "model"), *flags], timeout)


def largest_differences(got: dict, want: dict) -> dict[str, float]:
    """Per key of :data:`KEYS`, the largest relative difference over the iterations."""
    return {
        key: max(
            abs(a[key] - b[key]) / abs(b[key])
            for a, b in zip(got["figures"], want["figures"], strict=True)
        )
        for key in KEYS
    }


def table(results: dict, golden: dict) -> str:
    """Markdown: per case, the largest relative difference of each figure."""
    rows = ["| case | iterations | " + " | ".join(KEYS) + " |", "|---|---|" + "---|" * len(KEYS)]
    for name, got in results.items():
        if name in golden:
            diffs = largest_differences(got, golden[name])
            cells = " | ".join(f"{diffs[k]:.1e}" for k in KEYS)
            rows.append(f"| {name} | {len(got['figures'])} | {cells} |")
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
        for name, flags in CASES.items():
            if args.k in name:
                results[name] = run(args.engine, flags, os.path.join(tmp, name))
                print(name, json.dumps(results[name]["figures"]), flush=True)
    finish(args, results, ("deepspeed", "transformers", "torch"), table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
