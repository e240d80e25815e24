"""``zerostack convert``: a checkpoint from one format to another, streamed tensor by tensor.

    zerostack convert ckpt out --to hf                   # Hugging Face safetensors (sharded)
    zerostack convert ds_ckpt out --to zerostack         # zerostack's own format
    zerostack convert ckpt out --to deepspeed [--world 8] [--stage 3] [--universal]
    zerostack convert ckpt out --to dcp                  # torch.distributed.checkpoint

The source is a checkpoint folder (the one holding ``latest``; ``--tag`` for another tag) that
zerostack or DeepSpeed wrote, read through :func:`~.restore.open_reader`: every tensor zerostack
wrote is checked against its sha256, DeepSpeed's pickles are read with the allow-list. No
process group is needed.

- ``hf``: the weights (fp32, or ``--dtype bf16``) and persistent buffers as ``model.safetensors``
  or, above ``--max-shard-size``, ``model-0000i-of-0000n.safetensors`` with
  ``model.safetensors.index.json``, as ``save_pretrained`` writes them (tied weights once).
- ``zerostack``: one file holding every parameter whole (fp32 master and optimizer moments),
  the buffers, and a manifest with the counters, LR schedule, optimizer groups, loss scale and
  client state: it loads on any layout as any zerostack checkpoint does.
- ``deepspeed``: DeepSpeed 0.19's files (:mod:`.deepspeed_write`) for ``--world`` data-parallel
  ranks at ZeRO ``--stage`` (default: the source's), ``latest`` and ``zero_to_fp32.py``; with
  ``--universal`` its universal checkpoint instead (:mod:`.deepspeed_universal`: the tag
  ``<tag>_universal``, named by ``latest_universal``).
- ``dcp``: ``model.<name>`` (fp32) and ``optimizer.state.<name>.<kind>`` tensors, written by
  ``torch.distributed.checkpoint.save`` with a planner that reads each tensor when the writer
  asks for it.

Memory: one parameter's fp32 state at a time for ``hf``, ``zerostack`` and ``dcp``; for
``deepspeed``, one output file (a rank's partition, or the model-states file) plus one
parameter. Files are written under temporary names and renamed into place; ``--to zerostack``
and ``deepspeed`` write the tag folder as ``.<tag>.incomplete`` and rename it when complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .errors import CheckpointError
from .restore import open_reader
from .stream import Entry, ShardWriter

TARGETS = ("hf", "zerostack", "deepspeed", "dcp")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Report:
    """What a conversion wrote: its path, bytes, tensors and seconds."""

    path: str
    bytes: int = 0
    tensors: int = 0
    seconds: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds else 0.0


class _Progress:
    """A tqdm bar over bytes written (none with ``show=False``)."""

    def __init__(self, total: int, show: bool, what: str) -> None:
        self.bar = None
        if show:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=what, dynamic_ncols=True)

    def add(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def convert(
    src: str,
    dst: str,
    to: str,
    *,
    tag=None,
    dtype: str = "fp32",
    max_shard_size: str | int = "5GB",
    world: int | None = None,
    stage: int | None = None,
    universal: bool = False,
    progress: bool = False,
) -> Report:
    """Convert the checkpoint ``tag`` (None: ``latest``'s) in ``src`` to format ``to`` in
    ``dst`` (a folder; created). Returns what was written."""
    if to not in TARGETS:
        raise ValueError(f"--to {to!r}: expected one of {', '.join(TARGETS)}")
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype {dtype!r}: expected one of {', '.join(_DTYPES)}")
    folder, reader = open_reader(src, tag)
    os.makedirs(dst, exist_ok=True)
    began = time.monotonic()
    write = {"hf": _to_hf, "zerostack": _to_zerostack, "deepspeed": _to_deepspeed, "dcp": _to_dcp}[
        to
    ]
    report = write(
        folder,
        reader,
        dst,
        dtype=_DTYPES[dtype],
        max_shard_size=_bytes(max_shard_size),
        world=world,
        stage=stage,
        universal=universal,
        progress=progress,
    )
    report.seconds = time.monotonic() - began
    return report


def _bytes(size: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or a number of bytes."""
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    for unit, factor in (
        ("GIB", 2**30),
        ("MIB", 2**20),
        ("KIB", 2**10),
        ("GB", 10**9),
        ("MB", 10**6),
        ("KB", 10**3),
        ("B", 1),
    ):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _params(reader) -> list[tuple[str, list[int]]]:
    return list(reader.manifest["params"].items())


# ---------------------------------------------------------------------------- Hugging Face
def _to_hf(folder, reader, dst, *, dtype, max_shard_size, progress, **_) -> Report:
    buffers = {n: reader.get(f, f"buffer/{n}") for n, f in sorted(reader.buffers.items())}
    entries = [Entry(n, dtype, tuple(s)) for n, s in _params(reader)]
    entries += [Entry(n, t.dtype, tuple(t.shape)) for n, t in buffers.items()]
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    n = len(shards)
    names = (
        ["model.safetensors"]
        if n == 1
        else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    total = sum(e.nbytes for e in entries)
    bar, report = _Progress(total, progress, "hf"), Report(dst)
    try:
        for name, shard in zip(names, shards, strict=True):
            path = os.path.join(dst, name)
            tmp = f"{path}.tmp{os.getpid()}"
            out = ShardWriter(tmp, shard, metadata={"format": "pt"})
            try:
                for e in shard:
                    t = buffers[e.key] if e.key in buffers else reader.full(e.key).to(dtype)
                    out.put(e.key, t)
                    bar.add(e.nbytes)
                    del t
                out.close()
            except BaseException:
                out.abort()
                os.remove(tmp)
                raise
            os.replace(tmp, path)
            report.bytes += os.path.getsize(path)
            report.tensors += len(shard)
    finally:
        bar.close()
    if n > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {e.key: name for name, s in zip(names, shards, strict=True) for e in s},
        }
        _text(os.path.join(dst, "model.safetensors.index.json"), json.dumps(index, indent=2))
    return report


def _text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- zerostack
def _to_zerostack(folder, reader, dst, *, progress, **_) -> Report:
    from . import client_state as client
    from .state import FORMAT, LATEST, MANIFEST, _atomic_write

    manifest = reader.manifest
    tag = os.path.basename(os.path.normpath(folder))
    final, work = os.path.join(dst, tag), os.path.join(dst, f".{tag}.incomplete")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    kinds, frozen = reader.kinds(), set(manifest.get("frozen", []))
    params = _params(reader)
    entries, plan = [], []
    for name, shape in params:
        numel = math.prod(shape)
        for kind in ["master"] + ([] if name in frozen else kinds):
            entries.append(Entry(f"{kind}/{name}@0", torch.float32, (numel,)))
            plan.append((kind, name))
    buffers = {n: reader.get(f, f"buffer/{n}") for n, f in sorted(reader.buffers.items())}
    entries += [Entry(f"buffer/{n}", t.dtype, tuple(t.shape)) for n, t in buffers.items()]
    file = "rank00000.safetensors"
    bar = _Progress(sum(e.nbytes for e in entries), progress, "zerostack")
    out = ShardWriter(os.path.join(work, file), entries)
    try:
        for kind, name in plan:
            t = reader.full(name, kind).reshape(-1)
            out.put(f"{kind}/{name}@0", t)
            bar.add(t.nbytes)
        for n, t in buffers.items():
            out.put(f"buffer/{n}", t)
        out.close()
    except BaseException:
        out.abort()
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        bar.close()
    state, payload = client.split(manifest.get("client_state") or {}, False)
    if manifest.get("client_tensors"):
        raise CheckpointError(f"{folder}: client-state tensors are not converted yet")
    layout = dict(manifest["layout"], world_size=0)  # no rank's RNG to restore
    result = {
        "format": FORMAT,
        "tag": tag,
        "aliases": manifest["aliases"],
        "layout": {
            "dp": 1,
            "sp": 1,
            "ep": 1,
            "tp": 1,
            "pp": 1,
            "zero_stage": 0,
            "precision": "fp32",
            **layout,
        },
        "params": dict(params),
        "excluded": manifest.get("excluded", []),
        "frozen": sorted(frozen),
        "tp_specs": {},
        "counters": manifest["counters"],
        "loss_scaler": manifest["loss_scaler"],
        "data_sampler": manifest.get("data_sampler"),
        "random_ltd": manifest.get("random_ltd"),
        "lr_scheduler": manifest["lr_scheduler"],
        "optimizer_groups": manifest["optimizer_groups"],
        "files": [
            {
                "file": file,
                "bytes": os.path.getsize(os.path.join(work, file)),
                "sha256": out.hashes,
                "slices": [[n, None, 0, math.prod(s)] for n, s in params],
            }
        ],
        "client_state": state,
        "client_tensors": client.write(work, payload),
        "ds_config": manifest.get("ds_config"),
        "state_dict_order": manifest.get("state_dict_order"),
    }
    _atomic_write(os.path.join(work, MANIFEST), json.dumps(result, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(work, final)
    _atomic_write(os.path.join(dst, LATEST), tag)
    return Report(final, result["files"][0]["bytes"], len(entries))


# ---------------------------------------------------------------------------- DeepSpeed
def _to_deepspeed(folder, reader, dst, *, world, stage, progress, universal=False, **_) -> Report:
    from . import deepspeed_write as dw
    from .deepspeed_layout import layout_of_checkpoint, module_from_checkpoint
    from .deepspeed_universal import LATEST_UNIVERSAL, write_universal
    from .state import LATEST, _atomic_write

    manifest = reader.manifest
    layout = layout_of_checkpoint(reader, dp=world, stage=stage)
    tag = os.path.basename(os.path.normpath(folder))
    if universal and not tag.endswith("_universal"):
        tag = f"{tag}_universal"  # as DeepSpeed's tutorials name ds_to_universal's output
    final, work = os.path.join(dst, tag), os.path.join(dst, f".{tag}.incomplete")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    bar = _Progress(layout.dp, progress, "deepspeed ranks")
    written: dict[str, str] = {}

    def module():  # built only where a model-states file is written (rank 0; each at ZeRO-3)
        return module_from_checkpoint(reader, layout)

    client = manifest.get("client_state") or {}
    try:
        if universal:
            written.update(write_universal(layout, work, manifest, reader, module, client))
        for rank in range(layout.dp if not universal else 0):
            written.update(dw.write(layout, work, rank, manifest, reader, module, client, False))
            bar.add(1)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        bar.close()
    shutil.rmtree(final, ignore_errors=True)
    os.replace(work, final)
    _atomic_write(os.path.join(dst, LATEST_UNIVERSAL if universal else LATEST), tag)
    if not universal:
        dw.place_script(dst)
    size = sum(os.path.getsize(os.path.join(final, f)) for f in written)
    return Report(final, size, len(written))


# ---------------------------------------------------------------------------- DCP
def _to_dcp(folder, reader, dst, *, progress, **_) -> Report:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    frozen, kinds = set(reader.manifest.get("frozen", [])), reader.kinds()
    where: dict[str, tuple[str, str]] = OrderedDict()  # DCP key -> (kind, parameter)
    for name, _ in _params(reader):
        where[f"model.{name}"] = ("master", name)
        if name not in frozen:
            for kind in kinds:
                where[f"optimizer.state.{name}.{kind}"] = (kind, name)
    shapes = reader.manifest["params"]
    placeholders = {k: torch.empty(shapes[n], device="meta") for k, (_, n) in where.items()}
    bar = _Progress(sum(math.prod(shapes[n]) * 4 for _, n in where.values()), progress, "dcp")

    class _Reading(DefaultSavePlanner):
        """Reads each tensor from the checkpoint when the writer asks for it."""

        def lookup_object(self, index):
            kind, name = where[index.fqn]
            t = reader.full(name, kind)
            bar.add(t.nbytes)
            return t

    tmp = os.path.join(dst, f".dcp.incomplete{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        # a file per tensor: DCP keeps every tensor of a file alive until the file is written
        writer = FileSystemWriter(tmp, single_file_per_rank=False, thread_count=1)
        dcp.save(placeholders, storage_writer=writer, planner=_Reading(), no_dist=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    for name in os.listdir(tmp):
        os.replace(os.path.join(tmp, name), os.path.join(dst, name))
    os.rmdir(tmp)
    size = sum(os.path.getsize(os.path.join(dst, f)) for f in os.listdir(dst))
    return Report(dst, size, len(where))


# ---------------------------------------------------------------------------- the command
def add_parser(sub) -> None:
    c = sub.add_parser(
        "convert",
        help="a checkpoint in another format: hf, zerostack, deepspeed, dcp",
        description="Convert a checkpoint zerostack or DeepSpeed wrote to Hugging Face "
        "safetensors, zerostack's format, DeepSpeed's files or torch DCP, tensor by tensor.",
    )
    c.add_argument("src", help="the checkpoint folder (holds 'latest')")
    c.add_argument("dst", help="the folder to write")
    c.add_argument("--to", required=True, choices=TARGETS)
    c.add_argument("--tag", default=None, help="a tag other than the latest")
    c.add_argument("--dtype", default="fp32", choices=sorted(_DTYPES), help="hf: the weights'")
    c.add_argument("--max-shard-size", default="5GB", help="hf: the largest file")
    c.add_argument("--world", type=int, default=None, help="deepspeed: dp ranks (the source's)")
    c.add_argument(
        "--stage",
        type=int,
        default=None,
        choices=[0, 1, 2, 3],
        help="deepspeed: the ZeRO stage (the source's)",
    )
    c.add_argument(
        "--universal",
        action="store_true",
        help="deepspeed: a universal checkpoint, as ds_to_universal writes",
    )
    c.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_command(args) -> int:
    report = convert(
        args.src,
        args.dst,
        args.to,
        tag=args.tag,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        world=args.world,
        stage=args.stage,
        universal=args.universal,
        progress=not args.no_progress,
    )
    print(
        f"wrote {report.tensors} tensors, {report.bytes / 1e9:.3f} GB to {report.path} in "
        f"{report.seconds:.1f} s ({report.gb_per_s:.2f} GB/s)"
    )
    return 0
