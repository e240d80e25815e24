"""Sharded checkpoints: every rank writes its own slices, a manifest says where everything is.

A tag folder holds one safetensors file per rank and ``manifest.json``::

    global_step40/
      manifest.json           layout, counters, loss scaler, LR schedule, optimizer groups,
                              data-loader position, and per file: size, and per tensor: sha256
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
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections import defaultdict

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from ..tensor_parallel import join_tensors, partition_spec, split_tensor

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


def _write_shard(engine, folder: str) -> dict:
    """This rank's tensors into its file; returns what the manifest records about it."""
    names = {p: n for n, p in engine.module.named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    slices = []
    topo = engine.topology
    # Copies held elsewhere too are written once: tp replicas by tp rank 0, a tied weight by the
    # first pipeline stage that holds it (the parameters the gradient norm skips).
    elsewhere = engine.replicated_elsewhere()
    if engine.zero.owns_replica:
        held: tuple = (None, {})  # a master's value and state, read once (from its file on NVMe)
        for p, lo, hi, master, a, b in engine.zero.owned_slices():
            if hi <= lo or p in elsewhere:
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
        "params": {n: _full_shape(p, topo.tp) for n, p in engine.module.named_parameters()},
        "specs": {
            n: list(partition_spec(p))
            for n, p in engine.module.named_parameters()
            if partition_spec(p) is not None
        },
    }


def _key(name: str, tp_rank: int | None, lo: int) -> str:
    return f"{name}@{lo}" if tp_rank is None else f"{name}#tp{tp_rank}@{lo}"


def _full_shape(p: torch.Tensor, tp: int) -> list[int]:
    shape = list(p._zs.shape if hasattr(p, "_zs") else p.shape)
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


def save(engine, save_dir: str, tag=None, client_state=None, save_latest: bool = True) -> str:
    """Write a checkpoint of ``engine`` (a collective: every rank calls it); returns its path."""
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
        record, error = _write_shard(engine, folder), None
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
    for rec in records:
        params.update(rec.pop("params"))
        specs.update(rec.pop("specs"))
    canonical = {id(p): n for n, p in engine.module.named_parameters()}
    aliases = {  # a tied weight under its other names, for a plain load_state_dict
        n: canonical[id(t)]
        for n, t in engine.module.state_dict(keep_vars=True).items()
        if id(t) in canonical and canonical[id(t)] != n
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


class _Reader:
    """Reads and checks tensors of one checkpoint folder, a file opened once."""

    def __init__(self, folder: str, manifest: dict) -> None:
        self.folder, self.manifest = folder, manifest
        self.sha = {rec["file"]: rec["sha256"] for rec in manifest["files"]}
        self._open: dict[str, object] = {}
        for rec in manifest["files"]:
            path = os.path.join(folder, rec["file"])
            if not os.path.exists(path):
                raise CheckpointError(f"{path}: missing shard")
            if os.path.getsize(path) != rec["bytes"]:
                raise CheckpointError(
                    f"{path}: {os.path.getsize(path)} bytes, the manifest "
                    f"says {rec['bytes']} (truncated or damaged)"
                )

        self.saved_tp = manifest["layout"]["tp"]
        self.specs = manifest.get("tp_specs", {})
        self.index: dict[str, list[tuple[int | None, int, int, str]]] = defaultdict(list)
        for rec in manifest["files"]:
            for name, tp_rank, lo, hi in rec["slices"]:
                self.index[name].append((tp_rank, lo, hi, rec["file"]))
        self.buffers = {  # buffer name -> the file holding it
            k[len("buffer/") :]: rec["file"]
            for rec in manifest["files"]
            for k in rec["sha256"]
            if k.startswith("buffer/")
        }

    def fill(self, dest, name: str, kind: str, tp_rank, lo: int, hi: int, offset: int) -> int:
        """Copy elements ``[lo, hi)`` of ``name``'s saved ``kind`` (the slice written by tp rank
        ``tp_rank``; None for a whole parameter) to ``dest[offset:]``; returns how many."""
        covered = 0
        for src_tp, slo, shi, file in self.index[name]:
            x, y = max(lo, slo), min(hi, shi)
            if src_tp != tp_rank or x >= y:
                continue
            src = self.get(file, f"{kind}/{_key(name, src_tp, slo)}")
            dest[offset + x - lo : offset + y - lo].copy_(src[x - slo : y - slo])
            covered += y - x
        return covered

    def full(self, name: str, kind: str = "master") -> torch.Tensor:
        """The whole saved parameter (fp32), its tp slices joined: one parameter in memory."""
        shape, spec = self.manifest["params"][name], self.specs.get(name)
        part = list(shape)
        if spec is not None:
            part[spec[0]] //= self.saved_tp
        parts = []
        for r in [None] if spec is None else range(self.saved_tp):
            t = torch.zeros(math.prod(part))
            covered = self.fill(t, name, kind, r, 0, t.numel(), 0)
            if covered != t.numel():
                raise CheckpointError(
                    f"{self.folder}: {name}: slices cover {covered} of {t.numel()} elements"
                )
            parts.append(t.view(part))
        return parts[0] if spec is None else join_tensors(parts, dim=spec[0], chunks=spec[1])

    def get(self, file: str, key: str) -> torch.Tensor:
        path = os.path.join(self.folder, file)
        try:
            if file not in self._open:
                self._open[file] = safe_open(path, framework="pt")
            t = self._open[file].get_tensor(key)
        except Exception as exc:  # a damaged header or body
            raise CheckpointError(f"{path}: cannot read {key} ({exc})") from None
        if _sha256(t) != self.sha[file].get(key):
            raise CheckpointError(f"{path}: checksum mismatch in {key}")
        return t


def read_manifest(load_dir: str, tag=None) -> tuple[str, dict]:
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.exists(latest):
            raise CheckpointError(f"{latest}: no such file (no complete checkpoint; pass tag=)")
        tag = open(latest).read().strip()
    folder = os.path.join(load_dir, str(tag))
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing (not a complete checkpoint)")
    manifest = json.loads(open(path).read())
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return folder, manifest


def load(engine, load_dir: str, tag=None, **options):
    """Load a checkpoint into ``engine`` (any ZeRO stage, dp size); returns (path, client_state).

    ``options``: ``load_optimizer_states``, ``load_lr_scheduler_states``, ``load_module_only``
    (DeepSpeed's, all as :meth:`Engine.load_checkpoint` documents). Every rank reads what it needs;
    if any rank finds a damaged or missing file, every rank raises the same error (naming the
    file) rather than some waiting on the others.
    """
    try:
        result, error = _load(engine, load_dir, tag, **options), None
    except CheckpointError as exc:
        result, error = None, str(exc)
    errors = _gather_errors(engine.comm, error)
    if errors:
        raise CheckpointError(errors[0][1])
    engine.zero.after_load()  # the masters into the compute-dtype parameters (a collective)
    return result


def _load(
    engine,
    load_dir: str,
    tag,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
):
    folder, manifest = read_manifest(load_dir, tag)
    reader = _Reader(folder, manifest)
    names = {p: n for n, p in engine.module.named_parameters()}
    saved = manifest["params"]
    tp, tp_rank = engine.topology.tp, engine.topology.rank("tp")
    for p, name in names.items():
        if name not in saved:
            raise CheckpointError(f"{folder}: no parameter {name!r} in the checkpoint")
        if _full_shape(p, tp) != saved[name]:
            raise CheckpointError(
                f"{folder}: {name} has shape {saved[name]} in the checkpoint, "
                f"{_full_shape(p, tp)} in the model"
            )
    if engine.topology.pp == 1:  # with a pipeline, the other stages hold the rest
        for name in saved:
            if name not in names.values():
                raise CheckpointError(f"{folder}: the checkpoint has {name!r}, the model does not")
    saved_tp = reader.saved_tp
    opt = engine.optimizer
    with_state = load_optimizer_states and not load_module_only
    keys = sorted(
        {k.split("/")[0] for rec in manifest["files"] for k in rec["sha256"]}
        - {"master", "rng", "buffer"}
    )

    def read(dest, p, kind: str, lo: int, hi: int, a: int) -> None:
        """Elements ``[lo, hi)`` of ``p``'s saved ``kind`` (this rank's tp slice) to ``dest[a:]``;
        every element of a value must be there (a moment may be missing: it stays zero)."""
        name, saved_spec, spec = names[p], reader.specs.get(names[p]), partition_spec(p)
        spec = list(spec) if spec is not None else None
        if saved_spec is None and spec is None:  # whole then and now
            covered = reader.fill(dest, name, kind, None, lo, hi, a)
        elif saved_spec == spec and saved_tp == tp:  # cut the same way: this rank's slices
            covered = reader.fill(dest, name, kind, tp_rank, lo, hi, a)
        else:  # cut otherwise: through the whole parameter, cut as this model cuts it
            full = reader.full(name, kind)
            if spec is not None:
                full = split_tensor(full, parts=tp, rank=tp_rank, dim=spec[0], chunks=spec[1])
            dest[a : a + hi - lo].copy_(full.reshape(-1)[lo:hi])
            covered = hi - lo
        if kind == "master" and covered != hi - lo:
            raise CheckpointError(
                f"{folder}: {name}: slices cover {covered} of elements [{lo}, {hi}) of its value"
            )

    kinds = keys if with_state else []
    owned = defaultdict(list)
    for p, lo, hi, master, a, _ in engine.zero.owned_slices():
        if hi > lo:
            owned[master].append((p, lo, hi, a))
    for master in engine.zero.masters():  # one at a time: on NVMe, read, filled, written back
        values = engine.zero.read_master(master, opt, kinds)
        for p, lo, hi, a in owned[master]:
            for kind in ["master", *kinds]:
                read(values[kind], p, kind, lo, hi, a)
        engine.zero.write_master(master, opt, values)
    for p, lo, hi, held in engine.zero.frozen_slices():  # frozen: into what they hold, in place
        if hi > lo:
            read(held, p, "master", lo, hi, 0)
    if with_state:
        for g, saved_g in zip(opt.param_groups, manifest["optimizer_groups"], strict=True):
            for k, v in saved_g["hyper"].items():
                if k in g and not isinstance(g[k], (list, tuple)):
                    g[k] = v
                elif k in g:
                    g[k] = type(g[k])(v)
            if saved_g["step"] is not None:
                for m in g["params"]:
                    if m in opt.state:
                        opt.state[m]["step"] = torch.tensor(saved_g["step"], dtype=torch.float32)
    for name, buf in engine.module.named_buffers():
        if name not in reader.buffers:
            raise CheckpointError(f"{folder}: no buffer {name!r} in the checkpoint")
        buf.data.copy_(reader.get(reader.buffers[name], f"buffer/{name}"))
    if not load_module_only:
        c = manifest["counters"]
        engine.load_training_state(c)
        engine.loss_scaler.load_state_dict(manifest["loss_scaler"])
        sampler = _sampler(engine)
        if sampler is not None and manifest.get("data_sampler") is not None:
            sampler.load_state_dict(manifest["data_sampler"])  # the next iter() continues there
            engine.set_dataloader(engine.training_dataloader)  # train_batch's iterator too
        if load_lr_scheduler_states and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(manifest["lr_scheduler"])
        if manifest["layout"]["world_size"] == engine.world_size:  # the same ranks: their RNG
            mine = f"rank{engine.global_rank:05d}.safetensors"
            torch.set_rng_state(reader.get(mine, "rng/cpu"))
            from ..tensor_parallel import get_rng_tracker

            tracker = {
                k.split("/", 2)[2]: reader.get(mine, k)
                for k in reader.sha[mine]
                if k.startswith("rng/tracker/")
            }
            if tracker:
                get_rng_tracker().set_states(tracker)
    return folder, manifest["client_state"]
