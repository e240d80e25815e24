"""DeepSpeed's ``DataAnalyzer``: per-sample metrics of a dataset, mapped by workers and reduced
into indexed-dataset files (:mod:`.indexed_dataset`), the files DeepSpeed's data pipeline reads
(``seqlen/seqlen_sample_to_metric`` is what dynamic batching's ``metrics_path`` holds)::

    analyzer = DataAnalyzer(dataset, num_workers=2, worker_id=w, batch_size=8,
                            metric_names=["seqlen"], metric_functions=[seqlens],
                            metric_types=["single_value_per_sample"],
                            metric_dtypes=[np.int64], save_path="analysis")
    analyzer.run_map()       # each worker, on its share of the dataset
    analyzer.run_reduce()    # once, after every worker: the merged files

The files, their names and their bytes are DeepSpeed 0.19.8's (tests/golden/data_analyzer.json,
scripts/data_analyzer_golden.py). A ``single_value_per_sample`` metric gives, under
``<save_path>/<name>/``: ``<name>_sample_to_metric`` (each sample's value, in dataset order),
``<name>_index_to_metric`` (the distinct values, ascending), ``<name>_index_to_sample`` (the
samples of each value) and ``<name>_index_to_sample_percentile_merged`` (those lists merged by
about 1% of the values each); an ``accumulate_value_over_samples`` metric gives
``<name>_metric_value`` (the sum over samples). Merged files use the smallest integer dtype
that holds their values, as DeepSpeed's.

Where this differs from DeepSpeed 0.19.8, on purpose:

- a batch counts the samples the sampler put in it; DeepSpeed counts ``len(batch)``, the number
  of keys for a dict batch (a Hugging Face collator's), so from the second batch on it records
  the wrong sample indices;
- a metric's dtype may be given as numpy's or torch's (``np.int64`` for a ``torch.long``
  tensor): DeepSpeed compares a torch dtype with a numpy type, which is never equal, so its own
  GPT example stops at that assertion;
- ``num_threads`` > 1 runs the threads' shares one after another in this process, not in
  forked processes (the same files).
"""

from __future__ import annotations

import csv
import glob
import os
from collections import defaultdict

import numpy as np
import torch
from torch.utils.data import BatchSampler, SequentialSampler

from .indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder

SINGLE, ACCUMULATE = "single_value_per_sample", "accumulate_value_over_samples"
FLUSH = 100  # samples of one value kept in memory before they are appended to its csv file


def find_fit_int_dtype(lo: int, hi: int) -> type[np.integer]:
    """The smallest integer dtype holding ``[lo, hi]`` (unsigned when ``lo >= 0``)."""
    kinds = (
        (np.uint8, np.uint16, np.uint32, np.uint64)
        if lo >= 0
        else (np.int8, np.int16, np.int32, np.int64)
    )
    for kind in kinds:
        info = np.iinfo(kind)
        if info.min <= lo and hi <= info.max:
            return kind
    return kinds[-1]


def split_index(start: int, end: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into ``parts`` ranges as DeepSpeed cuts it (``np.linspace``)."""
    edges = np.linspace(start, end, dtype=int, num=parts + 1)
    return [(int(edges[i]), int(edges[i + 1])) for i in range(parts)]


def _builder(prefix: str, dtype) -> MMapIndexedDatasetBuilder:
    return MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)


def _close(builder: MMapIndexedDatasetBuilder, prefix: str) -> None:
    builder.end_document()
    builder.finalize(f"{prefix}.idx")


def _same_dtype(values, dtype) -> bool:
    """Whether ``values`` (a tensor or an array) hold ``dtype`` (numpy's or torch's)."""
    have = values.dtype
    if isinstance(have, torch.dtype):
        have = torch.empty((), dtype=have).numpy().dtype
    if isinstance(dtype, torch.dtype):
        dtype = torch.empty((), dtype=dtype).numpy().dtype
    return np.dtype(have) == np.dtype(dtype)


class DataAnalyzer:
    """DeepSpeed's arguments and files (see the module)."""

    def __init__(
        self,
        dataset,
        num_workers=1,
        worker_id=0,
        num_threads=1,
        num_threads_reduce=1,
        specific_threads=(),
        batch_size=1,
        metric_names=(),
        metric_functions=(),
        metric_types=(),
        metric_dtypes=(),
        save_path="./",
        collate_fn=None,
        custom_map_init=None,
        custom_map_update=None,
        custom_map_finalize=None,
        custom_reduce=None,
        sample_indices=None,
    ) -> None:
        for kind in metric_types:
            if kind not in (SINGLE, ACCUMULATE):
                raise ValueError(
                    f"DataAnalyzer: metric type {kind!r} is not {SINGLE} or {ACCUMULATE}"
                )
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"DataAnalyzer: worker_id {worker_id} of {num_workers} workers")
        self.dataset, self.num_workers, self.worker_id = dataset, num_workers, worker_id
        self.num_threads, self.num_threads_reduce = num_threads, num_threads_reduce
        self.specific_threads, self.batch_size = list(specific_threads), batch_size
        self.metric_names, self.metric_functions = list(metric_names), list(metric_functions)
        self.metric_types, self.metric_dtypes = list(metric_types), list(metric_dtypes)
        self.save_path, self.collate_fn, self.sample_indices = save_path, collate_fn, sample_indices
        self.custom_map_init, self.custom_map_update = custom_map_init, custom_map_update
        self.custom_map_finalize, self.custom_reduce = custom_map_finalize, custom_reduce

    # ------------------------------------------------------------------ map
    def init_metric_results(
        self, thread_id, metric_names, metric_types, metric_dtypes, save_path, worker_id
    ) -> list[dict]:
        results = []
        for name, kind, dtype in zip(metric_names, metric_types, metric_dtypes, strict=True):
            where = f"{save_path}/{name}/worker{worker_id}_thread{thread_id}/"
            os.makedirs(where, exist_ok=True)
            if kind == SINGLE:
                to_sample = f"{where}/{name}_metric_to_sample"
                for stale in glob.glob(f"{glob.escape(to_sample)}*"):
                    os.remove(stale)  # a rerun appends to fresh files
                prefix = f"{where}/{name}_sample_to_metric"
                results.append(
                    {
                        "sample_to_metric_fname": prefix,
                        "sample_to_metric_builder": _builder(prefix, dtype),
                        "metric_to_sample_fname": to_sample,
                        "metric_to_sample_dict": defaultdict(list),
                    }
                )
            else:
                results.append(
                    {"metric_value": None, "metric_value_fname": f"{where}/{name}_metric_value"}
                )
        return results

    def update_metric_results(
        self, data, metric_types, metric_dtypes, metric_functions, metric_results, batch_start_idx=0
    ) -> None:
        for kind, dtype, fn, result in zip(
            metric_types, metric_dtypes, metric_functions, metric_results, strict=True
        ):
            values = fn(data)
            if not (torch.is_tensor(values) or isinstance(values, np.ndarray)):
                raise TypeError("DataAnalyzer: a metric function must return a tensor or array")
            if not _same_dtype(values, dtype):
                raise TypeError(
                    f"DataAnalyzer: metric function result dtype {values.dtype} does "
                    f"not match metric_dtype {dtype}"
                )
            values = torch.from_numpy(values) if isinstance(values, np.ndarray) else values
            if kind == ACCUMULATE:
                if result["metric_value"] is None:
                    result["metric_value"] = values
                else:
                    result["metric_value"].add_(values)
                continue
            by_value = result["metric_to_sample_dict"]
            for row in range(values.size(0)):
                sample = batch_start_idx + row
                if isinstance(data, dict) and "index" in data:  # Megatron's: the sample's index
                    sample = data["index"][row][0].item()
                elif self.sample_indices is not None:  # the user's order of the samples
                    sample = self.sample_indices[sample]
                result["sample_to_metric_builder"].add_item(values[row].reshape(-1))
                by_value[values[row].item()].append(sample)
            self._flush(result, FLUSH)

    @staticmethod
    def _flush(result: dict, above: int) -> None:
        """Append each value's samples to its csv file once more than ``above`` are held."""
        for value, samples in result["metric_to_sample_dict"].items():
            if len(samples) > above:
                with open(f"{result['metric_to_sample_fname']}_{value}.csv", "a") as f:
                    csv.writer(f).writerows([samples])
                result["metric_to_sample_dict"][value] = []

    def finalize_metric_results(self, metric_types, metric_dtypes, metric_results) -> None:
        for kind, dtype, result in zip(metric_types, metric_dtypes, metric_results, strict=True):
            if kind == SINGLE:
                _close(result["sample_to_metric_builder"], result["sample_to_metric_fname"])
                self._flush(result, 0)
            elif result["metric_value"] is not None:
                builder = _builder(result["metric_value_fname"], dtype)
                builder.add_item(result["metric_value"].reshape(-1))
                _close(builder, result["metric_value_fname"])

    def run_map_helper(self, thread_id: int) -> None:
        """Map thread ``thread_id``'s share of this worker's samples."""
        start, end = self.thread_splits[thread_id]
        init = self.custom_map_init or self.init_metric_results
        update = self.custom_map_update or self.update_metric_results
        finalize = self.custom_map_finalize or self.finalize_metric_results
        names, kinds, dtypes = self.metric_names, self.metric_types, self.metric_dtypes
        results = init(thread_id, names, kinds, dtypes, self.save_path, self.worker_id)
        collate = self.collate_fn or torch.utils.data.default_collate
        sampler = BatchSampler(SequentialSampler(range(start, end)), self.batch_size, False)
        done = 0
        for positions in sampler:
            data = collate([self.dataset[start + i] for i in positions])
            update(data, kinds, dtypes, self.metric_functions, results, start + done)
            done += len(positions)
        finalize(kinds, dtypes, results)

    def run_map(self) -> None:
        """Map this worker's share (its threads' shares one after another)."""
        self.worker_splits = split_index(0, len(self.dataset), self.num_workers)
        self.thread_splits = split_index(*self.worker_splits[self.worker_id], self.num_threads)
        for thread in self.specific_threads or range(self.num_threads):
            self.run_map_helper(thread)

    # ------------------------------------------------------------------ reduce
    def _parts(self, path: str):
        """(worker, thread) of every map share, in order, with its folder."""
        for w in range(self.num_workers):
            for t in range(self.num_threads):
                yield w, t, f"{path}/worker{w}_thread{t}/"

    def _share(self, folder: str, prefix: str, w: int, t: int) -> MMapIndexedDataset:
        if not MMapIndexedDataset.exists(f"{folder}/{prefix}"):
            raise RuntimeError(
                f"DataAnalyzer: no {prefix} from worker {w} thread {t} in {folder}: run every "
                "worker's run_map before run_reduce"
            )
        return MMapIndexedDataset(f"{folder}/{prefix}", skip_warmup=True)

    def _reduce_single(self, name: str, path: str) -> None:
        total = len(self.dataset)
        sample_dtype = find_fit_int_dtype(0, total - 1)
        shares = [
            self._share(folder, f"{name}_sample_to_metric", w, t)
            for w, t, folder in self._parts(path)
        ]
        count = sum(len(s) for s in shares)
        if count != total:
            raise RuntimeError(
                f"DataAnalyzer: the map files of {name!r} hold {count} samples, the "
                f"dataset {total}: a map worker did not finish"
            )
        values = sorted({int(v) for s in shares for v in np.unique(np.asarray(s[0 : len(s)]))})
        value_dtype = find_fit_int_dtype(values[0], values[-1])
        split = split_index(0, len(shares), self.num_threads_reduce)
        final = _builder(f"{path}/{name}_sample_to_metric", value_dtype)
        for t, (a, b) in enumerate(split):
            prefix = f"{path}/{name}_sample_to_metric_thread{t}"
            builder = _builder(prefix, value_dtype)
            for share in shares[a:b]:
                for row in range(len(share)):
                    builder.add_item(torch.tensor(share[row].astype(np.int64), dtype=torch.long))
            _close(builder, prefix)
            final.merge_file_(prefix)
        _close(final, f"{path}/{name}_sample_to_metric")
        to_sample = _builder(f"{path}/{name}_index_to_sample", sample_dtype)
        to_metric = _builder(f"{path}/{name}_index_to_metric", value_dtype)
        for t, (a, b) in enumerate(split_index(0, len(values), self.num_threads_reduce)):
            s_prefix = f"{path}/{name}_index_to_sample_thread{t}"
            m_prefix = f"{path}/{name}_index_to_metric_thread{t}"
            s_builder, m_builder = _builder(s_prefix, sample_dtype), _builder(m_prefix, value_dtype)
            for value in values[a:b]:
                samples = []
                for _, _, folder in self._parts(path):
                    fname = f"{folder}/{name}_metric_to_sample_{value}.csv"
                    if os.path.isfile(fname):
                        with open(fname) as f:
                            samples += [int(x) for row in csv.reader(f) for x in row]
                s_builder.add_item(torch.tensor(samples, dtype=torch.long))
                m_builder.add_item(torch.tensor([value], dtype=torch.long))
            _close(s_builder, s_prefix)
            _close(m_builder, m_prefix)
            to_sample.merge_file_(s_prefix)
            to_metric.merge_file_(m_prefix)
        _close(to_sample, f"{path}/{name}_index_to_sample")
        _close(to_metric, f"{path}/{name}_index_to_metric")
        self.output_index_to_sample_percentile(
            f"{path}/{name}_index_to_sample",
            f"{path}/{name}_index_to_metric",
            name,
            path,
            total,
            sample_dtype,
        )

    def _reduce_accumulate(self, name: str, path: str) -> None:
        total = None
        for w, t, folder in self._parts(path):
            part = self._share(folder, f"{name}_metric_value", w, t)
            total = np.copy(part[0]) if total is None else total + part[0]
        prefix = f"{path}/{name}_metric_value"
        builder = _builder(prefix, find_fit_int_dtype(int(total.min()), int(total.max())))
        builder.add_item(torch.tensor(total.astype(np.int64), dtype=torch.long))
        _close(builder, prefix)

    @staticmethod
    def output_index_to_sample_percentile(
        index_to_sample_fname,
        index_to_metric_fname,
        metric_name,
        metric_save_path,
        total_num_samples,
        sample_idx_dtype,
    ) -> dict:
        """Write ``<name>_index_to_sample_percentile_merged`` (the samples of about 1% of the
        values per item); returns the samples per value."""
        to_sample = MMapIndexedDataset(index_to_sample_fname, skip_warmup=True)
        to_metric = MMapIndexedDataset(index_to_metric_fname, skip_warmup=True)
        per_value = {to_metric[i][0]: len(to_sample[i]) for i in range(len(to_sample))}
        if sum(per_value.values()) != total_num_samples:
            raise RuntimeError("DataAnalyzer: the index files do not hold every sample once")
        prefix = f"{metric_save_path}/{metric_name}_index_to_sample_percentile_merged"
        builder = _builder(prefix, sample_idx_dtype)
        step = max(1, len(to_sample) // 100)
        for i in range(0, len(to_sample), step):
            merged = np.concatenate(to_sample[i : min(len(to_sample), i + step)], axis=None)
            builder.add_item(torch.tensor(merged.astype(np.int64), dtype=torch.long))
        _close(builder, prefix)
        return per_value

    def run_reduce(self) -> None:
        """Merge every worker's map files (once, after all of them)."""
        if self.custom_reduce is not None:
            self.custom_reduce(
                self.dataset,
                self.metric_names,
                self.metric_types,
                self.save_path,
                self.num_workers,
                self.num_threads,
                self.num_threads_reduce,
            )
            return
        for name, kind in zip(self.metric_names, self.metric_types, strict=True):
            path = f"{self.save_path}/{name}/"
            (self._reduce_single if kind == SINGLE else self._reduce_accumulate)(name, path)

    def run_map_reduce(self, comm_group=None) -> None:
        """Map on every rank (each its ``worker_id``), reduce on worker 0, between barriers."""
        import torch.distributed as dist

        self.run_map()
        dist.barrier(group=comm_group)
        if self.worker_id == 0:
            self.run_reduce()
        dist.barrier(group=comm_group)
