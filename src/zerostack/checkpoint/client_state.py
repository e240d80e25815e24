"""``client_state``: the user's own values saved with a checkpoint, JSON plus tensors, no pickle.

DeepSpeed pickles whatever ``save_checkpoint(client_state=...)`` holds. Here the JSON values go
into the manifest and every tensor, wherever it sits in nested dicts and lists, goes into
``client_state.safetensors`` beside it (rank 0's values, as the manifest is rank 0's), replaced
in the manifest by ``{"__tensor__": key}``; a load verifies each tensor's sha256 and puts them
back where they were::

    engine.save_checkpoint(d, client_state={"epoch": 3, "ema": {"w": ema_w}, "seen": [t1, t2]})
    _, client = engine.load_checkpoint(d)       # client["ema"]["w"] is a tensor again
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .stream import sha256

FILE = "client_state.safetensors"
MARK = "__tensor__"


class ClientStateError(ValueError):
    """client_state holds something neither JSON nor a tensor (the message is one line)."""


def split(client_state) -> tuple[object, dict[str, torch.Tensor]]:
    """``(tree, tensors)``: ``client_state`` with each tensor replaced by a marker, and the
    tensors (detached host copies) by their keys, the path to them (``ema/w``, ``seen/0``)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value, path: str):
        if isinstance(value, torch.Tensor):
            tensors[path] = value.detach().to("cpu", copy=True).contiguous()
            return {MARK: path}
        if isinstance(value, dict):
            if MARK in value:
                raise ClientStateError(f"client_state[{path!r}]: the key {MARK!r} is reserved")
            for k in value:
                if not isinstance(k, str):
                    raise ClientStateError(f"client_state[{path!r}]: key {k!r} is not a string")
            return {k: walk(v, f"{path}/{k}" if path else k) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [walk(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(value)]
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            what = f"client_state[{path!r}]" if path else "client_state"
            raise ClientStateError(f"{what}: not JSON-serialisable or a tensor ({exc})") from None
        return value

    return walk(client_state, ""), tensors


def write(folder: str, tensors: dict[str, torch.Tensor]) -> dict | None:
    """Write the tensors into ``folder`` (rank 0); the manifest's record of them, or None."""
    if not tensors:
        return None
    save_file(tensors, os.path.join(folder, FILE), metadata={"format": "pt"})
    return {"file": FILE, "sha256": {k: sha256(t) for k, t in tensors.items()}}


def join(folder: str, tree, record: dict | None):
    """``tree`` with its markers replaced by the tensors ``record`` lists, each checked."""
    if record is None:
        return tree
    from .state import CheckpointError

    path = os.path.join(folder, record["file"])
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing (the manifest lists client_state tensors)")
    tensors = {}
    with safe_open(path, framework="pt") as f:
        for key, want in record["sha256"].items():
            t = f.get_tensor(key)
            if sha256(t) != want:
                raise CheckpointError(f"{path}: client_state tensor {key!r}: checksum mismatch")
            tensors[key] = t

    def walk(value):
        if isinstance(value, dict):
            if set(value) == {MARK}:
                return tensors[value[MARK]]
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk(tree)
