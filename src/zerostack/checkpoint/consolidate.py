"""One safetensors state dict from a sharded checkpoint, without any distributed set-up.

    zerostack consolidate runs/ckpt model.safetensors            # fp32
    zerostack consolidate runs/ckpt model.safetensors --bf16

The output loads with plain ``model.load_state_dict(safetensors.torch.load_file(path))``. Memory
stays at one parameter plus the slices being read: the file is streamed, header first (its
offsets follow from the shapes), then each parameter assembled from its checked slices and
written. (``safetensors.torch.save_file`` would need every tensor in memory at once.)
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict

import torch

from ..tensor_parallel import join_tensors
from .state import CheckpointError, _Reader, read_manifest

_DTYPES = {torch.float32: ("F32", 4), torch.bfloat16: ("BF16", 2)}


def _assemble(reader, folder, name, shape, slices, spec, tp) -> torch.Tensor:
    """The full fp32 parameter from its saved slices (joining tp slices along their dim)."""
    ranks = [None] if spec is None else list(range(tp))
    part = list(shape)
    if spec is not None:
        part[spec[0]] //= tp
    parts = []
    for r in ranks:
        t = torch.empty(math.prod(part), dtype=torch.float32)
        covered = 0
        for src_tp, lo, hi, file in slices:
            if src_tp == r:
                key = f"master/{name}@{lo}" if r is None else f"master/{name}#tp{r}@{lo}"
                t[lo:hi].copy_(reader.get(file, key))
                covered += hi - lo
        if covered != t.numel():
            raise CheckpointError(
                f"{folder}: {name}: slices cover {covered} of {t.numel()} elements"
            )
        parts.append(t.view(part))
    if spec is None:
        return parts[0]
    return join_tensors(parts, dim=spec[0], chunks=spec[1])


def consolidate(ckpt_dir: str, out: str, *, tag=None, dtype: torch.dtype = torch.float32) -> str:
    """Write the full weights (and buffers) of the checkpoint in ``ckpt_dir`` to ``out``."""
    if dtype not in _DTYPES:
        raise ValueError(f"consolidate: dtype {dtype} is not float32 or bfloat16")
    folder, manifest = read_manifest(ckpt_dir, tag)
    reader = _Reader(folder, manifest)
    slices: dict[str, list[tuple[int | None, int, int, str]]] = defaultdict(list)
    for rec in manifest["files"]:
        for name, tp_rank, lo, hi in rec["slices"]:
            slices[name].append((tp_rank, lo, hi, rec["file"]))
    holder = {
        k: rec["file"]
        for rec in manifest["files"]
        for k in rec["sha256"]
        if k.startswith("buffer/")
    }
    buffers = sorted(holder)
    tp, specs = manifest["layout"]["tp"], manifest.get("tp_specs", {})
    code, width = _DTYPES[dtype]
    header, offset, order = {}, 0, []
    entries = list(manifest["params"].items())
    entries += [(alias, manifest["params"][name]) for alias, name in manifest["aliases"].items()]
    for name, shape in entries:
        n = math.prod(shape)
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + n * width]}
        offset += n * width
        order.append(("param", manifest["aliases"].get(name, name), shape))
    for key in buffers:
        t = reader.get(holder[key], key)
        name = key[len("buffer/") :]
        nbytes = t.numel() * t.element_size()
        kind = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}.get(t.dtype)
        if kind is None:
            raise CheckpointError(f"{folder}: buffer {name} has unsupported dtype {t.dtype}")
        header[name] = {
            "dtype": kind,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
        order.append(("buffer", key, None))
    header["__metadata__"] = {"format": "pt", "source": folder}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for kind, name, shape in order:
            if kind == "buffer":
                t = reader.get(holder[name], name)
            else:
                t = _assemble(reader, folder, name, shape, slices[name], specs.get(name), tp)
                t = t.to(dtype)
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
    os.replace(tmp, out)
    return out
