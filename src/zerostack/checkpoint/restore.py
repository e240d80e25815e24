"""Loading a checkpoint (the format is :mod:`.state`'s): the manifest, the checked reads, and
filling an engine of any ZeRO stage / dp / tp / pp layout from them.

A rank reads only the tensors that overlap its own slices (:class:`_Reader`), checks each one's
sha256, and copies the overlap; a tp split other than the saved one goes through the whole
parameter. A failure on any rank fails every rank with the same error.
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict

import torch

from ..moe.utils import EXPERTS, global_names
from ..tensor_parallel import partition_spec, split_tensor
from ..zero.init import GatheredParameters
from .client_state import from_manifest as client_state_of
from .deepspeed_layout import state_dict_order
from .deepspeed_pipe import PipelineReader, layer_files
from .deepspeed_read import DeepSpeedReader, is_deepspeed_folder, zero_files
from .deepspeed_read0 import Zero0Reader
from .deepspeed_tp import TensorParallelReader, mp_ranks
from .deepspeed_universal import LATEST_UNIVERSAL, UniversalReader, is_universal_folder
from .errors import CheckpointError
from .reader import ShardReader as _Reader
from .state import (
    FORMAT,
    LATEST,
    MANIFEST,
    _full_shape,
    _gather_errors,
)

log = logging.getLogger("zerostack")


def tag_folder(load_dir: str, tag=None, universal: bool = False) -> str:
    """The folder of ``tag`` (None: the one ``latest`` names; with ``universal``, or where
    there is no ``latest``, the one DeepSpeed's ``latest_universal`` names if there is one)
    under ``load_dir``."""
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        other = os.path.join(load_dir, LATEST_UNIVERSAL)
        if os.path.exists(other) and (universal or not os.path.exists(latest)):
            latest = other
        if not os.path.exists(latest):
            raise CheckpointError(f"{latest}: no such file (no complete checkpoint; pass tag=)")
        tag = open(latest).read().strip()
    return os.path.join(load_dir, str(tag))


def read_manifest(load_dir: str, tag=None) -> tuple[str, dict]:
    folder = tag_folder(load_dir, tag)
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing (not a complete checkpoint)")
    manifest = json.loads(open(path).read())
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return folder, manifest


def open_reader(load_dir: str, tag=None, gas: int = 1, groups=None, universal: bool = False):
    """``(folder, reader)`` of the checkpoint ``tag`` (None: ``latest``'s) in ``load_dir``:
    zerostack's own, or a folder DeepSpeed wrote (:mod:`.deepspeed_read`), read alike;
    ``gas``: the accumulation steps of the run loading it (DeepSpeed counts no micro-steps);
    ``groups``: its trained parameters' names per optimizer group (DeepSpeed's stage 0 files
    do not name them); ``universal``: DeepSpeed's ``checkpoint.load_universal`` (``tag`` None:
    ``latest_universal``'s where there is one)."""
    folder = tag_folder(load_dir, tag, universal)
    if is_universal_folder(folder):
        return folder, UniversalReader(folder, gas)
    if is_deepspeed_folder(folder):
        return folder, open_deepspeed(folder, gas, groups)
    folder, manifest = read_manifest(load_dir, tag)
    return folder, _Reader(folder, manifest)


def open_deepspeed(folder: str, gas: int = 1, groups: list[list[str]] | None = None):
    """The reader of DeepSpeed's tag ``folder``: a pipeline's (layer files), ZeRO stages 1-3
    (its optimizer-state files), or stage 0 (the optimizer inside the model-states file, paired
    with ``groups``)."""
    if layer_files(folder):
        return PipelineReader(folder, gas)
    if len(mp_ranks(folder)) > 1:
        return TensorParallelReader(folder, gas)
    if zero_files(folder):
        return DeepSpeedReader(folder, gas)
    return Zero0Reader(folder, gas, groups)


def load(run, load_dir: str, tag=None, custom_load_fn=None, **options):
    """Load a checkpoint into ``run`` (any ZeRO stage, dp size); returns (path, client_state),
    or (None, None) when ``tag`` is None and ``load_dir`` has no ``latest`` file (as DeepSpeed).

    ``options``: ``load_module_strict``, ``load_optimizer_states``, ``load_lr_scheduler_states``,
    ``load_module_only`` (DeepSpeed's, all as :meth:`Engine.load_checkpoint` documents). Every
    rank reads what it needs; if any rank finds a damaged or missing file, every rank raises the
    same error (naming the file) rather than some waiting on the others.
    """
    universal = run.config.checkpoint.load_universal
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if universal and os.path.isfile(os.path.join(load_dir, LATEST_UNIVERSAL)):
            latest = os.path.join(load_dir, LATEST_UNIVERSAL)
        missing = _gather_errors(run.comm, None if os.path.isfile(latest) else "missing")
        if len(missing) == run.world_size:
            if run.global_rank == 0:
                log.warning(
                    "Unable to find latest file at %s, if trying to load latest checkpoint please "
                    "ensure this file exists or pass an explicit checkpoint tag when loading a "
                    "checkpoint.",
                    latest,
                )
            return None, None
        if missing:
            raise CheckpointError(f"{latest}: missing on ranks {[r for r, _ in missing]} only")
    try:
        (folder, client_state, reader), error = _load(run, load_dir, tag, **options), None
    except CheckpointError as exc:
        error = str(exc)
    errors = _gather_errors(run.comm, error)
    if errors:
        raise CheckpointError(errors[0][1])
    if custom_load_fn is not None:
        _custom_load(run, reader, custom_load_fn)
    run.zero.after_load()  # the masters into the compute-dtype parameters (a collective)
    return folder, client_state


def _module_state(run, reader: _Reader) -> dict[str, torch.Tensor]:
    """The checkpoint's weights and buffers as this rank's module holds them (its tp slices,
    whole over dp, its experts under their local index), fp32 for parameters, under every name
    ``module.state_dict()`` uses. Parameters another pipeline stage holds come whole, under
    their own names; experts another ep rank holds are left out."""
    tp, tp_rank, ep = run.topology.tp, run.topology.rank("tp"), run.topology.ep
    saved, aliases = reader.manifest["params"], reader.manifest["aliases"]
    named = global_names(run.module, run.topology.rank("ep"))  # experts: global index
    ours = {name: p for p, name in named.items()}
    local = {named[p]: n for n, p in run.module.named_parameters()}  # global -> the module's
    out: dict[str, torch.Tensor] = {}
    for name in saved:
        if ep > 1 and EXPERTS in name and name not in ours:
            continue  # another ep rank's expert
        t = reader.full(name)
        spec = partition_spec(ours[name]) if name in ours else None
        if spec is not None and tp > 1:
            t = split_tensor(t, parts=tp, rank=tp_rank, dim=spec[0], chunks=spec[1])
        out[local.get(name, name)] = t
    for alias, name in aliases.items():
        if (key := local.get(name, name)) in out:
            out[alias] = out[key]
    for name, file in reader.buffers.items():
        out[name] = reader.get(file, f"buffer/{name}")
    return out


def _custom_load(run, reader: _Reader, fn) -> None:
    """DeepSpeed's ``custom_load_fn(src=state_dict, dst=module)`` in place of loading the
    weights: run with the module's parameters whole (gathered at stage 3), then what it left in
    them becomes the masters (trained parameters) and the held values (frozen ones). With
    experts over ep ranks, ``src`` holds this rank's experts, under the names its module uses."""
    src = _module_state(run, reader)
    params = list(run.module.parameters())
    trained = [p for p in params if run.zero.is_trained(p)]
    with GatheredParameters(params):  # stage 3 (a collective); nothing to do at stages 0-2
        fn(src=src, dst=run.module)
        for p in trained:
            run.full_params.set_local(p, p.detach().reshape(-1).float())
        for p, lo, hi, held in run.zero.frozen_slices():
            if hi > lo:
                held.copy_(p.detach().reshape(-1)[lo:hi])


def _load(
    run,
    load_dir: str,
    tag,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
):
    every = global_names(run.module, run.topology.rank("ep"))  # experts: global index
    groups = [[every[p] for p in ps] for ps in run.zero.group_params()]
    gas = run.config["gradient_accumulation_steps"]
    universal = run.config.checkpoint.load_universal
    folder, reader = open_reader(load_dir, tag, gas=gas, groups=groups, universal=universal)
    manifest = reader.manifest
    saved = manifest["params"]
    # Parameters the checkpoint left out on purpose (frozen, exclude_frozen_parameters) keep the
    # model's values; with load_module_strict=False so do those it simply lacks.
    kept = set(manifest.get("excluded", []))
    tp, tp_rank = run.topology.tp, run.topology.rank("tp")
    for name in every.values():
        if name in saved or name in kept:
            continue
        if load_module_strict:
            raise CheckpointError(f"{folder}: no parameter {name!r} in the checkpoint")
        kept.add(name)
    names = {p: n for p, n in every.items() if n not in kept}
    for p, name in names.items():
        if _full_shape(p, tp) != saved[name]:
            raise CheckpointError(
                f"{folder}: {name} has shape {saved[name]} in the checkpoint, "
                f"{_full_shape(p, tp)} in the model"
            )
    if run.topology.pp == 1 and load_module_strict:  # with a pipeline, others hold the rest
        ours = set(every.values())
        for name in saved:
            if run.topology.ep > 1 and EXPERTS in name:
                continue  # the other ep ranks' experts
            if name not in ours:
                raise CheckpointError(f"{folder}: the checkpoint has {name!r}, the model does not")
    saved_tp = reader.saved_tp
    opt = run.optimizer
    with_state = load_optimizer_states and not load_module_only and opt is not None
    keys = reader.kinds()

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
    for p, lo, hi, master, a, _ in run.zero.owned_slices():
        if hi > lo and p in names:
            owned[master].append((p, lo, hi, a))
    for master in run.zero.masters():  # one at a time: on NVMe, read, filled, written back
        # the moments its parameters have (Muon's groups keep one, its Adam half's two)
        held = [k for k in kinds if any(reader.has(names[p], k) for p, *_ in owned[master])]
        values = run.zero.read_master(master, opt, held)
        for p, lo, hi, a in owned[master]:
            for kind in ["master", *held]:
                read(values[kind], p, kind, lo, hi, a)
        run.zero.write_master(master, opt, values)
    for p, lo, hi, held in run.zero.frozen_slices():  # frozen: into what they hold, in place
        if hi > lo and p in names:
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
                        opt.state[m]["step"] = _step_tensor(saved_g["step"], opt.state[m], g, m)
    persistent = set(state_dict_order(run.module))  # a non-persistent buffer (Llama's
    for name, buf in run.module.named_buffers():  # rotary inv_freq) is rebuilt, not saved
        if name not in reader.buffers:
            if not load_module_strict or name not in persistent:
                continue
            raise CheckpointError(f"{folder}: no buffer {name!r} in the checkpoint")
        buf.data.copy_(reader.get(reader.buffers[name], f"buffer/{name}"))
    if not load_module_only:
        run.state.load_state_dict(manifest)  # counters, loss scaler, the loader's place
        run.comm.log.step = run.global_steps  # CommLog steps continue from here
        if load_lr_scheduler_states and run.lr_scheduler is not None:
            run.lr_scheduler.load_state_dict(manifest["lr_scheduler"])
        if manifest["layout"]["world_size"] == run.world_size:  # the same ranks: their RNG
            mine = f"rank{run.global_rank:05d}.safetensors"
            torch.set_rng_state(reader.get(mine, "rng/cpu"))
            if run.device.type == "cuda" and "rng/cuda" in reader.sha[mine]:
                torch.cuda.set_rng_state(reader.get(mine, "rng/cuda"))
            from ..tensor_parallel import get_rng_tracker

            tracker = {
                k.split("/", 2)[2]: reader.get(mine, k)
                for k in reader.sha[mine]
                if k.startswith("rng/tracker/")
            }
            if tracker:
                get_rng_tracker().set_states(tracker)
    pickled = run.config.checkpoint.pickled_client_state
    client_state = client_state_of(folder, manifest, pickled)
    return folder, client_state, reader


def _step_tensor(step, state: dict, group: dict, master: torch.Tensor) -> torch.Tensor:
    """The optimizer's ``step`` as it keeps it: like the step tensor it has, else on the
    master's device for torch's fused or capturable Adam (their kernels take it there), else
    an fp32 host scalar (torch's default)."""
    have = state.get("step")
    if torch.is_tensor(have):
        return torch.tensor(step, dtype=have.dtype, device=have.device)
    on_device = group.get("fused") or group.get("capturable")
    return torch.tensor(step, dtype=torch.float32, device=master.device if on_device else "cpu")
