"""zerostack's indexed dataset against files DeepSpeed 0.19.8 wrote
(tests/fixtures/indexed_dataset/, from scripts/indexed_dataset_golden.py): it reads them as
DeepSpeed's reader does, writes the same bytes for the same builder calls, names the file it
refuses, and leaves no partial file behind."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import sys

import numpy as np
import pytest
import torch

from zerostack.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
from indexed_dataset_golden import replay  # noqa: E402  (the golden's own calls, replayed)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "indexed_dataset")
with open(os.path.join(FIXTURES, "expected.json")) as _f:
    CASES = json.load(_f)


def build(prefix: str, case: dict) -> None:
    """Replay ``case``'s builder calls (as the golden script made them) with zerostack's builder,
    merging DeepSpeed's files."""
    replay(MMapIndexedDatasetBuilder, prefix, case, FIXTURES)


def copy_case(tmp_path, name: str = "int32_docs") -> str:
    for ext in (".bin", ".idx"):
        shutil.copy(os.path.join(FIXTURES, name + ext), tmp_path / (name + ext))
    return str(tmp_path / name)


@pytest.mark.parametrize("name", sorted(CASES))
def test_reads_deepspeeds_files_as_deepspeed(name):
    want = CASES[name]["expected"]
    ds = MMapIndexedDataset(os.path.join(FIXTURES, name))
    assert len(ds) == want["len"]
    assert np.dtype(ds.dtype).name == want["dtype"]
    assert ds.sizes.dtype == np.int32 and ds.doc_idx.dtype == np.int64
    assert ds.sizes.tolist() == want["sizes"]
    assert ds.doc_idx.tolist() == want["doc_idx"]
    assert [ds[i].tolist() for i in range(len(ds))] == want["items"]
    assert all(ds[i].dtype == ds.dtype for i in range(len(ds)))
    assert [a.tolist() for a in ds[1:3]] == want["slice_1_3"]
    for i, offset, length, tokens in want["gets"]:
        assert ds.get(i, offset=offset, length=length).tolist() == tokens
    assert [a.tolist() for a in ds[:]] == want["items"]
    assert [a.tolist() for a in ds] == want["items"]  # iteration stops at the IndexError
    assert ds[np.int64(-1)].tolist() == want["items"][-1]
    assert ds.supports_prefetch is False and MMapIndexedDataset.exists(os.path.join(FIXTURES, name))


@pytest.mark.parametrize("name", sorted(CASES))
def test_builds_deepspeeds_bytes(tmp_path, name):
    build(str(tmp_path / name), CASES[name])
    for ext in (".bin", ".idx"):
        with open(tmp_path / (name + ext), "rb") as ours, open(
            os.path.join(FIXTURES, name + ext), "rb"
        ) as theirs:
            assert ours.read() == theirs.read(), f"{name}{ext} differs from DeepSpeed's"
    assert sorted(os.listdir(tmp_path)) == [f"{name}.bin", f"{name}.idx"]  # no temporary left


def test_items_are_read_only_views_that_outlive_the_dataset():
    ds = MMapIndexedDataset(os.path.join(FIXTURES, "int32_docs"), skip_warmup=True)
    item = ds[3]
    assert not item.flags.writeable
    clone = pickle.loads(pickle.dumps(ds))
    del ds
    assert item.tolist() == [0, 1, 2, 3, 4, 5] and clone[3].tolist() == item.tolist()


def test_reader_refuses_what_deepspeed_would_misread():
    ds = MMapIndexedDataset(os.path.join(FIXTURES, "int32_docs"))
    assert ds[3:3] == [] and ds[9:] == []
    with pytest.raises(ValueError, match="step 1"):
        ds[::2]
    with pytest.raises(IndexError, match="item 5 is out of range for 5 items"):
        ds[5]
    with pytest.raises(IndexError, match="item 3 holds 6 integers"):
        ds.get(3, offset=4, length=3)  # DeepSpeed reads on into the next item
    with pytest.raises(TypeError, match="int, not str"):
        ds["0"]


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize(
    "offset, data, message",
    [
        (0, b"MMIDIDY", "not an indexed dataset's index"),
        (9, struct.pack("<Q", 2), "index version 2"),
        (17, bytes([9]), "dtype code 9 is not one of"),
        (18, struct.pack("<Q", 6), "truncated: 126 bytes, but 6 items"),
    ],
)
def test_malformed_index_is_refused_naming_the_file(tmp_path, offset, data, message):
    prefix = copy_case(tmp_path)
    _patch(prefix + ".idx", offset, data)
    with pytest.raises(ValueError, match=message) as error:
        MMapIndexedDataset(prefix)
    assert str(error.value).startswith(prefix + ".idx: ")


@pytest.mark.parametrize("ext, keep", [(".idx", 20), (".idx", 120), (".bin", 44)])
def test_truncated_files_are_refused_naming_the_file(tmp_path, ext, keep):
    prefix = copy_case(tmp_path)
    os.truncate(prefix + ext, keep)
    with pytest.raises(ValueError, match=f"^{prefix}{ext}: .*(shorter|truncated)"):
        MMapIndexedDataset(prefix)


def test_failed_build_leaves_no_file_and_keeps_the_old_one(tmp_path):
    prefix = copy_case(tmp_path, "uint16_part")
    before = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}
    with pytest.raises(ValueError, match="item 1 holds values 3..70000, outside uint16's"):
        with MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16) as builder:
            builder.add_item(torch.tensor([5, 6]))
            builder.add_item(torch.tensor([3, 70000]))  # DeepSpeed writes 70000 - 65536
    assert {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)} == before


def test_abandoned_builder_removes_its_temporary(tmp_path):
    def abandon():
        builder = MMapIndexedDatasetBuilder(tmp_path / "x.bin", dtype=np.int32)
        builder.add_item([1, 2])
        assert len(os.listdir(tmp_path)) == 1  # the temporary, not x.bin

    abandon()
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="cannot hold"):
        MMapIndexedDatasetBuilder(tmp_path / "y.bin", dtype=np.float32)
    assert os.listdir(tmp_path) == []


def test_a_write_failing_part_way_aborts_the_build(tmp_path):
    builder = MMapIndexedDatasetBuilder(tmp_path / "x.bin")
    builder.add_item([1, 2, 3])
    real = builder._file

    class DiskFull:
        def write(self, data):
            real.write(data[:3])
            raise OSError(28, "No space left on device")

        def close(self):
            real.close()

    builder._file = DiskFull()
    with pytest.raises(OSError, match="No space"):
        builder.add_item([4, 5])
    assert real.closed
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="x.bin: this builder was aborted"):
        builder.finalize(tmp_path / "x.idx")
    assert os.listdir(tmp_path) == []


def test_merge_refuses_another_dtype_and_a_mismatched_bin(tmp_path):
    prefix = copy_case(tmp_path, "uint16_part")
    with MMapIndexedDatasetBuilder(tmp_path / "x.bin", dtype=np.int32) as builder:
        with pytest.raises(ValueError, match="uint16_part.idx: holds uint16; .*x.bin .* int32"):
            builder.merge_file_(prefix)
    with open(prefix + ".bin", "ab") as f:
        f.write(b"\0\0")
    with MMapIndexedDatasetBuilder(tmp_path / "x.bin", dtype=np.uint16) as builder:
        with pytest.raises(ValueError, match="uint16_part.bin: 14 bytes, but .* describes 12"):
            builder.merge_file_(prefix)
    assert sorted(os.listdir(tmp_path)) == ["uint16_part.bin", "uint16_part.idx"]
