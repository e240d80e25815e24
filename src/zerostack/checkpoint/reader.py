"""Reading zerostack's own checkpoint folder: :class:`ShardReader` finds each tensor by its key
in the rank files the manifest lists, checks its sha256, and copies element ranges out
(:mod:`.restore` fills an engine from it; :mod:`.deepspeed_write` and :mod:`.convert` read the
values they rewrite through it).
"""

from __future__ import annotations

import math
import os
from collections import defaultdict

import torch

from ..tensor_parallel import join_tensors
from .errors import CheckpointError
from .shard import key_of as _key
from .stream import FileReader
from .stream import sha256 as _sha256


class ShardReader:
    """Reads and checks tensors of one checkpoint folder, a file opened once."""

    def __init__(self, folder: str, manifest: dict) -> None:
        self.folder, self.manifest = folder, manifest
        self.sha = {rec["file"]: rec["sha256"] for rec in manifest["files"]}
        self._open: dict[str, object] = {}
        self._checked: set[tuple[str, str]] = set()  # (file, key) read whole and verified
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

    def kinds(self) -> list[str]:
        """The optimizer moments the checkpoint holds (besides ``master``)."""
        files = self.manifest["files"]
        found = {k.split("/")[0] for rec in files for k in rec["sha256"]}
        return sorted(found - {"master", "rng", "buffer"})

    def has(self, name: str, kind: str) -> bool:
        """Whether the checkpoint holds ``kind`` for ``name`` (the moments differ by optimizer
        group: Muon's momentum, its Adam half's two moments)."""
        return any(
            f"{kind}/{_key(name, tp, lo)}" in self.sha[file]
            for tp, lo, _, file in self.index.get(name, ())
        )

    def fill(self, dest, name: str, kind: str, tp_rank, lo: int, hi: int, offset: int) -> int:
        """Copy elements ``[lo, hi)`` of ``name``'s saved ``kind`` (the slice written by tp rank
        ``tp_rank``; None for a whole parameter) to ``dest[offset:]``; returns how many."""
        covered = 0
        for src_tp, slo, shi, file in self.index[name]:
            x, y = max(lo, slo), min(hi, shi)
            if src_tp != tp_rank or x >= y:
                continue
            key = f"{kind}/{_key(name, src_tp, slo)}"
            if (file, key) in self._checked:  # checked whole once: read just the overlap
                src = self._range(file, key, x - slo, y - slo)
            else:
                src = self.get(file, key)[x - slo : y - slo]
            dest[offset + x - lo : offset + y - lo].copy_(src)
            covered += y - x
        return covered

    def full(self, name: str, kind: str = "master") -> torch.Tensor:
        """The whole saved parameter (fp32), its tp slices joined: one parameter in memory."""
        shape, spec = self.manifest["params"][name], self.specs.get(name)
        whole = [(f, lo, hi) for tp, lo, hi, f in self.index[name] if tp is None]
        if spec is None and len(whole) == 1 and whole[0][1:] == (0, math.prod(shape)):
            return self.get(whole[0][0], f"{kind}/{_key(name, None, 0)}").view(shape)
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
                self._open[file] = FileReader(path)
            t = self._open[file].get(key)
        except Exception as exc:  # a damaged header or body
            raise CheckpointError(f"{path}: cannot read {key} ({exc})") from None
        if _sha256(t) != self.sha[file].get(key):
            raise CheckpointError(f"{path}: checksum mismatch in {key}")
        self._checked.add((file, key))
        return t

    def _range(self, file: str, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of a tensor :meth:`get` has checked whole already."""
        try:
            return self._open[file].get(key, lo, hi)
        except Exception as exc:
            raise CheckpointError(
                f"{os.path.join(self.folder, file)}: cannot read {key} ({exc})"
            ) from None
