"""Reading DeepSpeed's universal checkpoint: what ``ds_to_universal`` makes of a ZeRO folder, and
DeepSpeed loads with ``checkpoint.load_universal`` (``latest_universal`` names its tag). Every
parameter is whole, each of its states in a file of its own::

    global_step3_universal/
      mp_rank_00_model_states.pt               stages 1-2 (zero_pp_rank_<r>_... at stage 3): the
                                               ZeRO folder's model states (param_shapes, frozen
                                               and tied parameters, counters, LR schedule,
                                               client state), copied
      zero/optimizer_state.pt                  the optimizer file's unsharded part: param_groups,
                                               the loss scaler, zero_stage (at stage 3 rank 0's
                                               whole state, whose step is the count)
      zero/<name>/fp32.pt, exp_avg.pt, exp_avg_sq.pt
                                               the fp32 master and Adam's moments, whole
                                               ({"param": tensor, "cat_dim": 0} at stages 1-2,
                                               the tensor itself at stage 3)
      zero/<name>/step.pt                      Adam's step (stages 1-2)

``ds_to_universal`` keeps Adam's states only (fp32, exp_avg, exp_avg_sq). Not read yet: a
universal checkpoint of a tensor- or pipeline-parallel run (its slices merged by Megatron's
patterns), refused naming the sizes.
"""

from __future__ import annotations

import math
import os

import torch

from .deepspeed_read import Reader, load_pickle
from .errors import CheckpointError

LATEST_UNIVERSAL = "latest_universal"
_FILES = {"master": "fp32"}


def is_universal_folder(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "zero", "optimizer_state.pt"))


class UniversalReader(Reader):
    """A universal checkpoint's tag folder (see the module)."""

    def __init__(self, folder: str, gas: int = 1) -> None:
        self.folder, self.gas = folder, gas
        self.optimizer_state = load_pickle(os.path.join(folder, "zero", "optimizer_state.pt"))
        self.stage = int(self.optimizer_state["zero_stage"])
        name = "mp_rank_00_model_states.pt"
        self.model_file = os.path.join(folder, name if self.stage < 3 else f"zero_pp_rank_0_{name}")
        self.model = load_pickle(self.model_file)
        parallel = self.model.get("checkpoint_parallel_dimensions") or {}
        tp, pp = int(parallel.get("tp_degree", 1)), int(parallel.get("pp_degree", 1))
        if max(tp, pp, int(self.model.get("mp_world_size") or 1)) > 1:
            raise CheckpointError(
                f"{self.model_file}: a universal checkpoint of tp {tp}, pp {pp}: not read yet"
            )
        self.world = int(self.model.get("dp_world_size") or 1)
        self.shapes = [dict(g) for g in self.model["param_shapes"]]
        self._start()

    def _file(self, name: str, kind: str) -> str:
        return os.path.join(self.folder, "zero", name, f"{_FILES.get(kind, kind)}.pt")

    def kinds(self) -> list[str]:
        first = next(n for g in self.shapes for n in g)
        held = os.listdir(os.path.join(self.folder, "zero", first))
        return sorted(f[:-3] for f in held if f.endswith(".pt") and f not in ("fp32.pt", "step.pt"))

    def _values(self, kind: str) -> dict[str, torch.Tensor]:
        if kind in self._flat:
            return self._flat[kind]
        out = {}
        for shapes in self.shapes:
            for name, shape in shapes.items():
                path = self._file(name, kind)
                value = load_pickle(path)
                value = value["param"] if isinstance(value, dict) else value
                if not torch.is_tensor(value) or value.numel() != math.prod(shape):
                    raise CheckpointError(
                        f"{path}: holds {_what(value)}, the parameter has shape {list(shape)}"
                    )
                out[name] = value.float().reshape(-1)
        self._flat[kind] = out
        return out

    def _groups(self) -> list[tuple[dict, object]]:
        out = []
        for g, hyper in enumerate(self.optimizer_state["param_groups"]):
            if self.stage == 3:  # one count for all, as DeepSpeed's stage 3 loads it
                state = self.optimizer_state["optimizer_state_dict"]["state"]
                step = state[0]["step"] if state else None
            else:
                first = next(iter(self.shapes[g]), None)
                path = self._file(first, "step") if first is not None else ""
                step = load_pickle(path) if os.path.isfile(path) else None
            out.append((hyper, step.item() if torch.is_tensor(step) else step))
        return out

    def _scaler(self) -> dict:
        scaler = self.optimizer_state.get("loss_scaler")
        return dict(vars(scaler)) if scaler is not None else {}


def _what(value) -> str:
    if torch.is_tensor(value):
        return f"{value.numel()} elements"
    return type(value).__name__


_SHARDED = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")
"""The parts of a stage 1-2 optimizer file ``ds_to_universal`` leaves out of optimizer_state.pt."""


def write_universal(layout, work: str, manifest: dict, reader, module, client_state) -> dict:
    """DeepSpeed's universal checkpoint of ``reader``'s state into the tag folder ``work``, as
    ``ds_to_universal`` makes it from the ZeRO folder of ``layout``: that folder's model-states
    files, ``zero/optimizer_state.pt`` (rank 0's optimizer file less its partitions) and each
    parameter's whole states; at stages 1-2 also an fp32 value for each other entry of the
    module's state dict (tied names, frozen parameters), as it adds them. Returns
    ``{file: sha256}``, the files named relative to ``work``."""
    from . import deepspeed_write as dw

    written: dict[str, str] = {}
    for rank in range(layout.dp):
        written.update(dw.write(layout, work, rank, manifest, reader, module, client_state, False))
    optim = sorted(
        (f for f in written if f.endswith("_optim_states.pt")),
        key=lambda f: int(f.split("zero_pp_rank_")[1].split("_")[0]),
    )
    sd = load_pickle(os.path.join(work, optim[0]))["optimizer_state_dict"]
    for f in optim:
        os.remove(os.path.join(work, f))
        del written[f]
    if layout.stage < 3:
        out = {k: v for k, v in sd.items() if k not in _SHARDED}
        out["param_groups"] = sd["base_optimizer_state"]["param_groups"]
        states = sd["base_optimizer_state"]["state"]
    else:
        out = {**sd, "param_groups": sd["optimizer_state_dict"]["param_groups"]}
        states = {}
    zero = os.path.join(work, "zero")
    os.makedirs(zero)
    written["zero/optimizer_state.pt"] = dw._save(zero, "optimizer_state.pt", out)

    def save(name: str, file: str, value) -> None:
        os.makedirs(os.path.join(zero, name), exist_ok=True)
        written[f"zero/{name}/{file}"] = dw._save(os.path.join(zero, name), file, value)

    kinds = ["master", *reader.kinds()]
    for g, group in enumerate(layout.groups):
        step = states.get(g, {}).get("step")
        for name in group:
            if step is not None:
                save(name, "step.pt", step)
            for kind in kinds:
                value = reader.full(name, kind)
                value = {"cat_dim": 0, "param": value} if layout.stage < 3 else value.reshape(-1)
                save(name, f"{_FILES.get(kind, kind)}.pt", value)
    if layout.stage < 3:
        for name, value in module().items():
            if f"zero/{name}/fp32.pt" not in written:
                save(name, "fp32.pt", {"param": value.float()})
    return written
