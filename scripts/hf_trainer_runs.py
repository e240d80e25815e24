"""Run examples/hf_trainer.py (an unmodified DeepSpeed Trainer script) in each case of
:data:`CASES` on 2 gloo ranks, and print or record rank 0's losses.

    # the golden figures, once, where DeepSpeed 0.19.8 is installed (../shared/PEERS.md):
    DS_ACCELERATOR=cpu .peers/bin/python scripts/hf_trainer_runs.py --engine deepspeed \
        --write tests/golden/hf_trainer.json
    # zerostack, against them (the table in the docs):
    python scripts/hf_trainer_runs.py --engine zerostack --against tests/golden/hf_trainer.json

Under ``--engine zerostack`` the script runs as ``torchrun -m zerostack.as_deepspeed
examples/hf_trainer.py``; under ``deepspeed``, as ``torchrun examples/hf_trainer.py``.
tests/test_hf_trainer.py runs the same cases through :func:`run`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "hf_trainer.py")
ACCELERATE_SCRIPT = os.path.join(ROOT, "examples", "accelerate_loop.py")
STEPS = 4

CASES: dict[str, dict] = {
    # name: ds config settings and script flags
    "zero2_gas1": {"stage": 2, "gas": 1, "reload": True},
    "zero2_gas2": {"stage": 2, "gas": 2},
    "zero3_gas1": {"stage": 3, "gas": 1, "reload": True},
    "zero3_gas2": {"stage": 3, "gas": 2, "reload": True},
    "zero3_torch_optimizer": {"stage": 3, "gas": 1, "blocks": False},
    "zero3_bf16": {"stage": 3, "gas": 1, "bf16": True},
    "zero2_offload": {"stage": 2, "gas": 1, "offload": True},
    "zero2_torch_optimizer": {"stage": 2, "gas": 2, "blocks": False},
    "zero2_gas2_clip": {"stage": 2, "gas": 2, "clip": 1.0},
    "zero3_gas2_clip": {"stage": 3, "gas": 2, "clip": 1.0},
}
"""Every case trains 4 steps of a per-device batch of 2 with AdamW, without clipping but where
``clip`` gives the Trainer's ``max_grad_norm`` (its default is 1.0). ``blocks``: the config has
an optimizer and a scheduler block (the default), or none (the Trainer's own AdamW and
schedule go to ``initialize``). ``offload``: the optimizer on the CPU (DeepSpeedCPUAdam)."""


def ds_config(stage: int, blocks: bool = True, offload: bool = False, **_) -> dict:
    """The DeepSpeed config of a case, with the Trainer's ``"auto"`` values."""
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
    }
    if blocks:
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto", "eps": "auto"},
        }
        config["scheduler"] = {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
            },
        }
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_allow_untested_optimizer"] = True
    return config


ACCELERATE_CASES = {
    "accelerate_zero3_gas1": {"stage": 3, "gas": 1},
    "accelerate_zero2_gas2": {"stage": 2, "gas": 2},
}
"""examples/accelerate_loop.py: Accelerate's own loop with a DeepSpeedPlugin (4 steps, AdamW)."""


def _torchrun(engine: str, script: str, args: list[str], timeout: float, ranks: int = 2) -> dict:
    """Rank 0's ``RESULT`` of ``script`` on ``ranks`` ranks (under the runner for zerostack).
    Raises with the output when the run fails."""
    runner = ["-m", "zerostack.as_deepspeed"] if engine == "zerostack" else []
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(ranks),
        *runner,
        script,
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    if engine == "zerostack" and os.environ.get("ZEROSTACK_TEST_SCRIPT_SERVER") == "1":
        # the test suite: the same ranks, forked from a server that imported the libraries
        from tests.support.script_server import run_script

        done = run_script([script, *args], ranks, env, timeout)
    else:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [json.loads(x[7:]) for x in done.stdout.splitlines() if x.startswith("RESULT {")]
    # DeepSpeed itself sometimes aborts at exit, after the script's end ("terminate called
    # without an active exception": a gloo group destroyed while a peer still runs), and so do
    # torch's DDP under Lightning ("peer") and under the plain Trainer ("single"); their results
    # stand. zerostack must exit 0.
    peer = engine != "zerostack"
    aborted_after = peer and lines and "terminate called" in done.stderr
    if (done.returncode != 0 and not aborted_after) or not lines:
        raise RuntimeError(
            f"{' '.join(cmd)}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        )
    return lines[0]


def run_accelerate(
    engine: str, case: dict, out: str, *, save_at: int = 0, resume: bool = False
) -> dict:
    """One case of examples/accelerate_loop.py; ``save_at`` steps then ``save_state``, or with
    ``resume``, ``load_state`` from ``out`` and the steps after ``save_at``."""
    args = ["--stage", str(case["stage"]), "--gas", str(case["gas"]), "--out", out]
    args += ["--save_at", str(save_at)] if save_at else []
    args += ["--resume"] if resume else []
    return _torchrun(engine, ACCELERATE_SCRIPT, args, timeout=300)


def run(
    engine: str,
    case: dict,
    out: str,
    *,
    steps: int = STEPS,
    save_steps: int = 0,
    resume: str | None = None,
    timeout: float = 300,
) -> dict:
    """Train one case; rank 0's result (``losses``: [step, loss, grad norm] per step, and
    ``reload_loss`` when the case reloads). Raises with the output when the run fails.

    ``engine`` "single": the same global batch in one process, plain torch (no DeepSpeed config:
    the Trainer's own AdamW and schedule, so compare with a case without ``blocks``)."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "ds_config.json")
    with open(path, "w") as f:
        json.dump(ds_config(**case), f)
    ranks, micro = (1, "4") if engine == "single" else (2, "2")
    args = ["--out", out, "--steps", str(steps), "--gas", str(case["gas"]), "--micro", micro]
    args += [] if engine == "single" else ["--deepspeed", path]
    args += ["--max_grad_norm", str(case.get("clip", 0.0))]
    args += ["--reload"] if case.get("reload") else []
    args += ["--bf16"] if case.get("bf16") else []
    args += ["--save_steps", str(save_steps)] if save_steps else []
    args += ["--resume", resume] if resume else []
    return _torchrun(engine, SCRIPT, args, timeout, ranks)


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
                print(name, json.dumps(results[name]), flush=True)
        for name, case in ACCELERATE_CASES.items():
            if args.k in name:
                results[name] = run_accelerate(args.engine, case, os.path.join(tmp, name))
                print(name, json.dumps(results[name]), flush=True)
        if args.k in "accelerate_zero2_gas2_resumed":
            out = os.path.join(tmp, "accelerate_resume")
            case = ACCELERATE_CASES["accelerate_zero2_gas2"]
            run_accelerate(args.engine, case, out, save_at=2)
            results["accelerate_zero2_gas2_resumed"] = run_accelerate(
                args.engine, case, out, save_at=2, resume=True
            )
            print("accelerate_zero2_gas2_resumed", results["accelerate_zero2_gas2_resumed"])
        if args.k in "zero3_gas2_resumed":  # zero3_gas2 saved at step 2, resumed to step 4
            case = CASES["zero3_gas2"]
            first = os.path.join(tmp, "resume")
            run(args.engine, {**case, "reload": False}, first, steps=2, save_steps=2)
            results["zero3_gas2_resumed"] = run(
                args.engine,
                {**case, "reload": False},
                first,
                resume=os.path.join(first, "checkpoint-2"),
            )
            print("zero3_gas2_resumed", json.dumps(results["zero3_gas2_resumed"]), flush=True)
    finish(args, results, ("deepspeed", "transformers", "accelerate", "torch"), table)
    return 0


def finish(args, results: dict, packages: tuple[str, ...], table) -> None:
    """``--write``: record ``results`` (with the command and the ``packages``' versions; a file
    already there keeps its other cases' results, so ``-k`` re-records some). ``--against``:
    print ``table(results, golden)``."""
    if args.write:
        import importlib.metadata as md

        old = json.load(open(args.write))["results"] if os.path.exists(args.write) else {}
        record = {
            "command": " ".join(  # all cases
                ["DS_ACCELERATOR=cpu", os.path.relpath(sys.executable, ROOT), sys.argv[0]]
                + ["--engine", args.engine, "--write", args.write]
            ),
            "versions": {p: md.version(p) for p in packages},
            "results": {**old, **results},
        }
        with open(args.write, "w") as f:
            f.write(json.dumps(record, indent=1) + "\n")
    if args.against:
        golden = json.load(open(args.against))["results"]
        print(table(results, golden))


def table(results: dict, golden: dict) -> str:
    """Markdown: per case, the largest relative difference of the losses and the reload loss."""
    rows = ["| case | steps | loss, largest rel. diff | reload loss, rel. diff |"]
    rows.append("|---|---|---|---|")
    for name, got in results.items():
        want = golden.get(name)
        if want is None:
            continue
        loss = (lambda x: x) if name.startswith("accelerate") else (lambda x: x[1])
        pairs = zip(got["losses"], want["losses"], strict=True)
        diffs = [abs(loss(a) - loss(b)) / abs(loss(b)) for a, b in pairs]
        reload = "-"
        if "reload_loss" in want:
            reload = f"{abs(got['reload_loss'] - want['reload_loss']) / want['reload_loss']:.1e}"
        rows.append(f"| {name} | {len(diffs)} | {max(diffs):.1e} | {reload} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
