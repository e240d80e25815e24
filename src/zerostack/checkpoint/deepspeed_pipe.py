"""Reading the folder DeepSpeed's ``PipelineEngine`` writes (ZeRO stages 0-1; zerostack's
``PipelineModule`` names layers as DeepSpeed's does, by their index)::

    global_step3/
      layer_<XX>-model_states.pt                   layer XX's state dict, names local to it
                                                   (``weight``: the module's ``XX.weight``)
      mp_rank_<ss>_model_states.pt                 pipeline stage ss: its param_shapes, and
                                                   (stage 0's) the counters, LR schedule and
                                                   client state; the module is in the layer files
      zero_pp_rank_<r>_mp_rank_<ss>_optim_states.pt
                                                   dp rank r's partition of stage ss's groups, as
                                                   :class:`~.deepspeed_read.DeepSpeedReader` reads

Each stage's optimizer files are read as a ZeRO folder of their own (one reader per stage), its
groups joined group by group: the masters and moments of every layer, whichever stage held it.
Not read yet: tied layers (``TiedLayerSpec``: their weights sit under ``tied_modules``) and frozen
parameters in layer files, each refused naming the parameter; ZeRO-0 pipelines.
"""

from __future__ import annotations

import glob
import os
import re

import torch

from .deepspeed_read import DeepSpeedReader, JoinedReader, load_pickle
from .deepspeed_tp import mp_ranks
from .errors import CheckpointError


def layer_files(folder: str) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "layer_*-model_states.pt")))


class PipelineReader(JoinedReader):
    """A DeepSpeed pipeline's tag folder (see the module)."""

    def __init__(self, folder: str, gas: int = 1) -> None:
        self.folder, self.gas = folder, gas
        stages = mp_ranks(folder)
        if not stages:
            raise CheckpointError(
                f"{folder}: a pipeline's folder without ZeRO optimizer states "
                "(ZeRO-0): not read yet"
            )
        self.parts = [DeepSpeedReader(folder, gas, mp=s, part=True) for s in stages]
        first = self.parts[0]
        self.stage, self.world = first.stage, first.world
        self.model_file, self.model = first.model_file, first.model
        count = max(len(p.shapes) for p in self.parts)
        self.shapes = [
            {n: s for p in self.parts if g < len(p.shapes) for n, s in p.shapes[g].items()}
            for g in range(count)
        ]
        self._weights: dict[str, torch.Tensor] = {}
        for path in layer_files(folder):
            index = int(re.search(r"layer_(\d+)-", os.path.basename(path)).group(1))
            for key, value in load_pickle(path).items():
                self._weights[f"{index}.{key}"] = value
        buffers = [n for p in self.parts for n in p.model.get("buffer_names") or []]
        trained = {n for g in self.shapes for n in g}
        other = [n for n in self._weights if n not in trained and n not in set(buffers)]
        if other:
            raise CheckpointError(
                f"{folder}: {other[0]} is in a layer file but trained by no "
                "stage (a frozen or tied layer's): not read yet"
            )
        self._start()
        self.buffers = {n: "module" for n in buffers}

    @property
    def weights(self) -> dict:
        return self._weights

    def _values(self, kind: str) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for part in self.parts:
            out.update(part._values(kind))
        return out

    def _precision(self) -> str:
        return self.parts[0]._precision() if self.parts[0].weights else super()._precision()
