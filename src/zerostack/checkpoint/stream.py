"""A safetensors file written tensor by tensor, so a rank's shard never sits in memory whole.

safetensors' ``save_file`` takes a dict of every tensor at once: for a rank whose masters and
optimizer state live on NVMe (or fill host memory), that is the whole state read into memory a
second time. The format itself is simple (https://huggingface.co/docs/safetensors, "Format"):

    8 bytes      N, little-endian u64
    N bytes      JSON header: {key: {"dtype": "F32", "shape": [...], "data_offsets": [b, e]}},
                 padded with spaces to a multiple of 8
    the rest     every tensor's raw bytes, back to back, at [b, e) from the header's end

The header needs only each tensor's key, dtype and shape, which a checkpoint knows before
reading a single master (:func:`~.state._write_shard` plans it), so :class:`ShardWriter`
writes the header first, then takes the tensors in the planned order, one at a time, hashing
each as it goes (the manifest's sha256). Any file it writes loads with ``safe_open``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass

import torch

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class Entry:
    """One tensor of the file: its key, dtype and shape, known before its values are read."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def raw_bytes(t: torch.Tensor) -> memoryview:
    """``t``'s bytes without a copy (a host tensor that is contiguous already is not copied)."""
    t = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())


def sha256(t: torch.Tensor) -> str:
    """The hex sha256 of a tensor's raw bytes (what the manifest records per tensor)."""
    return hashlib.sha256(raw_bytes(t)).hexdigest()


_NAMES = {code: dtype for dtype, code in _DTYPES.items()}


class FileReader:
    """Reads a safetensors file's tensors one at a time with plain reads (no memory map, so
    what was read leaves memory with the tensor and is never counted in the process's RSS)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "rb")
        (n,) = struct.unpack("<Q", self._file.read(8))
        if n > os.path.getsize(path):
            raise ValueError(f"header of {n} bytes in a {os.path.getsize(path)}-byte file")
        self.header = json.loads(self._file.read(n))
        self.header.pop("__metadata__", None)
        self._start = 8 + n

    def get(self, key: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """The tensor ``key``; with ``lo``/``hi``, only elements ``[lo, hi)`` of it, flat."""
        entry = self.header[key]
        begin, end = entry["data_offsets"]
        dtype, shape = _NAMES[entry["dtype"]], entry["shape"]
        if lo is not None:
            if not 0 <= lo <= hi <= math.prod(shape):
                raise ValueError(f"{key}: elements [{lo}, {hi}) of {math.prod(shape)}")
            begin, end, shape = begin + lo * dtype.itemsize, begin + hi * dtype.itemsize, [hi - lo]
        out = torch.empty(shape, dtype=dtype)
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if out.numel() else b""
        if end - begin != len(view):
            raise ValueError(f"{key}: {end - begin} bytes for a {len(view)}-byte tensor")
        got = os.preadv(self._file.fileno(), [view], self._start + begin) if view else 0
        if got != end - begin:
            raise ValueError(f"{key}: {got} of {end - begin} bytes (the file is truncated)")
        return out

    def close(self) -> None:
        self._file.close()


class ShardWriter:
    """Writes ``entries`` to ``path`` as one safetensors file: the header at once, then each
    tensor as :meth:`put` is handed it, in the entries' order. :meth:`close` checks that all
    came and makes the file durable; ``hashes`` has each key's sha256."""

    def __init__(self, path: str, entries: list[Entry], metadata: dict | None = None) -> None:
        """``metadata``: the header's ``__metadata__`` (str to str; Hugging Face's loaders want
        ``{"format": "pt"}``)."""
        self.path = path
        self.entries = entries
        self.hashes: dict[str, str] = {}
        header, offset = {}, 0
        for e in entries:
            if e.dtype not in _DTYPES:
                raise TypeError(f"{e.key}: dtype {e.dtype} has no safetensors name")
            if e.key in header:
                raise ValueError(f"{e.key}: listed twice")
            header[e.key] = {
                "dtype": _DTYPES[e.dtype],
                "shape": list(e.shape),
                "data_offsets": [offset, offset + e.nbytes],
            }
            offset += e.nbytes
        self.size = offset
        if metadata is not None:
            header["__metadata__"] = metadata
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._next = 0
        self._file = open(path, "wb")
        try:
            self._file.write(struct.pack("<Q", len(text)) + text)
        except OSError as exc:
            self._file.close()
            raise OSError(exc.errno, f"{self.path}: writing the header: {exc.strerror}") from exc
        self.size += 8 + len(text)

    def put(self, key: str, t: torch.Tensor) -> None:
        """The next planned tensor's values; a tensor other than the planned one is an error."""
        if self._next >= len(self.entries):
            raise ValueError(f"{self.path}: {key} is not in the plan")
        e = self.entries[self._next]
        if key != e.key or t.dtype != e.dtype or t.numel() != math.prod(e.shape):
            raise ValueError(
                f"{self.path}: got {key} ({t.dtype}, {t.numel()} elements), the plan has "
                f"{e.key} ({e.dtype}, {math.prod(e.shape)} elements) next"
            )
        data = raw_bytes(t)
        self.hashes[key] = hashlib.sha256(data).hexdigest()
        try:
            self._file.write(data)
        except OSError as exc:  # a full disk (ENOSPC), an I/O error: name the file
            raise OSError(exc.errno, f"{self.path}: writing {key}: {exc.strerror}") from exc
        self._next += 1

    def close(self) -> None:
        """Check every planned tensor came, flush and fsync."""
        try:
            if self._next != len(self.entries):
                missing = self.entries[self._next].key
                raise ValueError(f"{self.path}: {missing} and after were never written")
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            raise OSError(exc.errno, f"{self.path}: {exc.strerror}") from exc
        finally:
            self._file.close()
        got = os.path.getsize(self.path)
        if got != self.size:
            raise OSError(f"{self.path}: {got} bytes written, {self.size} expected")

    def abort(self) -> None:
        """Close without the checks (the save failed already: a second error would hide it)."""
        try:
            self._file.close()
        except OSError:
            pass
