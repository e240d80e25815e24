"""Reading DeepSpeed's ZeRO stage 0 folder: one ``mp_rank_00_model_states.pt`` with the module's
weights and, under ``optimizer``, the optimizer's state in one of two shapes:

- fp32: the optimizer's own ``state_dict()`` (FusedAdam, torch's, DeepSpeedCPUAdam): each
  parameter's moments, shaped as the parameter, keyed by its index over the groups in order;
  the masters are the module's fp32 weights. FusedAdam counts its step on each group's last
  parameter only (the others keep the step they started with): the group's step is the largest.
- bf16 and fp16 (DeepSpeed's ``FP16_Optimizer``): ``fp32_groups_flat``, each group's fp32
  masters back to back without padding, the inner optimizer's state over the same flat tensor
  (``optimizer_state_dict``), ``clip_grad``, and in fp16 the loss scale's state as keys
  (``cur_scale``, ``cur_iter``, ``last_overflow_iter``; no hysteresis, which restarts from the
  config as in DeepSpeed).

Neither names the parameters (stage 0 writes no ``param_shapes``). The reader pairs them with
``groups``, the loading run's trained parameters per optimizer group (names, in order), as
DeepSpeed pairs the state with its own optimizer's parameters; without it (consolidating,
converting) with the module's parameters in order, each once (a tied one under its first name),
taken group after group. Either way every value's size is checked against the parameter it is
paired with, so a folder from another model or grouping is refused, naming the file.
"""

from __future__ import annotations

import math
import os

import torch

from .deepspeed_read import Reader, load_pickle
from .errors import CheckpointError

_SCALER = ("cur_scale", "cur_iter", "last_overflow_iter")
"""The loss scale's state ``FP16_Optimizer.state_dict`` keeps (fp16)."""


class Zero0Reader(Reader):
    """A DeepSpeed tag folder at ZeRO stage 0 (see the module)."""

    stage = 0

    def __init__(self, folder: str, gas: int = 1, groups: list[list[str]] | None = None) -> None:
        self.folder, self.gas = folder, gas
        self.model_file = os.path.join(folder, "mp_rank_00_model_states.pt")
        self.model = load_pickle(self.model_file)
        opt = self.model.get("optimizer")
        if not isinstance(opt, dict):
            raise CheckpointError(
                f"{self.model_file}: no optimizer state beside the module (a pipeline's layer "
                "files, or a folder saved without its optimizer): not read yet"
            )
        self.opt = opt
        self.flat = "fp32_groups_flat" in opt
        self.inner = opt["optimizer_state_dict"] if self.flat else opt
        self.world = int(self.model.get("dp_world_size") or 1)
        module = self.model["module"]
        weights, self.aliases = self._weights(module)
        names = groups if groups is not None else self._in_order(weights)
        self.shapes = [{n: list(weights[n].shape) for n in g} for g in names]
        trained = {n for g in names for n in g}
        self.frozen_shapes = {n: list(t.shape) for n, t in weights.items() if n not in trained}
        self._check(weights)
        self._start()

    # ------------------------------------------------------------------ pairing
    def _weights(self, module: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The module's parameters, each once (by storage: torch.save keeps a tied weight's
        sharing), and the tied names -> the first name."""
        buffers = set(self.model.get("buffer_names") or [])
        seen: dict[tuple, str] = {}
        weights, aliases = {}, {}
        for name, t in module.items():
            if name in buffers or not t.is_floating_point():
                continue
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if key in seen:
                aliases[name] = seen[key]
            else:
                seen[key] = name
                weights[name] = t
        return weights, aliases

    def _sizes(self) -> list[list[int]]:
        """Per group, what the file says of its parameters: (fp32) each one's element count
        (-1: a parameter without state yet), (FP16_Optimizer) one entry, the group's total."""
        if self.flat:
            return [[t.numel()] for t in self.opt["fp32_groups_flat"]]
        state = self.inner["state"]

        def size(i) -> int:
            held = [v for v in state.get(i, {}).values() if torch.is_tensor(v) and v.dim() > 0]
            return held[0].numel() if held else -1

        return [[size(i) for i in g["params"]] for g in self.inner["param_groups"]]

    def _in_order(self, weights: dict[str, torch.Tensor]) -> list[list[str]]:
        """The module's parameters taken group after group (no grouping given)."""
        order, out = list(weights), []
        for sizes in self._sizes():
            if self.flat:  # as many as fill the group's flat masters
                total, names = 0, []
                while order and total < sizes[0]:
                    names.append(order.pop(0))
                    total += weights[names[-1]].numel()
            else:
                names, order = order[: len(sizes)], order[len(sizes) :]
            out.append(names)
        return out

    def _check(self, weights: dict[str, torch.Tensor]) -> None:
        sizes = self._sizes()
        if len(sizes) != len(self.shapes):
            raise CheckpointError(
                f"{self.model_file}: {len(sizes)} optimizer groups, the "
                f"model's optimizer has {len(self.shapes)}"
            )
        for g, (have, names) in enumerate(zip(sizes, self.shapes, strict=True)):
            want = [math.prod(s) for s in names.values()]
            if self.flat:
                want = [sum(want)]
            fits = len(have) == len(want) and all(
                h in (-1, w) for h, w in zip(have, want, strict=True)
            )
            if not fits:
                raise CheckpointError(
                    f"{self.model_file}: optimizer group {g} holds parameters of "
                    f"{have} elements, the model's {want} ({list(names)[:3]}...): another model "
                    "or another grouping of its parameters"
                )

    # ------------------------------------------------------------------ values
    def kinds(self) -> list[str]:
        state = self.inner["state"]
        first = state[next(iter(state))] if state else {}
        return sorted(k for k, v in first.items() if torch.is_tensor(v) and v.dim() > 0)

    def _values(self, kind: str) -> dict[str, torch.Tensor]:
        if kind in self._flat:
            return self._flat[kind]
        out, state = {}, self.inner["state"]
        for g, names in enumerate(self.shapes):
            if self.flat:
                index = self.inner["param_groups"][g]["params"][0]
                flat = (
                    self.opt["fp32_groups_flat"][g] if kind == "master" else state[index][kind]
                ).float()
                offset = 0
                for name, shape in names.items():
                    n = math.prod(shape)
                    out[name] = flat[offset : offset + n]
                    offset += n
                continue
            for name, index in zip(names, self.inner["param_groups"][g]["params"], strict=True):
                if kind == "master":
                    out[name] = self.model["module"][name].float().reshape(-1)
                elif index in state:  # a parameter never stepped has no state yet
                    out[name] = state[index][kind].float().reshape(-1)
        self._flat[kind] = out
        return out

    def _frozen(self) -> dict[str, torch.Tensor]:
        if "frozen" not in self._flat:
            self._flat["frozen"] = {
                n: self.model["module"][n].float().reshape(-1) for n in self.frozen_shapes
            }
        return self._flat["frozen"]

    # ------------------------------------------------------------------ the manifest's parts
    def _manifest(self) -> dict:
        out = super()._manifest()
        out["params"].update(self.frozen_shapes)
        out["frozen"] = list(self.frozen_shapes)
        out["aliases"] = dict(self.aliases)
        return out

    def _groups(self) -> list[tuple[dict, object]]:
        state, out = self.inner["state"], []
        for hyper in self.inner["param_groups"]:
            steps = [state[i]["step"] for i in hyper["params"] if "step" in state.get(i, {})]
            out.append((hyper, max(float(s) for s in steps) if steps else None))
        return out

    def _scaler(self) -> dict:
        if self.flat and "cur_scale" in self.opt:
            return {k: self.opt[k] for k in _SCALER if k in self.opt}
        return {"cur_scale": 1.0}
