"""Indexed datasets written by real DeepSpeed 0.19.8, committed as test data
(tests/fixtures/indexed_dataset/<case>.bin / .idx), and what DeepSpeed's reader returns for each
(tests/fixtures/indexed_dataset/expected.json): so CI, with no DeepSpeed, checks that zerostack
reads DeepSpeed's files as DeepSpeed does and writes the same bytes for the same items.

    # in the peer environment (../shared/PEERS.md):
    DS_ACCELERATOR=cpu .peers/bin/python scripts/indexed_dataset_golden.py \\
        --write tests/fixtures/indexed_dataset/

Each case is a list of builder calls, recorded in the JSON so the test replays them:
``["add", tokens]`` (``add_item(torch.tensor(tokens))``), ``["end"]`` (``end_document()``),
``["merge", case]`` (``merge_file_`` of an earlier case's files), then ``finalize``. Between
them: int32 (given as a torch dtype), uint16 and int64 (the default) tokens, several documents,
empty items (one last), a 2-D item, the extremes of each type, and a file merged in twice.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch

CASES = {
    "int32_docs": {
        "dtype": "torch.int32",
        "ops": [
            ["add", [5, -3, 7]],
            ["add", [2**31 - 1]],
            ["end"],
            ["add", []],
            ["add", [0, 1, 2, 3, 4, 5]],
            ["end"],
            ["add", [-(2**31), 9]],
            ["end"],
        ],
    },
    "uint16_part": {
        "dtype": "uint16",
        "ops": [["add", [1, 2]], ["add", [65535, 0, 7]], ["end"], ["add", [42]], ["end"]],
    },
    "uint16_merged": {
        "dtype": "uint16",
        "ops": [
            ["add", [9, 8, 7]],
            ["end"],
            ["merge", "uint16_part"],
            ["add", []],
            ["add", [300]],
            ["merge", "uint16_part"],
            ["end"],
        ],
    },
    "int64_default": {
        "dtype": None,
        "ops": [["add", [2**40, -1, 3]], ["add", [[1, 2], [3, 4]]], ["end"], ["add", []]],
    },
}
"""Built in this order (a merge reads an earlier case). ``dtype``: the builder's argument, None
for its default."""

DTYPE_ARGS = {"torch.int32": torch.int32, "uint16": np.uint16}


def replay(builder_class, prefix: str, case: dict, merged_from: str) -> None:
    """Run ``case``'s calls on ``builder_class`` (DeepSpeed's here; zerostack's in
    tests/test_indexed_dataset.py), writing ``prefix.bin`` and ``.idx``; merges read from
    ``merged_from``."""
    kwargs = {} if case["dtype"] is None else {"dtype": DTYPE_ARGS[case["dtype"]]}
    builder = builder_class(f"{prefix}.bin", **kwargs)
    for op in case["ops"]:
        if op[0] == "add":
            builder.add_item(torch.tensor(op[1], dtype=torch.int64))
        elif op[0] == "end":
            builder.end_document()
        else:
            builder.merge_file_(os.path.join(merged_from, op[1]))
    builder.finalize(f"{prefix}.idx")


def observe(prefix: str) -> dict:
    """What DeepSpeed's reader returns for the dataset at ``prefix``."""
    from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset

    ds = MMapIndexedDataset(prefix, skip_warmup=True)
    items = [ds[i].tolist() for i in range(len(ds))]
    longest = max(range(len(ds)), key=lambda i: len(items[i]))
    gets = [[longest, 1, 2], [longest, 1, None], [longest, 0, None], [len(ds) - 1, 0, None]]
    return {
        "len": len(ds),
        "dtype": np.dtype(ds.dtype).name,
        "sizes": ds.sizes.tolist(),
        "doc_idx": ds.doc_idx.tolist(),
        "items": items,
        "slice_1_3": [a.tolist() for a in ds[1:3]],
        "gets": [[i, o, n, ds.get(i, offset=o, length=n).tolist()] for i, o, n in gets],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", required=True, help="the fixtures folder")
    folder = parser.parse_args().write
    os.makedirs(folder, exist_ok=True)
    expected = {}
    from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import (
        MMapIndexedDatasetBuilder,
    )

    for name, case in CASES.items():
        replay(MMapIndexedDatasetBuilder, os.path.join(folder, name), case, folder)
        expected[name] = {**case, "expected": observe(os.path.join(folder, name))}
    with open(os.path.join(folder, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    print(f"wrote {len(CASES)} datasets and expected.json to {folder}")


if __name__ == "__main__":
    main()
