"""``client_state``: the user's own values saved with a checkpoint, JSON plus tensors, no pickle.

DeepSpeed pickles whatever ``save_checkpoint(client_state=...)`` holds. Here the JSON values go
into the manifest and every tensor, wherever it sits in nested dicts and lists, goes into
``client_state.safetensors`` beside it (rank 0's values, as the manifest is rank 0's), replaced
in the manifest by ``{"__tensor__": key}``; a load verifies each tensor's sha256 and puts them
back where they were::

    engine.save_checkpoint(d, client_state={"epoch": 3, "ema": {"w": ema_w}, "seen": [t1, t2]})
    _, client = engine.load_checkpoint(d)       # client["ema"]["w"] is a tensor again

A value that is neither (an object among a Lightning module's hyper-parameters, a dict with
integer keys) is refused, naming where it is, unless the config's
``checkpoint.pickled_client_state`` is true: then such values are pickled into
``client_state.pickle`` (its sha256 in the manifest) and marked ``{"__pickled__": key}``, and a
load unpickles them only when its own config says so too. Unpickling runs code from the file.

A key is the path to the value, its parts joined by ``/`` with ``~`` written ``~0`` and ``/``
``~1`` (a JSON pointer, RFC 6901), so ``{"a/b": t}`` and ``{"a": {"b": t}}`` never collide.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import CheckpointError
from .stream import sha256

FILE = "client_state.safetensors"
PICKLE_FILE = "client_state.pickle"
MARK = "__tensor__"
PICKLED = "__pickled__"
OPT_IN = "checkpoint.pickled_client_state"


class ClientStateError(ValueError):
    """client_state holds something neither JSON nor a tensor (the message is one line)."""


@dataclasses.dataclass
class Payload:
    """What goes beside the manifest: tensors (safetensors) and, opted in, pickled values."""

    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    objects: dict[str, object] = dataclasses.field(default_factory=dict)


def _key(path: str, part) -> str:
    part = str(part).replace("~", "~0").replace("/", "~1")
    return f"{path}/{part}" if path else part


def split(client_state, pickled: bool = False) -> tuple[object, Payload]:
    """``(tree, payload)``: ``client_state`` with each tensor (and, with ``pickled``, each value
    JSON cannot hold) replaced by a marker, and those values (tensors as detached host copies)
    by their keys."""
    out = Payload()

    def keep(value, path: str, why: str):
        where = f"client_state[{path!r}]" if path else "client_state"
        if not pickled:
            raise ClientStateError(
                f"{where}: {why}; store it as JSON or tensors, or set {OPT_IN}: true to pickle it"
            )
        out.objects[path] = value
        return {PICKLED: path}

    def walk(value, path: str):
        if isinstance(value, torch.Tensor):
            out.tensors[path] = value.detach().to("cpu", copy=True).contiguous()
            return {MARK: path}
        if isinstance(value, dict):
            for k in value:
                if not isinstance(k, str):
                    return keep(value, path, f"key {k!r} is not a string")
                if k in (MARK, PICKLED):
                    raise ClientStateError(f"client_state[{path!r}]: the key {k!r} is reserved")
            return {k: walk(v, _key(path, k)) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [walk(v, _key(path, i)) for i, v in enumerate(value)]
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            return keep(value, path, f"not JSON-serialisable or a tensor ({exc})")
        return value

    return walk(client_state, ""), out


def write(folder: str, payload: Payload) -> dict | None:
    """Write the payload into ``folder`` (rank 0); the manifest's record of it, or None."""
    record: dict = {}
    if payload.tensors:
        save_file(payload.tensors, os.path.join(folder, FILE), metadata={"format": "pt"})
        record.update(file=FILE, sha256={k: sha256(t) for k, t in payload.tensors.items()})
    if payload.objects:
        blob = pickle.dumps(payload.objects, protocol=pickle.HIGHEST_PROTOCOL)
        with open(os.path.join(folder, PICKLE_FILE), "wb") as f:
            f.write(blob)
        record["pickled"] = {"file": PICKLE_FILE, "sha256": _digest(blob)}
    return record or None


def _digest(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def from_manifest(folder: str, manifest: dict, pickled: bool = False):
    """The client state a checkpoint's manifest records, its values read back and checked."""
    return join(folder, manifest["client_state"], manifest.get("client_tensors"), pickled)


def join(folder: str, tree, record: dict | None, pickled: bool = False):
    """``tree`` with its markers replaced by the values ``record`` lists, each checked; pickled
    values only with ``pickled`` (the loading config's opt-in), else a one-line refusal."""
    if record is None:
        return tree
    tensors: dict[str, torch.Tensor] = {}
    if "sha256" in record:
        path = os.path.join(folder, record["file"])
        if not os.path.exists(path):
            raise CheckpointError(f"{path}: missing (the manifest lists client_state tensors)")
        with safe_open(path, framework="pt") as f:
            for key, want in record["sha256"].items():
                t = f.get_tensor(key)
                if sha256(t) != want:
                    raise CheckpointError(f"{path}: client_state tensor {key!r}: checksum mismatch")
                tensors[key] = t
    objects: dict = {}
    if "pickled" in record:
        path = os.path.join(folder, record["pickled"]["file"])
        if not pickled:
            raise CheckpointError(
                f"{path}: client_state holds pickled values and unpickling runs code from the "
                f"file; set {OPT_IN}: true to load them (only for checkpoints you trust)"
            )
        if not os.path.exists(path):
            raise CheckpointError(f"{path}: missing (the manifest lists pickled client_state)")
        with open(path, "rb") as f:
            blob = f.read()
        if _digest(blob) != record["pickled"]["sha256"]:
            raise CheckpointError(f"{path}: checksum mismatch")
        objects = pickle.loads(blob)

    def walk(value):
        if isinstance(value, dict):
            if set(value) == {MARK}:
                return tensors[value[MARK]]
            if set(value) == {PICKLED}:
                return objects[value[PICKLED]]
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk(tree)
