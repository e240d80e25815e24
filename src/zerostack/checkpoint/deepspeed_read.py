"""Reading a checkpoint folder DeepSpeed wrote (``engine.save_checkpoint`` of DeepSpeed 0.14-0.19,
ZeRO stages 0-3, fp32, bf16 or fp16), as :mod:`.restore` reads zerostack's own: a reader answers
what :class:`~.reader.ShardReader` answers (each parameter's fp32 value and optimizer moments by
element range, buffers, and a manifest of zerostack's shape with the counters, loss scaler, LR
schedule, optimizer groups and client state), so a DeepSpeed folder resumes on any ZeRO stage
and dp size zerostack runs, and ``zerostack consolidate`` and the served ``zero_to_fp32`` turn it
into whole fp32 weights (:func:`~.restore.open_reader` opens either kind of folder).

DeepSpeed's folder (``<dir>/latest`` names the tag)::

    global_step3/
      mp_rank_00_model_states.pt                  stages 0-2: the module's state dict (compute
                                                  dtype), param_shapes, shared (tied) and frozen
                                                  parameters, LR schedule, counters, and the
                                                  client state's keys at the top level; at
                                                  stage 0 the optimizer's state too
                                                  (:mod:`.deepspeed_read0`)
      zero_pp_rank_<r>_mp_rank_00_model_states.pt stage 3: the same per rank, parameters empty
      [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt
                                                  rank r's flat fp32 partition of each group
                                                  (stages 1-2: single_partition_of_fp32_groups,
                                                  stage 3: fp32_flat_groups), the base
                                                  optimizer's state over the same partition, and
                                                  the loss scaler (fp16's DynamicLossScaler)

Stages 1-2 cut each group's flat buffer (parameters back to back, after each the padding in
``param_alignment_paddings``) into equal consecutive partitions, one per rank; stage 3 cuts each
parameter into ``ceil(numel / world)``-element pieces, rank r's piece of every parameter back to
back in its partition. The moments (``exp_avg``, ``exp_avg_sq``, SGD's ``momentum_buffer``) are
laid out as the fp32 partition they belong to.

Nothing executes pickled code: the ``.pt`` files are read with ``torch.load(weights_only=True)``
and an allow-list of the four DeepSpeed classes its save code puts in them (:data:`ALLOWED`),
each read into a plain stand-in; any other class is refused, naming it and the file, before any
state is touched. Universal checkpoints: :mod:`.deepspeed_universal`; a pipeline's layer files:
:mod:`.deepspeed_pipe`; AutoTP's slices: :mod:`.deepspeed_tp`; MoE expert files:
:meth:`DeepSpeedReader._experts`. Not read yet: experts at ZeRO-3. Writing the same
layouts: :mod:`.deepspeed_write`.
"""

from __future__ import annotations

import enum
import glob
import math
import os
import pickle
import re

import torch

from ..moe.utils import EXPERTS
from .errors import CheckpointError


class _LossScaler:
    """DeepSpeed's ``LossScaler`` / ``DynamicLossScaler`` as pickled: its attributes, no code."""


class _DynamicLossScaler(_LossScaler):
    """DeepSpeed's ``DynamicLossScaler`` as pickled (fp16's)."""


class _ZeroStageEnum(enum.IntEnum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class _FragmentAddress:
    """DeepSpeed's ``fragment_address`` (a dataclass: ``numel``, ``start``) as pickled."""


ALLOWED = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": _LossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": _DynamicLossScaler,
    "deepspeed.runtime.zero.config.ZeroStageEnum": _ZeroStageEnum,
    "deepspeed.utils.tensor_fragment.fragment_address": _FragmentAddress,
}
"""The DeepSpeed classes its checkpoints hold (read in its save code: the loss scaler object,
the ZeRO stage, stage 1-2's per-rank slice map), each read into a stand-in."""

_KNOWN = {
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "frozen_param_fragments",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "sparse_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "checkpoint_parallel_dimensions",
    "ds_config",
    "ds_version",
    "autoep_layers",
    "iteration",
    "num_experts",
    "ds_autoep_layers",
    "universal_checkpoint_info",
    "folding",
}
"""The model-states keys DeepSpeed writes itself; any other top-level key is client state."""


def load_pickle(path: str) -> dict:
    """``torch.load`` of a DeepSpeed ``.pt`` file without executing code (see the module)."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing (DeepSpeed's folder lists it)")
    try:
        with torch.serialization.safe_globals([(c, n) for n, c in ALLOWED.items()]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = found.group(1) if found else str(exc).splitlines()[0]
        raise CheckpointError(
            f"{path}: holds {what}, which is not on the allow-list of DeepSpeed classes "
            f"zerostack reads (refused: loading never unpickles code)"
        ) from None
    except (RuntimeError, OSError, EOFError) as exc:
        raise CheckpointError(f"{path}: not a readable checkpoint file ({exc})") from None


def is_deepspeed_folder(folder: str) -> bool:
    """Whether ``folder`` (a tag's) is DeepSpeed's: its model-states files and no zerostack
    manifest (a folder zerostack wrote with DeepSpeed's files beside its own is zerostack's)."""
    if os.path.exists(os.path.join(folder, "manifest.json")):
        return False
    return bool(glob.glob(os.path.join(folder, "*mp_rank_*_model_states.pt")))


def zero_files(folder: str, mp: int = 0) -> list[str]:
    """The ZeRO optimizer-state files of a DeepSpeed tag folder's model-parallel rank ``mp``
    (a pipeline stage), by dp rank (none at stage 0)."""
    return _files(folder, f"*zero_pp_rank_*_mp_rank_{mp:02d}_optim_states.pt")


def _files(folder: str, pattern: str) -> list[str]:
    def rank(path: str) -> int:
        return int(re.search(r"zero_pp_rank_(\d+)_", os.path.basename(path)).group(1))

    return sorted(glob.glob(os.path.join(folder, pattern)), key=rank)


class Reader:
    """What every DeepSpeed reader shares: a subclass sets ``model`` (the model-states file's
    dict), ``model_file``, ``stage``, ``world``, ``shapes`` (per optimizer group, its trained
    parameters' names and shapes in the group's order) and answers :meth:`_values`,
    :meth:`kinds`, :meth:`_groups` and :meth:`_scaler`."""

    saved_tp = 1
    specs: dict = {}
    sha: dict = {}

    @property
    def weights(self) -> dict:
        """The module's state dict as the folder holds it (names as ``module.state_dict()``)."""
        return self.model["module"]

    def _start(self) -> None:
        # kind ("frozen": the frozen parameters) -> name -> whole flat fp32 value, made once
        self._flat: dict[str, dict[str, torch.Tensor]] = {}
        self.buffers = {n: "module" for n in self.model.get("buffer_names", [])}
        self.manifest = self._manifest()

    def has(self, name: str, kind: str) -> bool:
        """Whether the folder holds ``kind`` for ``name``."""
        return name in self._values(kind)

    def fill(self, dest, name: str, kind: str, tp_rank, lo: int, hi: int, offset: int) -> int:
        values = self._values(kind).get(name)
        if values is None:  # a frozen parameter: its value only, from the module's states
            if kind != "master" or name not in self._frozen():
                return 0
            values = self._frozen()[name]
        dest[offset : offset + hi - lo].copy_(values[lo:hi])
        return hi - lo

    def full(self, name: str, kind: str = "master") -> torch.Tensor:
        shape = self.manifest["params"][name]
        flat = self._values(kind).get(name)
        if flat is None:
            flat = self._frozen()[name]
        return flat.reshape(shape).clone()

    def get(self, file: str, key: str) -> torch.Tensor:
        return self.weights[key.split("/", 1)[1]]

    def _frozen(self) -> dict[str, torch.Tensor]:
        """Frozen parameters' values (fp32, flat), read from the module's states once."""
        if "frozen" not in self._flat:
            frozen = self.model.get("frozen_param_shapes") or {}
            if frozen and self.stage == 3:  # each rank's model states hold its pieces
                self._flat["frozen"] = self._frozen_pieces(frozen)
            else:
                self._flat["frozen"] = {n: self.weights[n].float().reshape(-1) for n in frozen}
        return self._flat["frozen"]

    def _frozen_pieces(self, frozen: dict) -> dict[str, torch.Tensor]:
        """ZeRO-3's frozen parameters whole: rank r's ``ceil(numel / world)``-element piece of
        each is in its model-states file (``frozen_param_fragments``), the last one padded."""
        head, name = os.path.split(self.model_file)
        ranks = [self.model] + [
            load_pickle(os.path.join(head, name.replace("zero_pp_rank_0_", f"zero_pp_rank_{r}_")))
            for r in range(1, self.world)
        ]
        out = {}
        for n, shape in frozen.items():
            numel = math.prod(shape)
            whole = torch.cat([m["frozen_param_fragments"][n].float().reshape(-1) for m in ranks])
            if whole.numel() < numel:
                raise CheckpointError(
                    f"{self.model_file}: {n}: the ranks' pieces hold "
                    f"{whole.numel()} of {numel} elements"
                )
            out[n] = whole[:numel]
        return out

    def _manifest(self) -> dict:
        m = self.model
        params = {n: list(s) for shapes in self.shapes for n, s in shapes.items()}
        params.update({n: list(s) for n, s in (m.get("frozen_param_shapes") or {}).items()})
        groups = [
            {
                "hyper": {k: v for k, v in hyper.items() if k not in ("params", "step")},
                "step": float(step) if step is not None else None,
                "params": list(self.shapes[g]) if g < len(self.shapes) else [],
            }
            for g, (hyper, step) in enumerate(self._groups())
        ]
        return {
            "params": params,
            "aliases": dict(m.get("shared_params") or {}),
            "layout": {
                "tp": 1,
                "world_size": -1,  # DeepSpeed keeps no RNG states
                "dp": self.world,
                "zero_stage": self.stage,
                "precision": self._precision(),
            },
            "tp_specs": {},
            "files": [],
            "excluded": [],
            "frozen": list(m.get("frozen_param_shapes") or {}),
            "optimizer_groups": groups,
            "counters": {
                "global_steps": int(m["global_steps"]),
                "global_samples": int(m["global_samples"]),
                "skipped_steps": int(m.get("skipped_steps", 0)),
                "micro_steps": int(m["global_steps"]) * self.gas,  # at a window's boundary
            },
            "loss_scaler": self._scaler(),
            "data_sampler": None,
            "random_ltd": m.get("random_ltd"),
            "lr_scheduler": m.get("lr_scheduler"),
            "client_state": {k: v for k, v in m.items() if k not in _KNOWN},
            "ds_config": m.get("ds_config"),
            "state_dict_order": list(self.weights),
        }

    def _precision(self) -> str:
        """The run's compute dtype, as its weights are kept."""
        weights = [t for t in (self.weights or {}).values() if t.is_floating_point()]
        return (
            {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(weights[0].dtype, "fp32")
            if (weights)
            else "fp32"
        )


class DeepSpeedReader(Reader):
    """A DeepSpeed tag folder at ZeRO stages 1-3, read as :class:`~.reader.ShardReader` reads
    zerostack's."""

    def __init__(self, folder: str, gas: int = 1, mp: int = 0, part: bool = False) -> None:
        """``mp``: which model-parallel rank's files (a pipeline stage's); ``part``: one of
        several such readers a :class:`~.deepspeed_pipe.PipelineReader` joins (no manifest)."""
        self.folder, self.gas = folder, gas
        optim = zero_files(folder, mp)
        if not optim:
            raise CheckpointError(f"{folder}: a DeepSpeed folder without ZeRO optimizer states")
        self.optim_files = optim
        self.optim = [load_pickle(p)["optimizer_state_dict"] for p in optim]
        first = self.optim[0]
        self.stage = int(first["zero_stage"])
        world = first["partition_count"]
        world = max(world) if isinstance(world, list) else int(world)
        if world != len(optim):
            raise CheckpointError(
                f"{folder}: {len(optim)} optimizer-state files, DeepSpeed's partition count "
                f"says {world} (an incomplete or mixed folder)"
            )
        self.world = world
        name = f"mp_rank_{mp:02d}_model_states.pt"
        self.model_file = os.path.join(folder, name if self.stage < 3 else f"zero_pp_rank_0_{name}")
        self.model = load_pickle(self.model_file)
        self.shapes = [dict(g) for g in self.model["param_shapes"]]
        self.base = [
            o["base_optimizer_state" if self.stage < 3 else "optimizer_state_dict"]
            for o in self.optim
        ]
        self._experts(first["partition_count"])
        if part:
            self._flat = {}
        else:
            self._start()

    # ------------------------------------------------------------------ experts
    def _experts(self, counts) -> None:
        """DeepSpeed's MoE: an expert group is cut over the expert-data-parallel ranks only
        (its partition count below the world's), rank r holding ep rank ``r % ep``'s local
        experts under local indices; they are named here by their index among all the
        layer's experts, as zerostack's checkpoints name them, and their weights read from
        ``layer_<L>_expert_<E>_mp_rank_00_model_states.pt`` (named so already)."""
        counts = counts if isinstance(counts, list) else [counts] * len(self.shapes)
        self.local_shapes, self.ep = list(self.shapes), {}
        self._module = self.model.get("module")
        self._local: dict[int, dict[str, int]] = {}  # group -> MoE layer -> local experts
        for g, count in enumerate(counts):
            if count < self.world:
                for n in (n for n in self.local_shapes[g] if EXPERTS in n):
                    head, tail = n.split(EXPERTS, 1)
                    layer = self._local.setdefault(g, {})
                    layer[head] = max(layer.get(head, 0), int(tail.split(".", 1)[0]) + 1)
                if self.stage == 3:
                    raise CheckpointError(f"{self.folder}: MoE experts at ZeRO-3: not read yet")
                self.ep[g] = self.world // count
                self.shapes[g] = {
                    self._global(n, e, g): s
                    for e in range(self.ep[g])
                    for n, s in self.local_shapes[g].items()
                }
        if self.ep:
            self._module = dict(self._module)
            pattern = os.path.join(self.folder, "layer_*_expert_*_model_states.pt")
            for path in sorted(glob.glob(pattern)):
                self._module.update(load_pickle(path))

    def _global(self, name: str, ep_rank: int, g: int) -> str:
        """Local expert ``l`` of ep rank ``ep_rank``: the layer's ``ep_rank * local + l``."""
        head, tail = name.split(EXPERTS, 1)
        index, rest = tail.split(".", 1)
        return f"{head}{EXPERTS}{ep_rank * self._local[g][head] + int(index)}.{rest}"

    @property
    def weights(self) -> dict:
        return self._module

    # ------------------------------------------------------------------ values
    def kinds(self) -> list[str]:
        """The optimizer moments the folder holds (besides ``master``)."""
        state = self.base[0]["state"]
        first = state[next(iter(state))] if state else {}
        return sorted(k for k, v in first.items() if torch.is_tensor(v) and v.dim() > 0)

    def _partitions(self, kind: str) -> list[list[torch.Tensor]]:
        """Per rank, its flat partition of each group (sub-group at stage 3) for ``kind``."""
        if kind == "master":
            key = "single_partition_of_fp32_groups" if self.stage < 3 else "fp32_flat_groups"
            return [list(o[key]) for o in self.optim]
        return [[b["state"][i][kind] for i in sorted(b["state"])] for b in self.base]

    def _values(self, kind: str) -> dict[str, torch.Tensor]:
        """Every trained parameter's whole flat value of ``kind`` (fp32), computed once."""
        if kind in self._flat:
            return self._flat[kind]
        parts, out = self._partitions(kind), {}
        if self.stage < 3:
            for g, shapes in enumerate(self.local_shapes):
                ep = self.ep.get(g, 1)  # experts: each ep rank's over its own ranks
                for e in range(ep):
                    flat = torch.cat([rank[g].float() for rank in parts[e::ep]])
                    pads = self.optim[e].get("param_alignment_paddings")
                    offset = 0
                    for i, (name, shape) in enumerate(shapes.items()):
                        n = math.prod(shape)
                        out[self._global(name, e, g) if g in self.ep else name] = flat[
                            offset : offset + n
                        ]
                        offset += n + (pads[g][i] if pads is not None else 0)
                    if offset > flat.numel():
                        raise CheckpointError(
                            f"{self.folder}: group {g} holds {flat.numel()} "
                            f"elements, its parameters {offset}"
                        )
        else:
            flats = [torch.cat([t.float() for t in rank]) for rank in parts]
            offset = 0
            for shapes in self.shapes:
                for name, shape in shapes.items():
                    n = math.prod(shape)
                    piece = -(-n // self.world)
                    out[name] = torch.cat([f[offset : offset + piece] for f in flats])[:n]
                    offset += piece
            if offset != flats[0].numel():
                raise CheckpointError(
                    f"{self.folder}: a partition holds {flats[0].numel()} "
                    f"elements, its parameters' pieces {offset}"
                )
        self._flat[kind] = out
        return out

    # ------------------------------------------------------------------ the manifest's parts
    def _groups(self) -> list[tuple[dict, object]]:
        state = self.base[0]["state"]
        return [
            (hyper, state.get(g, {}).get("step"))
            for g, hyper in enumerate(self.base[0]["param_groups"])
        ]

    def _scaler(self) -> dict:
        scaler = self.optim[0].get("loss_scaler")
        return dict(vars(scaler)) if scaler is not None else {}

    def _precision(self) -> str:
        """The run's compute dtype, as its files are named (``bf16_``) or its weights kept."""
        if os.path.basename(self.optim_files[0]).startswith("bf16_"):
            return "bf16"
        return super()._precision()


class JoinedReader(Reader):
    """A folder read as several ZeRO folders of one run (a pipeline's stages, AutoTP's tp
    ranks), ``parts``: the optimizer's kinds, groups and loss scaler are the first's."""

    parts: list

    def kinds(self) -> list[str]:
        return self.parts[0].kinds()

    def _groups(self) -> list[tuple[dict, object]]:
        return self.parts[0]._groups()  # every part's optimizer has the same groups and step

    def _scaler(self) -> dict:
        return self.parts[0]._scaler()
