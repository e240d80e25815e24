"""What DeepSpeed's checkpoint files of a run say besides the values (:class:`Layout`), from a
run being saved or from a checkpoint read back (``zerostack convert``), and whether a save writes
them at all (``checkpoint.deepspeed_files``: :func:`wanted`, :func:`refusal`). The files
themselves are :mod:`.deepspeed_write`'s.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..config.load import given_config, served_as_deepspeed
from .errors import CheckpointError

log = logging.getLogger("zerostack")


def refusal(cfg, topo, stage: int, model=None) -> str | None:
    """Why DeepSpeed's files cannot be written for this run (None: they can)."""
    zero, parts = cfg.zero_optimization, []
    sizes = {a: getattr(topo, a) for a in ("tp", "sp")}
    parts += [f"{a} {n}" for a, n in sizes.items() if n > 1]
    if topo.ep > 1 and (stage not in (1, 2) or topo.pp > 1):
        parts.append(
            f"ep {topo.ep} at ZeRO stage {stage}, pp {topo.pp} (experts' files at ZeRO "
            "1-2 without a pipeline only)"
        )
    if topo.pp > 1 and stage != 1:  # DeepSpeed's pipeline engine takes ZeRO 0-1
        parts.append(f"pp {topo.pp} at ZeRO stage {stage} (a pipeline's files at ZeRO-1 only)")
    if topo.pp > 1 and getattr(model, "tied_modules", None):
        parts.append("tied pipeline layers (TiedLayerSpec)")
    if zero.round_robin_gradients:
        parts.append("zero_optimization.round_robin_gradients")
    if zero.elastic_checkpoint:
        parts.append("zero_optimization.elastic_checkpoint")
    if cfg.checkpoint.async_save:
        parts.append("checkpoint.async_save")
    if cfg.bf16.bf16_master_weights_and_grads or cfg.fp16.fp16_master_weights_and_grads:
        parts.append("16-bit master weights (*_master_weights_and_grads)")
    if cfg.optimizer is not None and cfg.optimizer.type == "Muon":
        parts.append("optimizer.type Muon (its halves keep different moments)")
    if not parts:
        return None
    return f"{', '.join(parts)}: DeepSpeed's files are not written for it yet"


def wanted(run) -> bool:
    """Whether this save writes DeepSpeed's files: ``checkpoint.deepspeed_files``, or when it
    is unset, under the facade where the layout allows (else a warning, once per engine, says
    why the folder holds zerostack's files only)."""
    cfg = run.config
    asked = cfg.checkpoint.deepspeed_files
    if asked is not None:
        return asked
    if not served_as_deepspeed(cfg):
        return False
    stage = cfg.zero_optimization.stage
    why = (
        "a forward-only engine"
        if run.optimizer is None
        else refusal(cfg, run.topology, stage, run.module)
    )
    if why and run.global_rank == 0 and not getattr(run, "_warned_deepspeed_files", False):
        log.warning(
            "checkpoint: the folder holds zerostack's files only, not DeepSpeed's (%s; "
            "set checkpoint.deepspeed_files false to silence this)",
            why,
        )
        run._warned_deepspeed_files = True
    return why is None


def _optimizer_kind(cfg) -> str:
    """Which optimizer DeepSpeed builds for the config: its state is kept as that class keeps
    it. "fused": FusedAdam, "cpu": DeepSpeedCPUAdam, "torch": a torch optimizer (or the
    client's, which DeepSpeed keeps as it is)."""
    spec = cfg.optimizer
    if spec is None or spec.type not in ("Adam", "AdamW") or spec.params.torch_adam:
        return "torch"
    off = cfg.zero_optimization.offload_optimizer
    return "cpu" if off is not None and off.device in ("cpu", "nvme") else "fused"


# ---------------------------------------------------------------------------- the layout
@dataclass(frozen=True)
class Layout:
    """What DeepSpeed's files of one checkpoint say besides the values: the ZeRO stage and dp
    size they are cut for, the precision, the optimizer's kind and config, each optimizer
    group's trained parameters (in order), the frozen parameters and the buffers."""

    stage: int
    dp: int
    precision: str
    kind: str
    config: dict
    clip: float
    sub_group_size: int
    groups: list
    frozen: list
    buffers: list
    scaler: dict
    """fp16's loss scaler settings as DeepSpeed's ``DynamicLossScaler`` keeps them (``dynamic``:
    False for a static ``loss_scale``)."""
    pp: int = 1
    """Pipeline stages: each writes its layers' files and its ``mp_rank_<stage>`` files."""
    mp: int = 0
    """This rank's pipeline stage (the ``mp_rank`` of its file names)."""
    ep: int = 1
    """Expert-parallel size: the experts' groups are cut over the ``dp // ep`` ranks of an ep
    rank, which DeepSpeed's folder names by local index."""
    ep_rank: int = 0
    expert_groups: tuple = ()
    """The optimizer groups that hold experts."""
    moe_layers: tuple = ()
    """Each MoE layer in module order: (prefix, num_experts, num_local_experts)."""
    global_names: dict | None = None
    """A name in ``groups`` -> the name the checkpoint's reader knows it by (experts: their
    index among all the layer's experts); None: the same."""

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16"

    @property
    def fp16(self) -> bool:
        return self.precision == "fp16"

    @property
    def dtype(self) -> torch.dtype:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision, torch.float32)


def _scaler_settings(cfg, saved: dict) -> dict:
    """DeepSpeed's loss scaler settings: from the config, else from the scaler read back."""
    if cfg is not None:
        fp16 = cfg.fp16
        return {
            "dynamic": not fp16.loss_scale > 0,
            "scale_factor": 2.0,
            "scale_window": fp16.loss_scale_window,
            "min_scale": fp16.min_loss_scale,
            "delayed_shift": fp16.hysteresis,
            "consecutive_hysteresis": fp16.consecutive_hysteresis,
        }
    return {
        "dynamic": "cur_iter" in saved,
        "scale_factor": saved.get("scale_factor", 2.0),
        "scale_window": saved.get("scale_window", 1000),
        "min_scale": saved.get("min_scale", 1),
        "delayed_shift": saved.get("delayed_shift", 2),
        "consecutive_hysteresis": saved.get("consecutive_hysteresis", False),
    }


def layout_of_run(run, manifest: dict) -> Layout:
    """The layout of a run's save (its config, its module)."""
    cfg, topo = run.config, run.topology
    groups = [g["params"] for g in manifest["optimizer_groups"]]
    experts: dict = {}
    if topo.pp > 1 or topo.ep > 1:  # a rank's own: the manifest names no group's parameters
        names = {p: n for n, p in run.module.named_parameters()}
        groups = [[names[p] for p in ps] for ps in run.zero.group_params()]
        experts = _experts(run, names, groups)
    trained = {n for g in groups for n in g}
    return Layout(
        stage=cfg.zero_optimization.stage,
        dp=topo.data_parallel_size,
        precision=cfg.model_dtype,
        kind=_optimizer_kind(cfg),
        config=given_config(cfg),
        clip=float(cfg["gradient_clipping"]),
        sub_group_size=cfg.zero_optimization.sub_group_size,
        groups=groups,
        frozen=[n for n, _ in run.module.named_parameters() if n not in trained],
        buffers=_buffer_names(run.module),
        scaler=_scaler_settings(cfg, {}),
        pp=topo.pp,
        mp=topo.rank("pp"),
        **experts,
    )


def _experts(run, names: dict, groups: list) -> dict:
    """The MoE part of a run's layout (see :class:`Layout`), or nothing without experts."""
    from ..moe.layer import MoE
    from ..moe.utils import EXPERTS, global_names

    topo = run.topology
    if topo.ep == 1:
        return {}
    known = global_names(run.module, topo.rank("ep"))
    as_read = {names[p]: n for p, n in known.items()}
    layers = tuple(
        (prefix, m.num_experts, m.num_local_experts)
        for prefix, m in run.module.named_modules()
        if isinstance(m, MoE)
    )
    expert = {n for n in as_read if EXPERTS in n}
    return {
        "ep": topo.ep,
        "ep_rank": topo.rank("ep"),
        "moe_layers": layers,
        "expert_groups": tuple(g for g, ns in enumerate(groups) if set(ns) & expert),
        "global_names": as_read,
    }


def layout_of_checkpoint(reader, dp: int | None = None, stage: int | None = None) -> Layout:
    """The layout of DeepSpeed's files for a checkpoint read back (``zerostack convert``): its
    own dp size and stage unless given, its config where the checkpoint kept it."""
    from ..config import load_config

    manifest = reader.manifest
    saved = manifest["layout"]
    if (
        saved.get("pp", 1) > 1
        or hasattr(reader, "parts")
        or saved.get("ep", 1) > 1
        or (getattr(reader, "ep", None))
    ):
        raise CheckpointError(
            "a pipeline's or experts' checkpoint as DeepSpeed's files: not "
            "written by convert yet (the run's own save does)"
        )
    stage = stage if stage is not None else saved.get("zero_stage", getattr(reader, "stage", 1))
    dp = dp if dp is not None else saved.get("dp", getattr(reader, "world", 1))
    if stage not in (0, 1, 2, 3) or dp < 1:
        raise CheckpointError(
            f"DeepSpeed's files for ZeRO stage {stage} on {dp} ranks: "
            "expected stage 0, 1, 2 or 3 and at least one rank"
        )
    config = manifest.get("ds_config") or {}
    cfg = load_config(config, unknown_keys="as_deepspeed") if config else None
    groups = [g.get("params") for g in manifest["optimizer_groups"]]
    frozen = [n for n in manifest["params"] if n in set(manifest.get("frozen", []))]
    if None in groups:
        if len(groups) > 1:
            raise CheckpointError(
                "the checkpoint does not say which parameters each of its "
                f"{len(groups)} optimizer groups holds (written before "
                "zerostack recorded it)"
            )
        groups = [[n for n in manifest["params"] if n not in set(frozen)]]
    hyper = manifest["optimizer_groups"][0]["hyper"] if manifest["optimizer_groups"] else {}
    kind = _optimizer_kind(cfg) if cfg is not None else ("fused" if "betas" in hyper else "torch")
    return Layout(
        stage=stage,
        dp=dp,
        precision=saved.get("precision", "fp32"),
        kind=kind,
        config=config,
        clip=float(cfg.gradient_clipping if cfg is not None else 1.0),
        sub_group_size=cfg.zero_optimization.sub_group_size if cfg is not None else 10**9,
        groups=groups,
        frozen=frozen,
        buffers=list(reader.buffers),
        scaler=_scaler_settings(cfg, manifest["loss_scaler"]),
    )


def module_from_checkpoint(reader, layout: Layout) -> OrderedDict:
    """The module's state dict as DeepSpeed's model-states file holds it: the weights in the
    compute dtype (empty at ZeRO-3, where the optimizer files hold them), tied names too."""
    manifest, out = reader.manifest, {}
    for name in manifest["params"]:
        if layout.stage == 3:
            out[name] = torch.empty(0, dtype=layout.dtype)
        else:
            out[name] = reader.full(name).to(layout.dtype)
    for alias, name in manifest["aliases"].items():
        out[alias] = out[name]
    for name, file in reader.buffers.items():
        out[name] = reader.get(file, f"buffer/{name}")
    order = [n for n in manifest.get("state_dict_order") or [] if n in out]
    return OrderedDict((n, out[n]) for n in order + [n for n in out if n not in set(order)])


def state_dict_order(module) -> list[str]:
    """The keys of ``module.state_dict()`` in its order, without making it (at ZeRO-3 that
    would gather): each module's parameters, then its persistent buffers, then its children."""
    out: list[str] = []

    def walk(m, prefix: str) -> None:
        out.extend(prefix + n for n, p in m._parameters.items() if p is not None)
        out.extend(
            prefix + n
            for n, b in m._buffers.items()
            if b is not None and n not in m._non_persistent_buffers_set
        )
        for n, child in m._modules.items():
            if child is not None:
                walk(child, prefix + n + ".")

    walk(module, "")
    return out


def _buffer_names(module) -> list[str]:
    """The persistent buffers' names, as DeepSpeed lists them (module by module)."""
    out = []

    def walk(m, prefix: str) -> None:
        for name, buf in m.named_buffers(recurse=False):
            if buf is not None and name not in m._non_persistent_buffers_set:
                out.append(prefix + name)
        for name, child in m.named_children():
            if child is not None:
                walk(child, prefix + name + ".")

    walk(module, "")
    return out
