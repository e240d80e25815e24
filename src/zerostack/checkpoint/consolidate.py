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

import torch

from .client_state import from_manifest
from .errors import CheckpointError
from .restore import open_reader

_DTYPES = {torch.float32: ("F32", 4), torch.bfloat16: ("BF16", 2)}


def consolidate(ckpt_dir: str, out: str, *, tag=None, dtype: torch.dtype = torch.float32) -> str:
    """Write the full weights (and buffers) of the checkpoint in ``ckpt_dir`` to ``out``."""
    if dtype not in _DTYPES:
        raise ValueError(f"consolidate: dtype {dtype} is not float32 or bfloat16")
    folder, reader = open_reader(ckpt_dir, tag)
    manifest = reader.manifest
    code, width = _DTYPES[dtype]
    header, offset, order = {}, 0, []
    entries = list(manifest["params"].items())
    entries += [(alias, manifest["params"][name]) for alias, name in manifest["aliases"].items()]
    for name, shape in entries:
        n = math.prod(shape)
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + n * width]}
        offset += n * width
        order.append(manifest["aliases"].get(name, name))
    buffers = {name: reader.get(file, f"buffer/{name}") for name, file in reader.buffers.items()}
    for name, t in sorted(buffers.items()):  # small: read once, kept until written
        kind = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}.get(t.dtype)
        if kind is None:
            raise CheckpointError(f"{folder}: buffer {name} has unsupported dtype {t.dtype}")
        header[name] = {
            "dtype": kind,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    header["__metadata__"] = {"format": "pt", "source": folder}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for t in (reader.full(name).to(dtype) for name in order):
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
        for _, t in sorted(buffers.items()):
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
    os.replace(tmp, out)
    return out


def full_state_dict(ckpt_dir: str, *, tag=None, exclude_frozen: bool = False) -> dict:
    """The checkpoint's full weights in memory: every parameter whole in fp32 (tp slices joined,
    tied weights under each of their names, as the module's ``state_dict``), and the buffers in
    their own dtype. ``exclude_frozen``: leave out parameters saved with
    ``requires_grad=False``. Every tensor is checked against its sha256 as it is read."""
    folder, reader = open_reader(ckpt_dir, tag)
    manifest = reader.manifest
    if exclude_frozen and "frozen" not in manifest:
        raise CheckpointError(
            f"{folder}: the manifest does not record which parameters were frozen (an older "
            f"checkpoint); save with exclude_frozen_parameters=True to leave them out"
        )
    skip = set(manifest.get("frozen", [])) if exclude_frozen else set()
    out = {name: reader.full(name) for name in manifest["params"] if name not in skip}
    for alias, name in manifest["aliases"].items():
        if name in out:
            out[alias] = out[name]
    for name, file in sorted(reader.buffers.items()):
        out[name] = reader.get(file, f"buffer/{name}")
    return out


def read_client_state(ckpt_dir: str, *, tag=None, pickled: bool = False):
    """The ``client_state`` the checkpoint was saved with, tensors checked; pickled values only
    with ``pickled`` (see :mod:`.client_state`). No engine or process group needed."""
    folder, reader = open_reader(ckpt_dir, tag)
    return from_manifest(folder, reader.manifest, pickled)
