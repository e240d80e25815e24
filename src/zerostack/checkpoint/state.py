"""Sharded checkpoints: every rank writes its own slices, a manifest says where everything is.

A tag folder holds one safetensors file per rank and ``manifest.json``::

    global_step40/
      manifest.json           layout, counters, loss scaler, LR schedule, optimizer groups,
                              data-loader position, frozen parameters left out (``excluded``,
                              exclude_frozen_parameters), and per file: size, per tensor: sha256
      rank00000.safetensors   master/<name>@<lo>, exp_avg/<name>@<lo>, ... rng/cpu, buffer/...

A tensor ``<kind>/<name>@<lo>`` holds elements ``[lo, hi)`` of parameter ``name`` flattened (its
fp32 master value or an optimizer moment; a frozen parameter has a master value only, the fp32 of
what it holds, so it may be frozen or trained on load alike), so a checkpoint is independent of
the ZeRO stage and dp size that wrote it: a rank of any other layout reads just the tensors that
overlap its own slices, checks their sha256, and copies the overlap. Writes go to
``.<tag>.incomplete`` and are renamed into place only when every rank has finished; ``latest`` is
replaced after that, so an interrupted save leaves the previous checkpoint as it was. Nothing is
unpickled: tensors come from safetensors, everything else from JSON (client state must be
JSON-serialisable).

This module holds the format's names and helpers and the writing side (:func:`save`);
:mod:`.restore` reads a checkpoint back (:func:`~.restore.load`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from ..tensor_parallel import partition_spec
from ..zero.init import full_shape

FORMAT = "zerostack-checkpoint/1"
MANIFEST = "manifest.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded; the message names the file or key."""


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _gather_errors(comm, error: str | None) -> list[tuple[int, str]]:
    """Every rank's error as ``(rank, message)``: one failing rank fails them all, and none is
    left waiting in a collective the failing one never reaches."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [(0, error)] if error else []
    errors = comm.all_gather_strings(error or "")
    return [(r, e) for r, e in enumerate(errors) if e]


def _barrier(comm) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        comm.barrier(axis="world")


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_replace(path: str, write) -> None:
    """``write(tmp)`` a file beside ``path``, then rename it into place (no half-written file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _frozen_names(engine) -> set[str]:
    """Names of the parameters with ``requires_grad=False`` (``exclude_frozen_parameters``)."""
    return {n for n, p in engine.module.named_parameters() if not p.requires_grad}


def _write_shard(engine, folder: str, exclude_frozen: bool = False) -> dict:
    """This rank's tensors into its file; returns what the manifest records about it
    (``exclude_frozen``: parameters with ``requires_grad=False`` are left out, and listed)."""
    excluded = _frozen_names(engine) if exclude_frozen else set()
    names = {p: n for n, p in engine.module.named_parameters() if n not in excluded}
    tensors: dict[str, torch.Tensor] = {}
    slices = []
    topo = engine.topology
    # Copies held elsewhere too are written once: tp replicas by tp rank 0, a tied weight by the
    # first pipeline stage that holds it (the parameters the gradient norm skips).
    elsewhere = engine.replicated_elsewhere()
    if engine.zero.owns_replica:
        held: tuple = (None, {})  # a master's value and state, read once (from its file on NVMe)
        for p, lo, hi, master, a, b in engine.zero.owned_slices():
            if hi <= lo or p in elsewhere or p not in names:
                continue
            if held[0] is not master:
                held = master, engine.zero.read_master(master, engine.optimizer)
            tp_rank = topo.rank("tp") if partition_spec(p) is not None else None
            key = _key(names[p], tp_rank, lo)
            for k, v in held[1].items():  # "master" (fp32), then the optimizer's moments
                tensors[f"{k}/{key}"] = v[a:b].cpu().clone()
            slices.append([names[p], tp_rank, lo, hi])
    # Frozen parameters: their value as master slices (fp32 of what is held), no optimizer state.
    # dp rank r writes elements [r*c, (r+1)*c), c = ceil(n / dp): at stage 3 the piece it holds,
    # at stages 0-2 (all ranks hold the whole) the same cut, so a frozen base is written by all.
    dp, dp_rank = topo.dp, topo.rank("dp")
    for p, lo, hi, value in engine.zero.frozen_slices():
        c = max(1, -(-math.prod(_full_shape(p, 1)) // dp))
        x, y = max(lo, dp_rank * c), min(hi, (dp_rank + 1) * c)
        if x >= y or p in elsewhere:
            continue
        if p not in names:  # excluded (exclude_frozen_parameters)
            continue
        tp_rank = topo.rank("tp") if partition_spec(p) is not None else None
        key = _key(names[p], tp_rank, x)
        tensors[f"master/{key}"] = value[x - lo : y - lo].float().cpu().clone()
        slices.append([names[p], tp_rank, x, y])
    if topo.rank("dp") == 0 and topo.rank("tp") == 0:  # each stage's buffers, once
        for name, buf in engine.module.named_buffers():
            tensors[f"buffer/{name}"] = buf.detach().cpu().clone()
    tensors["rng/cpu"] = torch.get_rng_state()
    for k, v in _tracker_states().items():
        tensors[f"rng/tracker/{k}"] = v
    file = f"rank{engine.global_rank:05d}.safetensors"
    path = os.path.join(folder, file)
    save_file(tensors, path)
    return {
        "file": file,
        "bytes": os.path.getsize(path),
        "sha256": {k: _sha256(v) for k, v in tensors.items()},
        "slices": slices,
        "params": {n: _full_shape(p, topo.tp) for p, n in names.items()},
        "specs": {
            n: list(partition_spec(p)) for p, n in names.items() if partition_spec(p) is not None
        },
        "excluded": sorted(excluded),
    }


def _key(name: str, tp_rank: int | None, lo: int) -> str:
    return f"{name}@{lo}" if tp_rank is None else f"{name}#tp{tp_rank}@{lo}"


def _full_shape(p: torch.Tensor, tp: int) -> list[int]:
    shape = list(full_shape(p))
    spec = partition_spec(p)
    if spec is not None:
        shape[spec[0]] *= tp
    return shape


def _sampler(engine):
    """The sampler of the engine's own data loader (initialize's), if it keeps a position."""
    sampler = getattr(engine.training_dataloader, "sampler", None)
    return sampler if callable(getattr(sampler, "load_state_dict", None)) else None


def _tracker_states() -> dict[str, torch.Tensor]:
    from ..tensor_parallel import get_rng_tracker

    return get_rng_tracker().get_states()


def save(
    engine,
    save_dir: str,
    tag=None,
    client_state=None,
    save_latest: bool = True,
    exclude_frozen: bool = False,
) -> str:
    """Write a checkpoint of ``engine`` (a collective: every rank calls it); returns its path.
    ``exclude_frozen``: leave out the parameters with ``requires_grad=False`` (the manifest
    lists them under ``excluded``; a load keeps the model's values for them)."""
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    client_state = {} if client_state is None else client_state
    try:
        json.dumps(client_state)
    except TypeError as exc:
        raise CheckpointError(f"client_state: not JSON-serialisable ({exc})") from None
    final = os.path.join(save_dir, tag)
    folder = os.path.join(save_dir, f".{tag}.incomplete")
    rank = engine.global_rank
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
    _barrier(engine.comm)
    try:
        record, error = _write_shard(engine, folder, exclude_frozen), None
        _atomic_write(os.path.join(folder, f"rank{rank:05d}.json"), json.dumps(record))
    except Exception as exc:  # every rank learns of it below, then all raise
        error = f"{type(exc).__name__}: {exc}"
    errors = _gather_errors(engine.comm, error)
    if errors:
        listed = "; ".join(f"rank {r}: {e}" for r, e in errors)
        raise CheckpointError(f"{final}: not saved ({listed}); latest is unchanged")
    if rank == 0:
        records = [
            json.loads(open(os.path.join(folder, f"rank{r:05d}.json")).read())
            for r in range(engine.world_size)
        ]
        manifest = _manifest(engine, tag, records, client_state)
        _atomic_write(os.path.join(folder, MANIFEST), json.dumps(manifest, indent=1))
        for r in range(engine.world_size):
            os.remove(os.path.join(folder, f"rank{r:05d}.json"))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(folder, final)
        if save_latest:
            _atomic_write(os.path.join(save_dir, LATEST), tag)
    _barrier(engine.comm)
    return final


def _manifest(engine, tag: str, records: list[dict], client_state) -> dict:
    topo, zero_cfg = engine.topology, engine.config.zero_optimization
    groups = []
    for g in engine.optimizer.param_groups:
        step = None
        for m in g["params"]:
            s = engine.optimizer.state.get(m, {}).get("step")
            if s is not None:
                step = float(s)
                break
        hyper = {k: v for k, v in g.items() if k != "params"}
        groups.append({"hyper": json.loads(json.dumps(hyper, default=list)), "step": step})
    # Full shapes (tp slices joined) and how each tp-split parameter is cut, from every rank's
    # record (with a pipeline, each stage knows only its own parameters).
    params: dict[str, list[int]] = {}
    specs: dict[str, list[int]] = {}
    excluded: set[str] = set()
    for rec in records:
        params.update(rec.pop("params"))
        specs.update(rec.pop("specs"))
        excluded.update(rec.pop("excluded"))
    canonical = {id(p): n for n, p in engine.module.named_parameters()}
    aliases = {  # a tied weight under its other names, for a plain load_state_dict
        n: canonical[id(t)]
        for n, t in engine.module.state_dict(keep_vars=True).items()
        if id(t) in canonical and canonical[id(t)] != n and canonical[id(t)] not in excluded
    }
    return {
        "format": FORMAT,
        "tag": tag,
        "aliases": aliases,
        "layout": {
            "world_size": engine.world_size,
            "dp": topo.dp,
            "tp": topo.tp,
            "pp": topo.pp,
            "zero_stage": zero_cfg.stage,
            "precision": engine.precision.name,
        },
        "params": params,
        "excluded": sorted(excluded),  # frozen parameters left out (exclude_frozen_parameters)
        "tp_specs": specs,
        "counters": engine.training_state(),
        "loss_scaler": engine.loss_scaler.state_dict(),
        "lr_scheduler": (
            engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
        ),
        "optimizer_groups": groups,
        # where the engine's data loader is: epoch and samples handed out in it (rank 0's)
        "data_sampler": sampler.state_dict() if (sampler := _sampler(engine)) else None,
        "files": records,
        "client_state": client_state,
    }
