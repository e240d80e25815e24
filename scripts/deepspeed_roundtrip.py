"""Real DeepSpeed reads the checkpoint folders zerostack writes: run in the peer environment
(../shared/PEERS.md), where DeepSpeed 0.19.8 is installed and zerostack is not.

    DS_ACCELERATOR=cpu .peers/bin/python scripts/deepspeed_roundtrip.py \\
        --zerostack-python .venv/bin/python --write tests/golden/deepspeed_roundtrip.json

For each case of scripts/deepspeed_fixtures.py (a tiny GPT-2, 2 gloo ranks, saved after 3
steps): zerostack trains the case's script under ``-m zerostack.as_deepspeed`` and saves; then,
with no zerostack in the process,

- DeepSpeed's ``load_checkpoint`` resumes zerostack's folder and trains the next 2 steps: their
  losses against DeepSpeed continuing from its own folder of the same run (the fixture's
  recorded losses) and against zerostack continuing from its folder (the universal cases:
  DeepSpeed with ``load_universal`` resumes the universal checkpoint ``zerostack convert
  --universal`` makes of zerostack's folder);
- DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``, the ``zero_to_fp32.py`` zerostack
  placed in the folder (it runs DeepSpeed's where zerostack is not installed) and Lightning's
  ``convert_zero_checkpoint_to_fp32_state_dict`` turn it into weights: against zerostack's own
  consolidation of its files (``zerostack.checkpoint.full_state_dict``, run with zerostack's
  interpreter).

The record (``--write``) holds each figure; tests/test_deepspeed_write.py checks it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepspeed_fixtures as fx  # noqa: E402

ROOT = fx.ROOT
CONSOLIDATE = """
import sys
from safetensors.torch import save_file
from zerostack.checkpoint import full_state_dict
state = full_state_dict(sys.argv[1])
save_file({k: v.contiguous().clone() for k, v in state.items()}, sys.argv[2])
"""


def _rel(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


def _weights_diff(got: dict, want: dict) -> float:
    """The largest difference of any tensor (inf when the names differ)."""
    if sorted(got) != sorted(want):
        return float("inf")
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


def check(case: str, zs_python: str, tmp: str) -> dict:
    import torch
    from safetensors.torch import load_file

    expected = json.load(open(os.path.join(fx.FIXTURES, "expected.json")))["cases"][case]
    folder = os.path.join(tmp, "zerostack")
    zs = fx.run_case(case, "zerostack", folder, python=zs_python)
    if fx.CASES[case].get("universal"):  # DeepSpeed resumes from zerostack's universal folder
        cmd = ["convert", folder, folder, "--to", "deepspeed", "--universal", "--no-progress"]
        subprocess.run([zs_python, "-m", "zerostack.cli", *cmd], check=True, timeout=300)
    ds = fx.run_case(case, "deepspeed", os.path.join(tmp, "unused"), load=folder)
    deepspeed_own = [r[fx.SAVE_AT :] for r in expected["losses"]]
    zs_own = [r[fx.SAVE_AT :] for r in zs]
    out = {
        "deepspeed_resumes": ds,
        "vs_deepspeed_from_its_folder": max(
            _rel(a, b) for a, b in zip(ds, deepspeed_own, strict=True)
        ),
        "vs_zerostack_from_its_folder": max(_rel(a, b) for a, b in zip(ds, zs_own, strict=True)),
    }
    out["first_loss_vs_zerostack"] = max(
        abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(ds, zs_own, strict=True)
    )  # the loaded weights alone
    ours = os.path.join(tmp, "ours.safetensors")
    subprocess.run([zs_python, "-c", CONSOLIDATE, folder, ours], check=True, timeout=300)
    want = load_file(ours)
    # the tools read ZeRO folders: a universal fixture has none, zerostack's folder has both
    own = None if fx.CASES[case].get("universal") else os.path.join(fx.FIXTURES, case)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out["deepspeed_zero_to_fp32"] = _tool(get_fp32_state_dict_from_zero_checkpoint, folder,
                                          own, want)  # fmt: skip
    script = os.path.join(folder, "zero_to_fp32.py")

    def placed(where: str) -> dict:
        dest = os.path.join(tmp, "z2f", os.path.basename(os.path.dirname(where + "/")))
        done = subprocess.run([sys.executable, script, where, dest],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"zero_to_fp32.py: {done.stderr.strip().splitlines()[-1]}")
        return torch.load(os.path.join(dest, "pytorch_model.bin"), weights_only=True)

    out["placed_zero_to_fp32_py"] = _tool(placed, folder, own, want)
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    def lightning(where: str) -> dict:
        name = os.path.join(tmp, f"l{len(os.listdir(tmp))}.pt")
        state = convert_zero_checkpoint_to_fp32_state_dict(where, name)
        if where == folder:
            out["lightning_client_state"] = {k: state[k] for k in ("epoch", "global_steps")
                                             if k in state}  # fmt: skip
        return state["state_dict"]

    out["lightning_converter"] = _tool(lightning, folder, own, want)
    return out


def _tool(run, folder: str, own: str, want: dict):
    """A tool's weights from zerostack's ``folder`` against zerostack's own consolidation; where
    the tool refuses DeepSpeed's ``own`` folder of the same case (stage 0: no ZeRO files), it
    must refuse zerostack's too, and the record says so."""
    own_error = None
    try:
        if own is not None:
            run(own)
    except Exception as exc:  # whatever the tool raises on DeepSpeed's own folder
        own_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    try:
        got = run(folder)
    except Exception:
        if own_error is None:
            raise
        return f"refused, as DeepSpeed's own folder ({own_error})"
    if own_error is not None:
        raise RuntimeError(f"reads zerostack's folder, not DeepSpeed's own: {own_error}")
    return _weights_diff(got, want)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zerostack-python", default=os.path.join(ROOT, ".venv/bin/python"))
    parser.add_argument("--write", help="record the figures in this JSON file")
    parser.add_argument("-k", default="")
    args = parser.parse_args(argv)
    import deepspeed
    import torch

    results = {}
    # AutoTP's slices are not written yet: DeepSpeed has nothing of zerostack's to read
    for case in [c for c in fx.CASES if args.k in c and not fx.CASES[c].get("tp")]:
        with tempfile.TemporaryDirectory() as tmp:
            results[case] = check(case, args.zerostack_python, tmp)
        print(case, json.dumps({k: v for k, v in results[case].items()
                                if k != "deepspeed_resumes"}), flush=True)  # fmt: skip
    if args.write:  # the cases run now replace theirs; the others stay
        old = json.load(open(args.write)) if os.path.exists(args.write) else {"cases": {}}
        results = {**old["cases"], **results}
        record = {
            "command": "DS_ACCELERATOR=cpu .peers/bin/python scripts/deepspeed_roundtrip.py "
            "--zerostack-python .venv/bin/python --write tests/golden/deepspeed_roundtrip.json",
            "versions": {"deepspeed": deepspeed.__version__, "torch": torch.__version__},
            "cases": results,
        }
        with open(args.write, "w") as f:
            f.write(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
