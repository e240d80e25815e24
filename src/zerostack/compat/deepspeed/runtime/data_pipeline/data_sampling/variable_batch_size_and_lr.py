"""``deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr``: dynamic batching
at DeepSpeed's path. The functions are :mod:`zerostack.data.variable_batch`'s; this module adds
the entry point that takes its settings from an engine, as DeepSpeedExamples' variable batch
size example calls it::

    engine, *_ = deepspeed.initialize(model=model, config=config)   # dynamic_batching enabled
    loader, scheduler, _ = get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        dataset, engine, dataset_seqlens=[len(s) for s in dataset],
        dataloader_collate_fn=collate, sample_padding_fn=pad)
    engine.lr_scheduler = scheduler   # engine.step() then steps it
"""

from __future__ import annotations

import os

import numpy as np
import torch

from zerostack.data.variable_batch import (
    VariableBatchSizeLR,
    batch_by_seqlens,
    dataloader_for_variable_batch_size,
    get_dataloader_and_lr_scheduler_for_variable_batch_size,
    lr_scheduler_for_variable_batch_size,
    scale_lr,
)

_BLOCK = "data_efficiency.data_sampling.dynamic_batching"
_DEFAULTS = {  # DeepSpeed's, for keys a config block leaves out
    "enabled": False,
    "lr_scaling_method": "linear",
    "min_batch_size": 1,
    "max_batch_size": None,
    "max_tokens": None,
    "sequence_picking_order": "dataloader",
    "verbose": False,
    "metrics_path": None,
}


def _plain(block) -> dict:
    """A config block as a dict (a pydantic model's fields, a mapping's items, None: empty)."""
    if block is None:
        return {}
    if hasattr(block, "model_dump"):
        return block.model_dump()
    return dict(block)


def _batching(engine) -> dict:
    """The engine's dynamic-batching settings, one flat dict: ``dynamic_batching``'s keys, with
    ``data_sampling``'s ``num_workers`` and ``pin_memory`` and ``data_efficiency``'s ``seed``
    beside them (DeepSpeed's defaults for what the config leaves out)."""
    config = engine.config
    block = getattr(config, "data_efficiency", None)
    if block is None and hasattr(config, "get"):
        block = config.get("data_efficiency")
    efficiency = _plain(block)
    sampling = _plain(efficiency.get("data_sampling"))
    settings = {**_DEFAULTS, **_plain(sampling.get("dynamic_batching"))}
    settings["num_workers"] = sampling.get("num_workers", 0)
    settings["pin_memory"] = sampling.get("pin_memory", False)
    settings["seed"] = efficiency.get("seed", 1234)
    return settings


def _seqlens(dataset, metrics_path, collate_fn, batch_seqlens_fn, engine) -> list[int]:
    """Each sample's length: from the metrics files, else measured (rank 0 writes the files)."""
    from zerostack.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder

    prefix = os.path.join(metrics_path or "", "seqlen", "seqlen_sample_to_metric")
    if metrics_path is not None and MMapIndexedDataset.exists(prefix):
        lengths = [int(x) for item in MMapIndexedDataset(prefix, skip_warmup=True) for x in item]
        if len(lengths) != len(dataset):
            raise ValueError(
                f"{prefix}: {len(lengths)} sample lengths for a dataset of {len(dataset)}; "
                "delete the metrics_path folder if the dataset changed"
            )
        return lengths
    if batch_seqlens_fn is None:
        raise ValueError(
            "batch_seqlens_fn: needed to measure the sample lengths (no dataset_seqlens, and no "
            f"{prefix}.idx / .bin)"
        )
    lengths = _measured(dataset, collate_fn, batch_seqlens_fn)
    if metrics_path is not None and engine.global_rank == 0:
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.int64)
        for n in lengths:
            builder.add_item(torch.tensor([n], dtype=torch.int64))
        builder.end_document()
        builder.finalize(prefix + ".idx")
    return lengths


def _measured(dataset, collate_fn, batch_seqlens_fn, batch: int = 1024) -> list[int]:
    """``batch_seqlens_fn`` over the dataset collated in batches, in order: one length each."""
    out: list[int] = []
    for lo in range(0, len(dataset), batch):
        samples = [dataset[i] for i in range(lo, min(lo + batch, len(dataset)))]
        found = batch_seqlens_fn(collate_fn(samples) if collate_fn else samples)
        out += [int(n) for n in torch.as_tensor(found).reshape(-1).tolist()]
    if len(out) != len(dataset):
        raise ValueError(
            f"batch_seqlens_fn gave {len(out)} lengths for {len(dataset)} samples (one each)"
        )
    return out


def get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
    dataset,
    engine,
    dataset_seqlens=None,
    dataset_filter_ids=None,
    dataloader_collate_fn=None,
    sample_padding_fn=None,
    batch_seqlens_fn=None,
):
    """``(loader, scheduler, deepspeed_io_kwargs)`` for ``engine``, its config's
    ``data_efficiency.data_sampling.dynamic_batching`` settings and its batch sizes.

    The train batch size is the effective batch size (in micro-batches, and the size the
    unscaled learning rate suits), the micro-batch size the loader's items; this rank reads
    its data-parallel replica's share. The rates come from the engine's scheduler, else its
    optimizer's constant ones. Under a pipeline, the micro-batches of a batch hold as many
    samples each and are padded to one length with ``sample_padding_fn``.

    Without ``dataset_seqlens`` (each sample's length), the lengths are read from
    ``{metrics_path}/seqlen/seqlen_sample_to_metric`` (an indexed dataset, as DeepSpeed's
    DataAnalyzer writes it), or, when those files are not there, measured with
    ``batch_seqlens_fn`` on the collated dataset (:func:`_measured`), as DeepSpeed's
    DataAnalyzer measures them, and written there for the next run."""
    settings = _batching(engine)
    if not settings["enabled"]:
        raise ValueError(
            f"get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed: {_BLOCK}"
            f".enabled is false"
        )
    if settings["max_tokens"] is None:
        raise ValueError(f"{_BLOCK}.max_tokens: must be given when dynamic batching is enabled")
    if dataset_seqlens is None:
        dataset_seqlens = _seqlens(
            dataset, settings["metrics_path"], dataloader_collate_fn, batch_seqlens_fn, engine
        )
    topo = engine.topology
    pipelined = getattr(engine.runner, "pipelined", False)
    loader, scheduler, io_kwargs = get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset=dataset,
        dataset_seqlens=dataset_seqlens,
        max_tokens=settings["max_tokens"],
        effective_batch_size=engine.train_batch_size(),
        dataset_filter_ids=dataset_filter_ids,
        lr_scaling_method=settings["lr_scaling_method"],
        min_batch_size=settings["min_batch_size"],
        max_batch_size=settings["max_batch_size"],
        sequence_picking_order=settings["sequence_picking_order"],
        dataloader_batch_size=engine.train_micro_batch_size_per_gpu(),
        # the replicas that read different batches (the sp ranks of one batch read the same)
        dataloader_rank=topo.data_parallel_rank,
        dataloader_num_replicas=topo.data_parallel_size,
        dataloader_num_workers=settings["num_workers"],
        dataloader_collate_fn=dataloader_collate_fn,
        dataloader_pin_memory=settings["pin_memory"],
        lr_scheduler_or_optimizer=engine.lr_scheduler or engine.optimizer,
        required_microbatches_of_same_size=pipelined,
        required_microbatches_of_same_seqlen=pipelined,
        sample_padding_fn=sample_padding_fn,
        verbose=settings["verbose"],
        seed=settings["seed"],
    )
    return loader, scheduler, io_kwargs


__all__ = [
    "VariableBatchSizeLR",
    "batch_by_seqlens",
    "dataloader_for_variable_batch_size",
    "get_dataloader_and_lr_scheduler_for_variable_batch_size",
    "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed",
    "lr_scheduler_for_variable_batch_size",
    "scale_lr",
]
