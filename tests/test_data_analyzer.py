"""DeepSpeed's DataAnalyzer (zerostack.data.analyzer): the files DeepSpeed 0.19.8 writes, byte for
byte (tests/golden/data_analyzer.json, scripts/data_analyzer_golden.py), and what they mean.
"""

from __future__ import annotations

import csv
import json
import os
import sys

import numpy as np
import pytest
import torch

from zerostack.data.analyzer import DataAnalyzer, find_fit_int_dtype, split_index
from zerostack.data.indexed_dataset import MMapIndexedDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
import data_analyzer_golden as golden  # noqa: E402

GOLDEN = json.load(open(os.path.join(os.path.dirname(__file__), "golden", "data_analyzer.json")))


@pytest.mark.parametrize("layout", sorted(golden.LAYOUTS))
def test_files_equal_deepspeeds_byte_for_byte(tmp_path, layout):
    """One worker and thread; two workers of two threads reduced by two: the same files, names
    and bytes as DeepSpeed's (a value with over 100 samples flushed to its csv mid-map)."""
    golden.analyze(DataAnalyzer, str(tmp_path), layout)
    assert golden.files(str(tmp_path)) == GOLDEN["layouts"][layout]


def test_the_files_hold_each_samples_value(tmp_path):
    """Read back against the dataset itself: each sample's length in order, each length's
    samples, the token counts, and the smallest dtypes that hold them."""
    golden.analyze(DataAnalyzer, str(tmp_path), "2x2")
    data = golden.dataset()
    lengths = [len(r) for r in data]
    seq = str(tmp_path / "seqlen" / "seqlen")
    per_sample = MMapIndexedDataset(f"{seq}_sample_to_metric")
    assert [int(per_sample[i][0]) for i in range(len(per_sample))] == lengths
    assert per_sample.dtype == np.uint8
    values = MMapIndexedDataset(f"{seq}_index_to_metric")
    samples = MMapIndexedDataset(f"{seq}_index_to_sample")
    assert [int(values[i][0]) for i in range(len(values))] == sorted(set(lengths))
    for i in range(len(values)):
        want = [j for j, n in enumerate(lengths) if n == int(values[i][0])]
        assert sorted(samples[i].tolist()) == want
    freq = MMapIndexedDataset(str(tmp_path / "vocab_freq" / "vocab_freq_metric_value"))[0]
    counts = torch.bincount(torch.cat(data), minlength=golden.VOCAB).tolist()
    counts[0] = sum(12 - n for n in lengths)  # padding
    assert freq.tolist() == counts


def test_dict_batches_and_torch_dtypes(tmp_path):
    """A Hugging Face collator's dict batch and a torch metric: DeepSpeed 0.19.8 counts a dict
    batch as len(batch) samples (its keys) and refuses a torch dtype against numpy's; here each
    sample keeps its own index and np.int64 serves a torch.long metric."""
    data = [{"input_ids": torch.full((n,), 3), "labels": torch.tensor(n)} for n in
            [2, 4, 4, 1, 3, 4, 2]]  # fmt: skip

    def collate(rows):
        return {"input_ids": torch.nn.utils.rnn.pad_sequence([r["input_ids"] for r in rows],
                                                             batch_first=True),
                "labels": torch.stack([r["labels"] for r in rows])}  # fmt: skip

    analyzer = DataAnalyzer(data, batch_size=3, collate_fn=collate, metric_names=["n"],
                            metric_functions=[lambda b: (b["input_ids"] != 0).sum(1)],
                            metric_types=["single_value_per_sample"], metric_dtypes=[np.int64],
                            save_path=str(tmp_path))  # fmt: skip
    analyzer.run_map()
    analyzer.run_reduce()
    with open(tmp_path / "n" / "worker0_thread0" / "n_metric_to_sample_4.csv") as f:
        assert [int(x) for row in csv.reader(f) for x in row] == [1, 2, 5]
    bad = DataAnalyzer(data, collate_fn=collate, metric_names=["n"], metric_dtypes=[np.int32],
                       metric_functions=[lambda b: b["labels"]], save_path=str(tmp_path),
                       metric_types=["single_value_per_sample"])  # fmt: skip
    with pytest.raises(TypeError, match="result dtype torch.int64 does not match metric_dtype"):
        bad.run_map()


def test_helpers_and_refusals(tmp_path):
    assert [find_fit_int_dtype(0, 255), find_fit_int_dtype(0, 256), find_fit_int_dtype(-1, 127),
            find_fit_int_dtype(-129, 0), find_fit_int_dtype(0, 2**40)] == [
        np.uint8, np.uint16, np.int8, np.int16, np.uint64]  # fmt: skip
    assert split_index(0, 10, 3) == [(0, 3), (3, 6), (6, 10)]
    with pytest.raises(ValueError, match="metric type 'per_batch'"):
        DataAnalyzer([], metric_types=["per_batch"])
    with pytest.raises(ValueError, match="worker_id 2 of 2 workers"):
        DataAnalyzer([], num_workers=2, worker_id=2)
    partial = DataAnalyzer(golden.dataset(), num_workers=2, batch_size=7, collate_fn=golden.collate,
                           metric_names=["seqlen"], metric_functions=[golden.seqlen],
                           metric_types=["single_value_per_sample"], metric_dtypes=[np.int64],
                           save_path=str(tmp_path))  # fmt: skip
    partial.run_map()  # worker 0 only: the reduce says whose files are missing
    with pytest.raises(RuntimeError, match="no seqlen_sample_to_metric from worker 1 thread 0"):
        partial.run_reduce()
