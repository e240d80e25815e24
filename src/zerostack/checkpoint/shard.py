"""What one rank writes into its checkpoint file: planned, then produced one master at a time.

:func:`plan` lists every tensor of the file (key, dtype, shape) from what each master holds,
without reading a value; :func:`produce` then yields the tensors in that order, reading one
master (a sub-group: its fp32 value and optimizer moments, from memory or its NVMe file) at a
time and letting it go before the next. :func:`write_shard` streams them into the file
(:class:`~.stream.ShardWriter`), so a save holds about one sub-group in host memory beyond what
training holds; :func:`collect_shard` keeps host copies of them all instead (an asynchronous
save's snapshot) and :func:`write_file` writes such a snapshot. Key names are :mod:`.state`'s.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..moe.utils import global_names
from ..tensor_parallel import partition_spec
from ..zero.partition import piece_numel
from ..zero.stage3.params import full_shape
from .stream import Entry, ShardWriter


def key_of(name: str, tp_rank: int | None, lo: int) -> str:
    """``<name>@<lo>``, or ``<name>#tp<r>@<lo>`` for tp rank r's slice of a split parameter."""
    return f"{name}@{lo}" if tp_rank is None else f"{name}#tp{tp_rank}@{lo}"


def full_shape_of(p: torch.Tensor, tp: int) -> list[int]:
    """The parameter's whole shape (its tp slices joined)."""
    shape = list(full_shape(p))
    spec = partition_spec(p)
    if spec is not None:
        shape[spec[0]] *= tp
    return shape


def tracker_states() -> dict[str, torch.Tensor]:
    from ..tensor_parallel import get_rng_tracker

    return get_rng_tracker().get_states()


def _frozen_names(run) -> set[str]:
    """Names of the parameters with ``requires_grad=False`` (``exclude_frozen_parameters``)."""
    return {n for n, p in run.module.named_parameters() if not p.requires_grad}


@dataclass
class Plan:
    """A rank's file before any value is read: its entries, in writing order, and the manifest's
    record of it (``meta``: slices, full shapes, tp specs, parameters left out)."""

    entries: list[Entry] = field(default_factory=list)
    owned: dict = field(default_factory=dict)  # master -> [(key, a, b)], in the order met
    kinds: dict = field(default_factory=dict)  # master -> [(kind, dtype)]: "master", moments
    frozen: dict = field(default_factory=dict)  # param -> (key, x, y)
    small: dict = field(default_factory=dict)  # buffers and RNG states, copied already
    meta: dict = field(default_factory=dict)


def plan(run, exclude_frozen: bool = False) -> Plan:
    """The tensors this rank writes (``exclude_frozen``: parameters with ``requires_grad=False``
    are left out, and listed)."""
    excluded = _frozen_names(run) if exclude_frozen else set()
    topo, zero, opt = run.topology, run.zero, run.optimizer
    every = global_names(run.module, topo.rank("ep"))  # experts by their global index
    names = {p: n for p, n in every.items() if n not in excluded}
    # Copies held elsewhere too are written once: tp replicas by tp rank 0, a tied weight by the
    # first pipeline stage that holds it (the parameters the gradient norm skips).
    elsewhere = run.replicated_elsewhere()

    def tp_rank(p):
        return topo.rank("tp") if partition_spec(p) is not None else None

    out, slices = Plan(), []
    if zero.owns_replica:
        for p, lo, hi, master, a, b in zero.owned_slices():
            if hi <= lo or p in elsewhere or p not in names:
                continue
            out.owned.setdefault(master, []).append((key_of(names[p], tp_rank(p), lo), a, b))
            slices.append([names[p], tp_rank(p), lo, hi])
    for m, cuts in out.owned.items():
        out.kinds[m] = zero.master_kinds(m, opt)  # nothing read: names and dtypes
        for key, a, b in cuts:
            out.entries += [Entry(f"{k}/{key}", dt, (b - a,)) for k, dt in out.kinds[m]]
    # Frozen parameters: their value as master slices (fp32 of what is held), no optimizer state.
    # dp rank r writes elements [r*c, (r+1)*c), c = piece_numel(n, dp): at stage 3 the piece it
    # holds, at stages 0-2 (all ranks hold the whole) the same cut, so a frozen base is written
    # by all.
    dp, dp_rank = topo.dp, topo.rank("dp")
    for p, lo, hi in zero.frozen_extents():
        c = piece_numel(math.prod(full_shape_of(p, 1)), dp)
        x, y = max(lo, dp_rank * c), min(hi, (dp_rank + 1) * c)
        if x >= y or p in elsewhere or p not in names:  # not names: exclude_frozen_parameters
            continue
        out.frozen[p] = (key_of(names[p], tp_rank(p), x), x, y)
        out.entries.append(Entry(f"master/{out.frozen[p][0]}", torch.float32, (y - x,)))
        slices.append([names[p], tp_rank(p), x, y])
    if topo.rank("dp") == 0 and topo.rank("tp") == 0:  # each stage's buffers, once
        for name, buf in run.module.named_buffers():
            out.small[f"buffer/{name}"] = buf.detach().cpu().clone()
    out.small["rng/cpu"] = torch.get_rng_state()
    if run.device.type == "cuda":  # the device's generator draws its dropout masks
        out.small["rng/cuda"] = torch.cuda.get_rng_state()
    for k, v in tracker_states().items():
        out.small[f"rng/tracker/{k}"] = v
    out.entries += [Entry(k, v.dtype, tuple(v.shape)) for k, v in out.small.items()]
    out.meta = {
        "slices": slices,
        "params": {n: full_shape_of(p, topo.tp) for p, n in names.items()},
        "specs": {
            n: list(partition_spec(p)) for p, n in names.items() if partition_spec(p) is not None
        },
        "excluded": sorted(excluded),
        "frozen": sorted(n for p, n in names.items() if not p.requires_grad),
    }
    return out


def produce(run, shard: Plan) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` in the plan's order; one master's values are alive at a time (a view
    of the live tensors in memory, or what was read from its NVMe file)."""
    zero, opt = run.zero, run.optimizer
    for m, cuts in shard.owned.items():
        values = zero.read_master(m, opt)
        for key, a, b in cuts:
            for k, _ in shard.kinds[m]:
                yield f"{k}/{key}", values[k][a:b]
        del values
    for p, lo, _, value in zero.frozen_slices(writes=False):  # one piece read in at a time
        if p in shard.frozen:
            key, x, y = shard.frozen[p]
            yield f"master/{key}", value[x - lo : y - lo].float()
    yield from shard.small.items()


def _file(folder: str, rank: int) -> tuple[str, str]:
    file = f"rank{rank:05d}.safetensors"
    return file, os.path.join(folder, file)


def _write(path: str, entries: list[Entry], tensors) -> dict[str, str]:
    out = ShardWriter(path, entries)
    try:
        for key, t in tensors:
            out.put(key, t)
        out.close()
    except BaseException:
        out.abort()
        raise
    return out.hashes


def write_shard(run, folder: str, exclude_frozen: bool = False) -> dict:
    """This rank's file, streamed; returns what the manifest records about it."""
    shard = plan(run, exclude_frozen)
    file, path = _file(folder, run.global_rank)
    hashes = _write(path, shard.entries, produce(run, shard))
    return {"file": file, "bytes": os.path.getsize(path), "sha256": hashes, **shard.meta}


def collect_shard(run, exclude_frozen: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """Host copies of every tensor this rank writes (a snapshot training may run on from), and
    the manifest's record of them (``meta``)."""
    shard = plan(run, exclude_frozen)
    tensors = {k: t.detach().to("cpu", copy=True) for k, t in produce(run, shard)}
    return tensors, shard.meta


def write_file(folder: str, rank: int, tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    """Write a :func:`collect_shard` snapshot as rank ``rank``'s file; returns its record."""
    file, path = _file(folder, rank)
    entries = [Entry(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    hashes = _write(path, entries, tensors.items())
    return {"file": file, "bytes": os.path.getsize(path), "sha256": hashes, **meta}
