"""Sharded checkpoints: every rank writes its own slices, a manifest says where everything is.

A tag folder holds one safetensors file per rank and ``manifest.json``::

    global_step40/
      manifest.json           layout, counters, loss scaler, LR schedule, optimizer groups,
                              data-loader position, frozen parameters left out (``excluded``,
                              exclude_frozen_parameters) and those written (``frozen``), and
                              per file: size, per tensor: sha256
      rank00000.safetensors   master/<name>@<lo>, exp_avg/<name>@<lo>, ... rng/cpu, buffer/...

A tensor ``<kind>/<name>@<lo>`` holds elements ``[lo, hi)`` of parameter ``name`` flattened (its
fp32 master value or an optimizer moment; a frozen parameter has a master value only, the fp32 of
what it holds, so it may be frozen or trained on load alike), so a checkpoint is independent of
the ZeRO stage and dp size that wrote it: a rank of any other layout reads just the tensors that
overlap its own slices, checks their sha256, and copies the overlap. Writes go to
``.<tag>.incomplete`` and are renamed into place only when every rank has finished; ``latest`` is
replaced after that, so an interrupted save leaves the previous checkpoint as it was; a failed
write on any rank (a full disk, an I/O error) makes every rank raise, and the incomplete folder is
removed. Nothing is unpickled: tensors come from safetensors, everything else from JSON (client
state too, unless the config opts in to pickling what JSON cannot hold: :mod:`.client_state`).

A rank's file is streamed (:mod:`.stream`): its header is planned first, then one master
(sub-group) at a time is read, from memory or its NVMe file, written and let go, so a save holds
about one sub-group in host memory beyond what training holds, whatever the offload.

This module holds the format's names and helpers and the writing side (:func:`save`);
:mod:`.restore` reads a checkpoint back (:func:`~.restore.load`).
"""

from __future__ import annotations

import json
import os
import shutil

import torch.distributed as dist

from ..config.load import given_config
from ..moe.utils import global_names
from . import client_state as client
from . import deepspeed_layout, deepspeed_write
from .errors import CheckpointError
from .reader import ShardReader
from .shard import (
    collect_shard,
    full_shape_of,
    key_of,
    tracker_states,
    write_file,
    write_shard,
)
from .stream import sha256

FORMAT = "zerostack-checkpoint/1"
MANIFEST = "manifest.json"
LATEST = "latest"


_sha256 = sha256  # the per-tensor checksum the manifest records (restore checks it)


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
    """``text`` to ``path`` whole or not at all (a full disk leaves ``path`` as it was)."""

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    _atomic_replace(path, write)


def _atomic_replace(path: str, write) -> None:
    """``write(tmp)`` a file beside ``path``, then rename it into place (no half-written file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# The shard's parts (:mod:`.shard`), under the names the restore and async-save modules import.
_key, _full_shape, _tracker_states = key_of, full_shape_of, tracker_states
_write_shard, _collect_shard, _write_file = write_shard, collect_shard, write_file


def save(
    run,
    save_dir: str,
    tag=None,
    client_state=None,
    save_latest: bool = True,
    exclude_frozen: bool = False,
) -> str:
    """Write a checkpoint of ``run`` (a collective: every rank calls it); returns its path.
    ``exclude_frozen``: leave out the parameters with ``requires_grad=False`` (the manifest
    lists them under ``excluded``; a load keeps the model's values for them)."""
    tag = str(tag) if tag is not None else f"global_step{run.global_steps}"
    given_state = client_state
    client_state, client_payload = split_client_state(run, client_state)
    final = os.path.join(save_dir, tag)
    folder = os.path.join(save_dir, f".{tag}.incomplete")
    rank = run.global_rank
    client_record = None
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        client_record = client.write(folder, client_payload)
    _barrier(run.comm)
    try:
        record, error = _write_shard(run, folder, exclude_frozen), None
        _atomic_write(os.path.join(folder, f"rank{rank:05d}.json"), json.dumps(record))
    except Exception as exc:  # every rank learns of it below, then all raise
        error = f"{type(exc).__name__}: {exc}"
    _fail_together(run, error, folder, final)
    error = None
    if rank == 0:  # the manifest, then the rename, then latest: each step atomic
        try:
            _write_manifest(run, folder, tag, client_state, client_record)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    if deepspeed_layout.wanted(run):  # DeepSpeed's files, from the shards written
        _fail_together(run, error, folder, final)
        error = _deepspeed_files(run, folder, save_dir, given_state, exclude_frozen)
    if rank == 0 and error is None:
        try:
            _publish(folder, final, tag, save_dir if save_latest else None)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    _fail_together(run, error, folder, final)  # rank 0's failure ends every rank, no barrier
    return final


def _deepspeed_files(run, folder: str, save_dir: str, client_state, exclude_frozen) -> str | None:
    """Every rank writes DeepSpeed's files of its dp rank (:mod:`.deepspeed_write`); rank 0
    adds their sha256 to the manifest and places ``zero_to_fp32.py``. Returns this rank's
    error (None: none)."""
    try:
        manifest = json.loads(open(os.path.join(folder, MANIFEST)).read())
        reader = ShardReader(folder, manifest)
        layout = deepspeed_layout.layout_of_run(run, manifest)
        rank = run.topology.data_parallel_rank  # DeepSpeed's dp rank (over ep's too)
        mine = deepspeed_write.write(
            layout,
            folder,
            rank,
            manifest,
            reader,
            run.module.state_dict,
            client_state,
            exclude_frozen,
        )
        error = None
    except Exception as exc:
        mine, error = {}, f"{type(exc).__name__}: {exc}"
    everyone = _gather_dicts(run.comm, mine)
    if run.global_rank == 0 and error is None:
        try:
            manifest["deepspeed_files"] = {k: v for d in everyone for k, v in sorted(d.items())}
            _atomic_write(os.path.join(folder, MANIFEST), json.dumps(manifest, indent=1))
            deepspeed_write.place_script(save_dir)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    return error


def _gather_dicts(comm, mine: dict) -> list[dict]:
    """Every rank's ``mine`` (JSON), on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    return [json.loads(t) for t in comm.all_gather_strings(json.dumps(mine))]


def _fail_together(run, error: str | None, folder: str, final: str) -> None:
    """Every rank raises if any rank failed (an all-gather of the errors: no rank is left in a
    collective the failing one never reaches); rank 0 removes the incomplete folder first, so a
    full disk gets its space back. ``latest`` still names the previous checkpoint."""
    errors = _gather_errors(run.comm, error)
    if not errors:
        return
    if run.global_rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    listed = "; ".join(f"rank {r}: {e}" for r, e in errors)
    raise CheckpointError(f"{final}: not saved ({listed}); latest is unchanged")


def split_client_state(run, client_state) -> tuple[object, client.Payload]:
    """``client_state`` as JSON with markers, and its tensors (and, where the config opts in,
    pickled values: :mod:`.client_state`); every rank checks it, so a bad value raises
    everywhere before anything is written."""
    pickled = run.config.checkpoint.pickled_client_state
    try:
        return client.split({} if client_state is None else client_state, pickled)
    except client.ClientStateError as exc:
        raise CheckpointError(str(exc)) from None


def _write_manifest(run, folder: str, tag: str, client_state, client_record=None) -> None:
    """Rank 0, once every shard is written: the manifest from every rank's record."""
    records = [
        json.loads(open(os.path.join(folder, f"rank{r:05d}.json")).read())
        for r in range(run.world_size)
    ]
    manifest = _manifest(run, tag, records, client_state, client_record)
    _atomic_write(os.path.join(folder, MANIFEST), json.dumps(manifest, indent=1))
    for r in range(run.world_size):
        os.remove(os.path.join(folder, f"rank{r:05d}.json"))


def _publish(folder: str, final: str, tag: str, latest_dir) -> None:
    """Rank 0, once the folder is complete: renamed into place, and ``latest`` (in
    ``latest_dir``; None leaves it) replaced."""
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(folder, final)
    if latest_dir is not None:
        _atomic_write(os.path.join(latest_dir, LATEST), tag)


def merge_records(records: list[dict]) -> dict:
    """What every rank's record says of the parameters, taken out of the records for the
    manifest: full shapes (tp slices joined) and how each tp-split parameter is cut (with a
    pipeline, each stage knows only its own parameters), the frozen parameters left out
    (``excluded``, exclude_frozen_parameters) and those written (``frozen``)."""
    params: dict[str, list[int]] = {}
    specs: dict[str, list[int]] = {}
    excluded: set[str] = set()
    frozen: set[str] = set()
    for rec in records:
        params.update(rec.pop("params"))
        specs.update(rec.pop("specs"))
        excluded.update(rec.pop("excluded"))
        frozen.update(rec.pop("frozen"))
    return {
        "params": params,
        "excluded": sorted(excluded),
        "frozen": sorted(frozen),
        "tp_specs": specs,
    }


def _manifest(run, tag: str, records: list[dict], client_state, client_record=None) -> dict:
    topo, zero_cfg = run.topology, run.config.zero_optimization
    groups = []
    every = global_names(run.module, topo.rank("ep"))
    # each group's trained parameters by name, where rank 0 knows them all (no pp or ep)
    members = (
        [[every[p] for p in ps] for ps in run.zero.group_params()]
        if (run.optimizer is not None and topo.pp == 1 and topo.ep == 1)
        else None
    )
    for i, g in enumerate(run.optimizer_groups()):  # none for a forward-only engine
        step = None
        for m in g["params"]:
            s = run.optimizer.state.get(m, {}).get("step")
            if s is not None:
                step = float(s)
                break
        hyper = {k: v for k, v in g.items() if k != "params"}
        groups.append(
            {
                "hyper": json.loads(json.dumps(hyper, default=list)),
                "step": step,
                "params": members[i] if members is not None else None,
            }
        )
    merged = merge_records(records)
    excluded = set(merged["excluded"])
    canonical = {id(p): n for n, p in run.module.named_parameters()}
    aliases = {  # a tied weight under its other names, for a plain load_state_dict
        n: canonical[id(t)]
        for n, t in run.module.state_dict(keep_vars=True).items()
        if id(t) in canonical and canonical[id(t)] != n and canonical[id(t)] not in excluded
    }
    return {
        "format": FORMAT,
        "tag": tag,
        "aliases": aliases,
        "layout": {
            "world_size": run.world_size,
            "dp": topo.dp,
            "sp": topo.sp,
            "ep": topo.ep,
            "tp": topo.tp,
            "pp": topo.pp,
            "zero_stage": zero_cfg.stage,
            "precision": run.precision.name,
        },
        **merged,
        # counters, loss scaler, and where the engine's data loader is: epoch and samples handed
        # out in it (rank 0's)
        **run.state.state_dict(),
        "lr_scheduler": (run.lr_scheduler.state_dict() if run.lr_scheduler is not None else None),
        "optimizer_groups": groups,
        "files": records,
        "client_state": client_state,
        "client_tensors": client_record,
        "ds_config": json.loads(json.dumps(given_config(run.config), default=repr)),
        "state_dict_order": deepspeed_layout.state_dict_order(run.module),
    }
