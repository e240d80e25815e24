"""Reading the folder of a DeepSpeed AutoTP run (``tensor_parallel.autotp_size``, ZeRO 1-2)::

    global_step3/
      mp_rank_<t>_model_states.pt                  tp rank t's slices of the module, their
                                                   param_shapes, the counters, LR schedule and
                                                   client state, and universal_checkpoint_info:
                                                   how each parameter is cut
      zero_pp_rank_<r>_mp_rank_<t>_optim_states.pt dp rank r's ZeRO partition of tp rank t's
                                                   slices, as :class:`~.deepspeed_read.
                                                   DeepSpeedReader` reads

Each tp rank's files are read as a ZeRO folder of their own, and every parameter is joined whole
by the patterns DeepSpeed records (``universal_checkpoint_info``): row-parallel parameters
(``parameter_with_row_parallelism_patterns``) along their inputs (dim 1), replicated ones
(``tp_replicated_parameter_patterns``) from tp rank 0, the rest along their outputs (dim 0), the
vocabulary's trimmed to ``original_vocab_size`` rows. zerostack then cuts them as its own tp
(any size) cuts them. Not read yet: fused parameters cut in sub-parameters
(``parameter_with_sub_params``), and a folder without the patterns; both refused.
"""

from __future__ import annotations

import glob
import os
import re

import torch

from .deepspeed_read import DeepSpeedReader, JoinedReader
from .errors import CheckpointError


def mp_ranks(folder: str) -> list[int]:
    """The model-parallel ranks (tp ranks, or pipeline stages) of a ZeRO folder's files."""
    found = glob.glob(os.path.join(folder, "*zero_pp_rank_*_mp_rank_*_optim_states.pt"))
    return sorted({int(re.search(r"mp_rank_(\d+)_optim", f).group(1)) for f in found})


class TensorParallelReader(JoinedReader):
    """A DeepSpeed AutoTP run's tag folder (see the module)."""

    def __init__(self, folder: str, gas: int = 1) -> None:
        self.folder, self.gas = folder, gas
        self.parts = [DeepSpeedReader(folder, gas, mp=t, part=True) for t in mp_ranks(folder)]
        first = self.parts[0]
        self.stage, self.world = first.stage, first.world
        self.model_file, self.model = first.model_file, first.model
        info = self.model.get("universal_checkpoint_info") or {}
        if "tp_replicated_parameter_patterns" not in info or info.get("parameter_with_sub_params"):
            raise CheckpointError(
                f"{self.model_file}: tp {len(self.parts)} without DeepSpeed's AutoTP patterns, "
                "or with parameters cut in sub-parameters: not read yet"
            )

        def patterns(key: str) -> list:
            return [re.compile(p) for p in info.get(key, [])]

        self.rows = patterns("parameter_with_row_parallelism_patterns")
        self.replicated = patterns("tp_replicated_parameter_patterns")
        self.vocab = patterns("vocabulary_parameter_patterns")
        self.vocab_size = info.get("original_vocab_size")
        self._module = {n: self._join(n, [p.weights[n] for p in self.parts]) for n in first.weights}
        self.shapes = [{n: list(self._module[n].shape) for n in g} for g in first.shapes]
        self._start()

    def _join(self, name: str, slices: list[torch.Tensor]) -> torch.Tensor:
        """Parameter ``name`` whole from each tp rank's slice."""
        if any(p.match(name) for p in self.replicated) or slices[0].dim() == 0:
            return slices[0]
        whole = torch.cat(slices, dim=1 if any(p.match(name) for p in self.rows) else 0)
        if self.vocab_size and any(p.match(name) for p in self.vocab):
            whole = whole[: self.vocab_size]
        return whole

    @property
    def weights(self) -> dict:
        return self._module

    def _values(self, kind: str) -> dict[str, torch.Tensor]:
        if kind in self._flat:
            return self._flat[kind]
        values = [p._values(kind) for p in self.parts]
        out = {}
        for g, shapes in enumerate(self.parts[0].shapes):
            for name in shapes:
                slices = [
                    v[name].reshape(p.shapes[g][name])
                    for v, p in zip(values, self.parts, strict=True)
                ]
                out[name] = self._join(name, slices).reshape(-1)
        self._flat[kind] = out
        return out

    def _precision(self) -> str:
        return self.parts[0]._precision()
