"""Megatron's indexed dataset: samples of integers in a ``.bin`` file, located by an ``.idx`` file.

Megatron's GPT data pipeline keeps a tokenized corpus this way, and DeepSpeed's data-efficiency
tools (``DataAnalyzer``, the curriculum sampler) keep one metric or one list of sample ids per
row the same way. :class:`MMapIndexedDataset` reads such a pair without loading it: both files
are memory-mapped and a sample is a read-only numpy view of the mapping.
:class:`MMapIndexedDatasetBuilder` writes a pair, byte for byte what DeepSpeed's builder writes
for the same items, and atomically (nothing appears under the output names until ``finalize``)::

    builder = MMapIndexedDatasetBuilder("corpus.bin", dtype=np.uint16)
    for document in documents:
        for sentence in document:
            builder.add_item(torch.tensor(sentence))
        builder.end_document()
    builder.finalize("corpus.idx")

    corpus = MMapIndexedDataset("corpus")        # the prefix both names share
    corpus[0], corpus[1:3], corpus.get(0, offset=2, length=4), corpus.sizes, corpus.doc_idx

The ``.idx`` file, every integer little-endian:

    magic           9 bytes, ``MMIDIDX\\x00\\x00``
    version         uint64, always 1
    dtype code      uint8, a key of :data:`DTYPES`: the numpy type of the ``.bin``'s integers
    item count n    uint64
    doc count d     uint64: the length of the document index
    sizes           n int32: the integers in each item
    pointers        n int64: the byte offset of each item in the ``.bin``
    document index  d int64: 0, then the item count at each ``end_document()``

The ``.bin`` file is the items' integers back to back, with no header.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import secrets
import shutil
import struct

import numpy as np
import torch

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, item count, doc-index length
_WARMUP_CHUNK = 64 << 20

DTYPES: dict[int, type[np.generic]] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
    6: np.uint16, 7: np.uint32, 8: np.uint64,
}
"""The ``.idx`` header's dtype codes (Megatron's and DeepSpeed's table, which files depend on)."""

_TORCH_DTYPES = {
    torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16,
    torch.int32: np.int32, torch.int64: np.int64,
}


def dtype_code(dtype) -> int:
    """The header code of ``dtype`` (a numpy type or dtype, a torch dtype, or a name like
    ``"uint16"``). ValueError for a type the format has no code for (floats, None)."""
    wanted = _TORCH_DTYPES.get(dtype) if isinstance(dtype, torch.dtype) else dtype
    if wanted is not None:
        with contextlib.suppress(TypeError):
            wanted = np.dtype(wanted)
            for code, known in DTYPES.items():
                if np.dtype(known) == wanted:
                    return code
    names = ", ".join(np.dtype(t).name for t in DTYPES.values())
    raise ValueError(f"an indexed dataset cannot hold {dtype!r}: its types are {names}")


def index_file_path(prefix) -> str:
    return os.fspath(prefix) + ".idx"


def data_file_path(prefix) -> str:
    return os.fspath(prefix) + ".bin"


def _map(path: str, warmup: bool) -> np.ndarray:
    """``path``'s bytes, memory-mapped read-only (an empty file, which mmap refuses, as no bytes).

    ``warmup`` first reads the file through once, so the page cache holds it before training
    touches samples at random (what ``skip_warmup=False`` asks for)."""
    if warmup:
        with open(path, "rb") as stream:
            while stream.read(_WARMUP_CHUNK):
                pass
    if os.path.getsize(path) == 0:
        return np.empty(0, np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")


_Index = tuple[type[np.generic], np.ndarray, np.ndarray, np.ndarray]


def _read_index(path: str, warmup: bool) -> _Index:
    """The dtype, sizes, pointers and document index of the ``.idx`` file at ``path``, checked
    against its header (views of the mapping, not copies)."""
    mapped = _map(path, warmup)
    if len(mapped) < _HEADER.size:
        raise ValueError(f"{path}: {len(mapped)} bytes, shorter than an index header")
    magic, version, code, count, docs = _HEADER.unpack_from(mapped)
    if magic != MAGIC:
        raise ValueError(f"{path}: not an indexed dataset's index (magic {magic!r}, not {MAGIC!r})")
    if version != VERSION:
        raise ValueError(f"{path}: index version {version}; only version {VERSION} is known")
    if code not in DTYPES:
        raise ValueError(f"{path}: dtype code {code} is not one of {sorted(DTYPES)}")
    needed = _HEADER.size + 12 * count + 8 * docs
    if len(mapped) < needed:
        raise ValueError(
            f"{path}: truncated: {len(mapped)} bytes, but {count} items and {docs} document "
            f"boundaries need {needed}"
        )
    start = _HEADER.size
    sizes = np.frombuffer(mapped, np.dtype("<i4"), count, start)
    pointers = np.frombuffer(mapped, np.dtype("<i8"), count, start + 4 * count)
    doc_idx = np.frombuffer(mapped, np.dtype("<i8"), docs, start + 12 * count)
    return DTYPES[code], sizes, pointers, doc_idx


class MMapIndexedDataset(torch.utils.data.Dataset):
    """The indexed dataset at ``path_prefix`` (``<prefix>.idx`` and ``<prefix>.bin``), mapped.

    ``ds[i]`` is item ``i``'s integers, a read-only numpy array over the mapping (``np.copy`` it
    to modify it); ``ds[a:b]`` is a list of them; ``ds.get(i, offset, length)`` is part of one.
    ``sizes`` and ``doc_idx`` are the index's arrays. A malformed or truncated file raises
    ValueError naming it. Pickling keeps the prefix only: a data-loader worker maps the files
    again instead of receiving their bytes.
    """

    def __init__(self, path_prefix, skip_warmup: bool = False) -> None:
        super().__init__()
        self._open(os.fspath(path_prefix), skip_warmup)

    def _open(self, prefix: str, skip_warmup: bool) -> None:
        self._prefix = prefix
        index_path, data_path = index_file_path(prefix), data_file_path(prefix)
        self._dtype, self._sizes, self._pointers, self._doc_idx = _read_index(
            index_path, not skip_warmup
        )
        self._data = _map(data_path, not skip_warmup)
        self._itemsize = np.dtype(self._dtype).itemsize
        if len(self._sizes):  # items are stored in order, so the last one ends the data
            end = int(self._pointers[-1]) + int(self._sizes[-1]) * self._itemsize
            if len(self._data) < end:
                raise ValueError(
                    f"{data_path}: truncated: {len(self._data)} bytes, but {index_path} "
                    f"places its last item's end at byte {end}"
                )

    def __getstate__(self) -> str:
        return self._prefix

    def __setstate__(self, prefix: str) -> None:
        self._open(prefix, skip_warmup=True)

    def __len__(self) -> int:
        return len(self._sizes)

    def __getitem__(self, idx):
        """Item ``idx``'s integers; for a slice (step 1), a list of the items'."""
        if isinstance(idx, slice):
            return self._slice(idx)
        i = self._position(idx)
        return self._read(int(self._pointers[i]), int(self._sizes[i]))

    def get(self, idx, offset: int = 0, length: int | None = None) -> np.ndarray:
        """``length`` integers of item ``idx`` from its ``offset``-th (to its end when None).

        ``get(i)`` is ``ds[i]``; a range outside the item raises IndexError."""
        i = self._position(idx)
        size = int(self._sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"{self._prefix}: item {i} holds {size} integers; get(offset={offset}, "
                f"length={length}) reaches outside it"
            )
        return self._read(int(self._pointers[i]) + offset * self._itemsize, length)

    def _position(self, idx) -> int:
        if not isinstance(idx, numbers.Integral):
            raise TypeError(f"{self._prefix}: an item index is an int, not {type(idx).__name__}")
        i = int(idx) + (len(self) if idx < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(f"{self._prefix}: item {idx} is out of range for {len(self)} items")
        return i

    def _slice(self, idx: slice) -> list[np.ndarray]:
        start, stop, step = idx.indices(len(self))
        if step != 1:
            raise ValueError(f"{self._prefix}: a slice of the dataset takes step 1, not {step}")
        if start >= stop:
            return []
        sizes = self._sizes[start:stop]
        joined = self._read(int(self._pointers[start]), int(sizes.sum()))
        return np.split(joined, np.cumsum(sizes)[:-1])

    def _read(self, byte_offset: int, count: int) -> np.ndarray:
        return np.frombuffer(self._data, self._dtype, count, byte_offset)

    @property
    def sizes(self) -> np.ndarray:
        """The integers in each item (int32)."""
        return self._sizes

    def size(self, index: int) -> int:
        """The integers in item ``index``."""
        return int(self._sizes[index])

    @property
    def doc_idx(self) -> np.ndarray:
        """0, then the item that follows each document (int64)."""
        return self._doc_idx

    def get_doc_idx(self) -> np.ndarray:  # Megatron's name
        return self._doc_idx

    def set_doc_idx(self, doc_idx: np.ndarray) -> None:
        """Replace the document index in memory (Megatron's dataset splits do; the file is kept)."""
        self._doc_idx = doc_idx

    @property
    def dtype(self) -> type[np.generic]:
        """The numpy type of the items' integers, e.g. ``np.uint16``."""
        return self._dtype

    @property
    def supports_prefetch(self) -> bool:
        return False

    @staticmethod
    def exists(path) -> bool:
        """Whether both files of the dataset at prefix ``path`` exist."""
        return os.path.exists(index_file_path(path)) and os.path.exists(data_file_path(path))


def _temporary_beside(path: str) -> str:
    """A fresh name in ``path``'s folder, so that ``os.replace`` onto ``path`` is a rename."""
    return f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def _write_index(stream, dtype: type[np.generic], sizes: list[int], doc_idx: list[int]) -> None:
    nbytes = np.array(sizes, dtype=np.int64) * np.dtype(dtype).itemsize
    stream.write(_HEADER.pack(MAGIC, VERSION, dtype_code(dtype), len(sizes), len(doc_idx)))
    stream.write(np.array(sizes, dtype="<i4").tobytes())
    stream.write((np.cumsum(nbytes) - nbytes).astype("<i8").tobytes())  # each item's start
    stream.write(np.array(doc_idx, dtype="<i8").tobytes())


class MMapIndexedDatasetBuilder:
    """Writes an indexed dataset: ``add_item`` per sample, ``end_document`` after each document,
    ``merge_file_`` to append another dataset, then ``finalize(index_file)``.

    The data goes to a temporary file beside ``out_file``; ``finalize`` writes the index the same
    way and renames both into place (the ``.bin`` first). A build that fails or is abandoned
    (``abort()``, an exception in a ``with`` block, the builder collected before ``finalize``)
    deletes its temporary file and leaves ``out_file`` as it was. Items are cast to ``dtype``;
    one whose values do not fit it raises ValueError and is not written.
    """

    def __init__(self, out_file, dtype=np.int64) -> None:
        self._file = None
        self._dtype = DTYPES[dtype_code(dtype)]
        self._out = os.fspath(out_file)
        self._tmp = _temporary_beside(self._out)
        self._file = open(self._tmp, "xb")  # open until finalize or abort
        self._state = "open"
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]

    def __enter__(self) -> MMapIndexedDatasetBuilder:
        return self

    def __exit__(self, *exc) -> None:
        self.abort()  # after finalize this does nothing; otherwise the build is incomplete

    def __del__(self) -> None:
        if self._file is not None:  # abandoned before finalize
            self.abort()

    def add_item(self, tensor) -> None:
        """Append one item: a tensor, array or list of integers (flattened in C order)."""
        array = self._cast(tensor)
        self._guarded(self._file.write, array.tobytes(order="C"))
        self._sizes.append(array.size)

    add_item_numpy = add_item

    def add_items(self, arr_list) -> None:
        """Append several items; if one does not fit ``dtype``, none is written."""
        arrays = [self._cast(a) for a in arr_list]
        self._guarded(self._file.write, b"".join(a.tobytes(order="C") for a in arrays))
        self._sizes.extend(a.size for a in arrays)

    def end_document(self) -> None:
        """Close the current document: the items since the last call form one."""
        self._check_open()
        self._doc_idx.append(len(self._sizes))

    def merge_file_(self, another_file) -> None:
        """Append the finished dataset at prefix ``another_file``: its items and its documents.

        Its dtype must be this builder's, and its ``.bin`` exactly the size its index describes
        (extra bytes would shift every later item)."""
        self._check_open()
        index_path, data_path = index_file_path(another_file), data_file_path(another_file)
        dtype, sizes, _, doc_idx = _read_index(index_path, warmup=False)
        if np.dtype(dtype) != np.dtype(self._dtype):
            raise ValueError(
                f"{index_path}: holds {np.dtype(dtype).name}; {self._out} is being written "
                f"as {np.dtype(self._dtype).name}"
            )
        expected = int(sizes.sum(dtype=np.int64)) * np.dtype(dtype).itemsize
        if os.path.getsize(data_path) != expected:
            raise ValueError(
                f"{data_path}: {os.path.getsize(data_path)} bytes, but {index_path} describes "
                f"{expected}"
            )
        offset = len(self._sizes)
        with open(data_path, "rb") as source:
            self._guarded(shutil.copyfileobj, source, self._file)
        self._sizes.extend(sizes.tolist())
        self._doc_idx.extend((doc_idx[1:] + offset).tolist())

    def finalize(self, index_file) -> None:
        """Write the index to ``index_file`` and move both files into place."""
        self._check_open()
        index_path = os.fspath(index_file)
        index_tmp = _temporary_beside(index_path)
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            with open(index_tmp, "xb") as stream:
                _write_index(stream, self._dtype, self._sizes, self._doc_idx)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(self._tmp, self._out)
            os.replace(index_tmp, index_path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(index_tmp)
            self.abort()
            raise
        self._file, self._state = None, "finalized"

    def abort(self) -> None:
        """Give the build up: delete the temporary data file. Does nothing once finalized."""
        if self._file is None:
            return
        self._file.close()
        self._file, self._state = None, "aborted"
        try:
            os.remove(self._tmp)
        except FileNotFoundError:
            pass

    def _check_open(self) -> None:
        if self._file is None:
            raise RuntimeError(f"{self._out}: this builder was {self._state}; start a new one")

    def _guarded(self, write, *args) -> None:
        """Run one write to the data file; one that fails part way aborts the build, since the
        file may hold part of an item the index would not describe."""
        self._check_open()
        try:
            write(*args)
        except BaseException:
            self.abort()
            raise

    def _cast(self, values) -> np.ndarray:
        """``values`` as an array of the builder's dtype, refusing values the cast would wrap."""
        self._check_open()
        if isinstance(values, torch.Tensor):
            values = values.detach().cpu().numpy()
        array = np.asarray(values)
        if array.dtype == self._dtype:
            return array
        item = f"{self._out}: item {len(self._sizes)}"
        if array.dtype.kind not in "biuf":
            raise ValueError(f"{item} holds {array.dtype}, not numbers")
        if array.size and array.dtype.kind != "b":
            info, low, high = np.iinfo(self._dtype), array.min(), array.max()
            if not (np.isfinite([low, high]).all() and info.min <= low and high <= info.max):
                raise ValueError(
                    f"{item} holds values {low}..{high}, outside {info.dtype.name}'s "
                    f"{info.min}..{info.max}"
                )
        return array.astype(self._dtype)
