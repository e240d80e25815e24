"""DeepSpeed 0.19.8's DataAnalyzer on a small token dataset: every file it writes, by path, size
and sha256, recorded as golden figures for tests/test_data_analyzer.py.

    DS_ACCELERATOR=cpu .peers/bin/python scripts/data_analyzer_golden.py \
        --write tests/golden/data_analyzer.json

The dataset: 230 token sequences of lengths 1-12 (seeded), padded with 0 into a tensor batch.
Metrics: ``seqlen`` (tokens per sample; single value per sample: one length is shared by more
than 100 samples, so its csv file is appended to during the map) and ``vocab_freq`` (the token
counts, accumulated over samples). Two layouts: one worker with one thread (reduced by one
thread), and two workers with two threads each (each worker's map run on its own, as
DeepSpeedExamples' analyze script runs them; reduced by two threads).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile

import numpy as np
import torch
from _golden import emit

VOCAB, SAMPLES = 9, 230
LAYOUTS = {"1x1": (1, 1, 1), "2x2": (2, 2, 2)}  # workers, threads, reduce threads


def dataset() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(SAMPLES):
        n = 5 if i % 2 else int(torch.randint(1, 13, (1,), generator=g))  # length 5: > 100
        out.append(torch.randint(1, VOCAB, (n,), generator=g))
    return out


def collate(rows: list[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(len(rows), 12, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def seqlen(batch: torch.Tensor) -> np.ndarray:
    """Numpy arrays: DeepSpeed's check compares the result's dtype with a numpy metric_dtype
    (its valid_dtypes), which a torch dtype never equals."""
    return (batch != 0).sum(dim=1).numpy()


def vocab_freq(batch: torch.Tensor) -> np.ndarray:
    return torch.bincount(batch.view(-1), minlength=VOCAB).numpy()


def analyze(cls, root: str, layout: str) -> None:
    """Map every worker, then reduce, as DeepSpeedExamples' analyze_data.py does."""
    workers, threads, reduce_threads = LAYOUTS[layout]
    common = dict(num_workers=workers, num_threads=threads, batch_size=7, collate_fn=collate,
                  metric_names=["seqlen", "vocab_freq"], metric_functions=[seqlen, vocab_freq],
                  metric_types=["single_value_per_sample", "accumulate_value_over_samples"],
                  metric_dtypes=[np.int64, np.int64], save_path=root)  # fmt: skip
    data = dataset()
    for w in range(workers):
        cls(data, worker_id=w, **common).run_map()
    cls(data, num_threads_reduce=reduce_threads, **common).run_reduce()


def files(root: str) -> dict[str, list]:
    """Every file under ``root``: its size and sha256."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            path = os.path.join(d, n)
            with open(path, "rb") as f:
                blob = f.read()
            out[os.path.relpath(path, root)] = [len(blob), hashlib.sha256(blob).hexdigest()]
    return dict(sorted(out.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", help="write the JSON here (default: print it)")
    args = ap.parse_args(argv)
    import deepspeed
    from deepspeed.runtime.data_pipeline.data_sampling import data_analyzer

    out = {"command": " ".join(["DS_ACCELERATOR=cpu .peers/bin/python", *sys.argv]),
           "deepspeed": deepspeed.__version__, "layouts": {}}  # fmt: skip
    for layout in LAYOUTS:
        with tempfile.TemporaryDirectory() as root:
            analyze(data_analyzer.DataAnalyzer, root, layout)
            out["layouts"][layout] = files(root)
    return emit(out, args.write)


if __name__ == "__main__":
    raise SystemExit(main())
