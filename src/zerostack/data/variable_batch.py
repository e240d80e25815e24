"""Variable batch size and learning rate: DeepSpeed's dynamic batching
(``data_efficiency.data_sampling.dynamic_batching``), as plain functions over sample lengths.

Samples of different lengths are packed into micro-batches of at most ``max_tokens`` tokens, so a
micro-batch holds many short samples or a few long ones. Every ``effective_batch_size``
consecutive micro-batches make one optimizer step's batch (one micro-batch per data loader and
accumulation step), and that step's learning rate is scaled by how many samples its batch holds
(:func:`scale_lr`), since a batch of 12 samples and one of 3 deserve different steps::

    loader, scheduler, _ = get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset, seqlens, max_tokens=4096, effective_batch_size=8, dataloader_batch_size=2,
        dataloader_rank=rank, dataloader_num_replicas=2, lr_scheduler_or_optimizer=optimizer)
    for epoch in range(epochs):
        scheduler.step(0)            # back to the first batch's learning rate
        for batch in loader: ...     # the optimizer steps after every 4 of them here

The results (micro-batch sample ids, batch sizes, batch max lengths, the learning rate of every
step) are DeepSpeed 0.19.8's, checked against it in tests/golden/variable_batch.json. That
includes three habits of its packing worth knowing:

* the last sample in picking order is never packed (batch ends are tried up to, not including,
  the end of the list);
* packing stops at the first position where no valid micro-batch fits (``min_batch_size``
  samples would exceed ``max_tokens``): the samples after it are left out;
* packed micro-batches beyond a multiple of ``effective_batch_size`` are left out, so every data
  loader gets as many.

The DeepSpeed entry point that reads these settings from an engine's config is
``deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr``.
"""

from __future__ import annotations

import logging
import math
import random
import re
import warnings

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, DistributedSampler

log = logging.getLogger("zerostack")

PICKING_ORDERS = ("dataloader", "seqlen", "random")
"""Orders samples are packed in: the dataset's, by (length, id) ascending, shuffled with
``random.Random(seed)``."""


def batch_by_seqlens(
    seqlens,
    max_tokens,
    sequence_ids_per_mb=None,
    min_batch_size=1,
    max_batch_size=None,
    sequence_picking_order="dataloader",
    effective_batch_size=1,
    required_microbatches_of_same_size=False,
    verbose=False,
    seed=None,
):
    """Pack samples into micro-batches of at most ``max_tokens`` tokens.

    ``seqlens``: every sample's length (non-negative); ``sequence_ids_per_mb``: the sample ids to
    use (None: all). A micro-batch holds ``min_batch_size`` to ``max_batch_size`` samples (None
    or 0: no bound). Each pack takes as many samples as fit. With
    ``required_microbatches_of_same_size`` (a pipeline's schedule needs it), the
    ``effective_batch_size`` micro-batches of a batch are packed together and hold as many
    samples each, dealt out in turn (sample k to micro-batch k mod effective_batch_size).
    Samples longer than ``max_tokens`` are left out with a warning.

    Returns ``(microbatch_ids, batch_sizes, batch_max_seqlens)``: ``(batch id, [sample ids])``
    per micro-batch, then per batch (``effective_batch_size`` micro-batches) its number of
    samples and its longest sample. Raises ValueError when fewer than ``effective_batch_size``
    micro-batches can be packed."""
    if sequence_picking_order not in PICKING_ORDERS:
        raise ValueError(
            f"sequence_picking_order: {sequence_picking_order!r} is not one of "
            f"{', '.join(PICKING_ORDERS)}"
        )
    if effective_batch_size < 1:
        raise ValueError(f"effective_batch_size: must be at least 1, got {effective_batch_size}")
    pairs = _in_picking_order(seqlens, sequence_ids_per_mb, sequence_picking_order, seed)
    pairs = _without_too_long(pairs, max_tokens)
    group = effective_batch_size if required_microbatches_of_same_size else 1
    microbatches = _pack(pairs, max_tokens, min_batch_size, max_batch_size, group)
    if len(microbatches) < effective_batch_size:
        raise ValueError(
            f"batch_by_seqlens: the {len(pairs)} samples within max_tokens make "
            f"{len(microbatches)} micro-batches, fewer than effective_batch_size="
            f"{effective_batch_size} (one per "
            f"data loader and accumulation step); pass more samples, raise max_tokens or lower "
            f"min_batch_size"
        )
    microbatches = microbatches[: len(microbatches) - len(microbatches) % effective_batch_size]

    microbatch_ids, batch_sizes, batch_max_seqlens = [], [], []
    for batch_id, start in enumerate(range(0, len(microbatches), effective_batch_size)):
        batch = microbatches[start : start + effective_batch_size]
        microbatch_ids += [(batch_id, [i for _, i in mb]) for mb in batch]
        batch_sizes.append(sum(len(mb) for mb in batch))
        batch_max_seqlens.append(max(n for mb in batch for n, _ in mb))
        if verbose:
            log.info(
                "dynamic batching: batch %d: %d samples in %d micro-batches; samples per "
                "micro-batch %s, tokens per micro-batch %s, sample ids %s, lengths %s",
                batch_id,
                batch_sizes[-1],
                len(batch),
                [len(mb) for mb in batch],
                [sum(n for n, _ in mb) for mb in batch],
                [[i for _, i in mb] for mb in batch],
                [[n for n, _ in mb] for mb in batch],
            )
    return microbatch_ids, batch_sizes, batch_max_seqlens


def _in_picking_order(seqlens, ids, order: str, seed) -> list[tuple]:
    """``(length, sample id)`` of each sample used, in the order they are packed."""
    ids = range(len(seqlens)) if ids is None else ids
    pairs = [(seqlens[i], i) for i in ids]
    if order == "random":
        random.Random(seed).shuffle(pairs)
    elif order == "seqlen":
        pairs.sort()
    return pairs


def _without_too_long(pairs: list[tuple], max_tokens) -> list[tuple]:
    """``pairs`` less the samples that alone exceed ``max_tokens`` (they could never be packed)."""
    too_long = [i for n, i in pairs if n > max_tokens]
    if not too_long:
        return pairs
    kept = [(n, i) for n, i in pairs if not n > max_tokens]
    log.warning(
        "dynamic batching: samples %s are longer than max_tokens=%s and are left out "
        "(%d of %d samples kept)",
        too_long,
        max_tokens,
        len(kept),
        len(pairs),
    )
    return kept


def _pack(pairs, max_tokens, min_size, max_size, group: int) -> list[list[tuple]]:
    """Micro-batches, ``group`` at a time: each group takes the longest run of samples whose
    ``group`` interleaved micro-batches are all valid; packing ends at a run that has none."""
    microbatches, start = [], 0
    while start < len(pairs):
        end = _longest_valid_end(pairs, start, max_tokens, min_size, max_size, group)
        if end == start:
            break
        microbatches += [pairs[start + b : end : group] for b in range(group)]
        start = end
    return microbatches


def _longest_valid_end(pairs, start: int, max_tokens, min_size, max_size, group: int) -> int:
    """The furthest ``end`` (a multiple of ``group`` past ``start``, below ``len(pairs)``) at
    which each micro-batch ``pairs[start + b : end : group]`` holds ``min_size`` to
    ``max_size`` samples and at most ``max_tokens`` tokens; ``start`` when there is none.

    Growing ``end`` adds one sample to each micro-batch, so sizes and token sums only grow: the
    walk stops at the first end past a bound."""
    best, tokens = start, [0] * group
    for end in range(start + group, len(pairs), group):
        for b in range(group):
            tokens[b] += pairs[end - group + b][0]
        size = (end - start) // group
        if any(t > max_tokens for t in tokens) or (max_size and size > max_size):
            break
        if not min_size or size >= min_size:
            best = end
    return best


def scale_lr(base_batch_size, batch_size, base_lr=1, method="linear"):
    """The learning rate for ``batch_size`` when ``base_lr`` suits ``base_batch_size``.

    ``"linear"``: in proportion to the batch size (Goyal et al., 2017); ``"sqrt"``: to its
    square root, which keeps the gradient's variance (Krizhevsky, 2014); None or ``"none"``
    (any case): unchanged. ``scale_lr(4, 8, 0.1)`` is 0.2."""
    if method == "linear":
        return base_lr * batch_size / base_batch_size
    if method == "sqrt":
        return base_lr * math.sqrt(batch_size / base_batch_size)
    if method is None or (isinstance(method, str) and method.lower() == "none"):
        return base_lr
    raise ValueError(f"lr_scaling_method: {method!r} is not one of linear, sqrt, none")


class _LoadMicroBatches:
    """The variable-batch loader's ``collate_fn``: loads the samples of the micro-batches it is
    handed, pads each to its batch's longest sample where micro-batches must be the same shape,
    and gives them all, in order, to the user's ``collate_fn`` (a list without one). A class
    rather than a closure so worker processes can unpickle it."""

    def __init__(self, dataset, batch_max_seqlens, same_seqlen, padding_fn, collate_fn) -> None:
        if same_seqlen and padding_fn is None:
            raise ValueError(
                "sample_padding_fn: required when required_microbatches_of_same_seqlen is true "
                "(it pads a sample to its batch's longest: sample_padding_fn(sample, length))"
            )
        self.dataset, self.batch_max_seqlens = dataset, batch_max_seqlens
        self.same_seqlen, self.padding_fn, self.collate_fn = same_seqlen, padding_fn, collate_fn

    def __call__(self, microbatches):
        samples = []
        for batch_id, ids in microbatches:
            loaded = [self.dataset[i] for i in ids]
            if self.same_seqlen:
                length = self.batch_max_seqlens[batch_id]
                for i, sample in zip(ids, loaded, strict=True):
                    if len(sample) > length:  # len() of the sample itself, as DeepSpeed checks
                        raise ValueError(
                            f"sample {i}: length {len(sample)} exceeds batch {batch_id}'s "
                            f"longest sample, {length}: the dataset and its seqlens disagree"
                        )
                loaded = [self.padding_fn(sample, length) for sample in loaded]
            samples += loaded
        return self.collate_fn(samples) if self.collate_fn else samples


def dataloader_for_variable_batch_size(
    dataset,
    microbatch_ids,
    batch_max_seqlens,
    dataloader_rank=0,
    dataloader_batch_size=1,
    dataloader_num_replicas=1,
    dataloader_collate_fn=None,
    dataloader_num_workers=2,
    dataloader_pin_memory=False,
    required_microbatches_of_same_seqlen=False,
    sample_padding_fn=None,
):
    """A DataLoader over this replica's micro-batches, and the same as ``deepspeed_io`` keyword
    arguments: ``(loader, kwargs)``.

    The replicas take the micro-batches in turn (micro-batch k to replica k mod replicas, no
    shuffling: a ``DistributedSampler`` over the ids); each item the loader yields is
    ``dataloader_batch_size`` micro-batches' samples, collated (see :class:`_LoadMicroBatches`).
    """
    sampler = DistributedSampler(
        microbatch_ids,
        num_replicas=dataloader_num_replicas,
        rank=dataloader_rank,
        shuffle=False,
        drop_last=False,
    )
    collate = _LoadMicroBatches(
        dataset,
        batch_max_seqlens,
        required_microbatches_of_same_seqlen,
        sample_padding_fn,
        dataloader_collate_fn,
    )
    loader = DataLoader(
        microbatch_ids,
        batch_size=dataloader_batch_size,
        sampler=sampler,
        num_workers=dataloader_num_workers,
        collate_fn=collate,
        pin_memory=dataloader_pin_memory,
    )
    io_kwargs = dict(
        dataset=microbatch_ids,
        batch_size=dataloader_batch_size,
        pin_memory=dataloader_pin_memory,
        data_sampler=sampler,
        collate_fn=collate,
        num_local_io_workers=dataloader_num_workers,
    )
    return loader, io_kwargs


_MEANT = (
    "To get the last learning rate",
    "The epoch parameter in `scheduler.step()`",
    "Detected call of `lr_scheduler.step()` before `optimizer.step()`",
)


def _quietly(call, *args):
    """``call(*args)`` without torch's warnings about what is meant here: the base's
    ``get_lr()`` read outside its ``step``, ``step(epoch)`` (how a reset is asked for), and the
    first step (setting the first batch's rate) before the optimizer's."""
    with warnings.catch_warnings():
        for message in _MEANT:
            warnings.filterwarnings("ignore", re.escape(message))
        return call(*args)


class VariableBatchSizeLR(LRScheduler):
    """A learning-rate schedule that scales another's by each step's batch size.

    ``lr_scheduler`` (a torch or DeepSpeed-style scheduler) keeps computing the unscaled rate;
    after each of its steps the optimizer's rate becomes ``scale_lr(base_batch_size, size,
    rate, lr_scaling_method)`` for the next batch's ``size`` (``batch_sizes`` cycled over).
    ``step()`` moves to the next batch, ``step(0)`` back to the first (call it at each epoch's
    start: the loader starts again too). ``get_last_lr()`` is the base's unscaled rate,
    ``get_lr()`` the optimizer's scaled one."""

    def __init__(
        self,
        lr_scheduler,
        base_batch_size,
        batch_sizes,
        dataloader,
        lr_scaling_method="linear",
        last_epoch=-1,
        verbose=False,
    ) -> None:
        # LRScheduler.__init__ is not called: the base scheduler owns the optimizer's schedule
        self.base_lr_scheduler = lr_scheduler
        self.base_batch_size, self.batch_sizes = base_batch_size, batch_sizes
        self.lr_scaling_method, self.dataloader = lr_scaling_method, dataloader
        self.base_lrs = _quietly(lr_scheduler.get_lr)  # the rates step(0) starts again from
        self.last_epoch, self.verbose = last_epoch, verbose
        self.step(0)

    @property
    def optimizer(self) -> Optimizer:
        return self.base_lr_scheduler.optimizer

    def get_last_lr(self) -> list[float]:
        return self.base_lr_scheduler.get_last_lr()

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def step(self, epoch=None) -> None:
        """Set the learning rate of the next batch (``epoch``: of batch ``epoch``; 0 restarts).

        The base steps from its own unscaled rate (a chainable schedule such as StepLR
        multiplies the rate it finds), so that rate is put back first."""
        unscaled = self.base_lrs if epoch == 0 else self.get_last_lr()
        groups = self.optimizer.param_groups
        for group, lr in zip(groups, unscaled, strict=False):  # groups past the list keep theirs
            group["lr"] = lr
        _quietly(self.base_lr_scheduler.step, epoch)
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        size = self.batch_sizes[self.last_epoch % len(self.batch_sizes)]
        for group in groups:
            group["lr"] = scale_lr(self.base_batch_size, size, group["lr"], self.lr_scaling_method)
        if self.verbose:
            log.info(
                "dynamic batching: batch %d: %d samples (base %d), learning rate %s -> %s",
                self.last_epoch,
                size,
                self.base_batch_size,
                list(unscaled),
                self.get_lr(),
            )

    _SAVED = (
        "base_batch_size",
        "lr_scaling_method",
        "batch_sizes",
        "base_lrs",
        "last_epoch",
        "verbose",
    )

    def state_dict(self) -> dict:
        """The base scheduler's state and this one's batch sizes, rates and position."""
        state = {name: getattr(self, name) for name in self._SAVED}
        return {"base_lr_scheduler": self.base_lr_scheduler.state_dict(), **state}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict` (the optimizer's own state holds the current rates)."""
        self.base_lr_scheduler.load_state_dict(state_dict["base_lr_scheduler"])
        for name in self._SAVED:
            setattr(self, name, state_dict[name])


class _UnchangedLR(LRScheduler):
    """The base schedule when there is none: the optimizer's rates, constant."""

    def get_lr(self) -> list[float]:
        return list(self.base_lrs)


def lr_scheduler_for_variable_batch_size(
    base_batch_size,
    batch_sizes,
    dataloader,
    lr_scheduler_or_optimizer,
    lr_scaling_method="linear",
    verbose=False,
):
    """A :class:`VariableBatchSizeLR` over a scheduler, or over an optimizer's constant rates.

    ``base_batch_size``: the batch size the unscaled rates are meant for; ``batch_sizes``: each
    batch's size (from :func:`batch_by_seqlens`)."""
    if isinstance(lr_scheduler_or_optimizer, Optimizer):
        base = _UnchangedLR(lr_scheduler_or_optimizer)
    elif hasattr(lr_scheduler_or_optimizer, "optimizer"):
        base = lr_scheduler_or_optimizer
        if not isinstance(base.optimizer, Optimizer):
            raise ValueError(
                f"lr_scheduler_or_optimizer: the scheduler's optimizer is a "
                f"{type(base.optimizer).__name__}, not a torch.optim.Optimizer"
            )
    else:
        raise ValueError(
            f"lr_scheduler_or_optimizer: expected a torch.optim.Optimizer or a scheduler with "
            f"an .optimizer, got {type(lr_scheduler_or_optimizer).__name__}"
        )
    return VariableBatchSizeLR(
        base, base_batch_size, batch_sizes, dataloader, lr_scaling_method, verbose=verbose
    )


def get_dataloader_and_lr_scheduler_for_variable_batch_size(
    dataset,
    dataset_seqlens,
    max_tokens,
    effective_batch_size,
    dataset_filter_ids=None,
    lr_scaling_method="linear",
    min_batch_size=1,
    max_batch_size=None,
    sequence_picking_order="dataloader",
    dataloader_batch_size=1,
    dataloader_rank=0,
    dataloader_num_replicas=1,
    dataloader_num_workers=0,
    dataloader_collate_fn=None,
    dataloader_pin_memory=False,
    lr_scheduler_or_optimizer=None,
    required_microbatches_of_same_size=False,
    required_microbatches_of_same_seqlen=False,
    sample_padding_fn=None,
    verbose=False,
    seed=None,
):
    """``(loader, scheduler, deepspeed_io_kwargs)`` for packed batches: :func:`batch_by_seqlens`,
    then :func:`dataloader_for_variable_batch_size` and
    :func:`lr_scheduler_for_variable_batch_size` over its results. ``effective_batch_size`` is
    the train batch size in micro-batches (micro-batches per loader item x accumulation steps x
    replicas), and the batch size the unscaled learning rate is meant for."""
    microbatch_ids, batch_sizes, batch_max_seqlens = batch_by_seqlens(
        dataset_seqlens,
        max_tokens,
        dataset_filter_ids,
        min_batch_size,
        max_batch_size,
        sequence_picking_order,
        effective_batch_size,
        required_microbatches_of_same_size,
        verbose,
        seed,
    )
    loader, io_kwargs = dataloader_for_variable_batch_size(
        dataset,
        microbatch_ids,
        batch_max_seqlens,
        dataloader_rank,
        dataloader_batch_size,
        dataloader_num_replicas,
        dataloader_collate_fn,
        dataloader_num_workers,
        dataloader_pin_memory,
        required_microbatches_of_same_seqlen,
        sample_padding_fn,
    )
    scheduler = lr_scheduler_for_variable_batch_size(
        effective_batch_size,
        batch_sizes,
        loader,
        lr_scheduler_or_optimizer,
        lr_scaling_method,
        verbose,
    )
    return loader, scheduler, io_kwargs


__all__ = [
    "batch_by_seqlens",
    "dataloader_for_variable_batch_size",
    "get_dataloader_and_lr_scheduler_for_variable_batch_size",
    "lr_scheduler_for_variable_batch_size",
    "scale_lr",
    "VariableBatchSizeLR",
]
