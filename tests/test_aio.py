"""DeepNVMe's handles (``deepspeed.ops.op_builder``: ``AsyncIOBuilder().load().aio_handle()``,
served by :mod:`zerostack.zero.offload.aio`): tensors written and read back, sync and async, at
offsets, with DeepSpeed 0.19.8's return values and refusals; and the DeepNVMe tutorial's own
snippets, copied verbatim below and run as doctests."""

from __future__ import annotations

import doctest
import errno
import inspect
import os
from pathlib import Path

import pytest
import torch

import zerostack.compat.deepspeed as deepspeed
from zerostack.compat.deepspeed.ops.op_builder import AsyncIOBuilder, GDSBuilder, PinMemoryBuilder
from zerostack.zero.offload.aio import AioHandle

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8]
DTYPES.append(torch.bool)


def _random(numel: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(numel).to(dtype)
    if dtype == torch.bool:
        return torch.rand(numel) > 0.5
    return torch.randint(0, 250, (numel,), dtype=dtype)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parallelism, numel", [(1, 1), (1, 7), (1, 1001), (3, 1011)])
def test_sync_write_then_read_back(tmp_path, dtype, parallelism, numel):
    torch.manual_seed(numel)
    h = AsyncIOBuilder().load().aio_handle(intra_op_parallelism=parallelism)
    t, path = _random(numel, dtype), str(tmp_path / "t.bin")
    assert h.sync_pwrite(t, path) == 1
    assert Path(path).read_bytes() == _raw(t)
    back = torch.empty_like(t)
    assert h.sync_pread(back, path) == 1
    assert torch.equal(back, t)


@pytest.mark.parametrize("parallelism", [1, 2])
def test_offsets_place_and_find_each_tensor(tmp_path, parallelism):
    torch.manual_seed(0)
    h = AioHandle(intra_op_parallelism=parallelism)
    path = str(tmp_path / "packed.bin")
    a, b = _random(6, torch.float32), _random(10, torch.float16)
    hole = 64  # written past the end: the gap reads as zeros
    assert h.sync_pwrite(a, path, 0) == 1
    assert h.sync_pwrite(b, path, file_offset=a.nbytes + hole) == 1
    assert Path(path).read_bytes() == _raw(a) + bytes(hole) + _raw(b)
    got_b = torch.empty_like(b)
    assert h.sync_pread(got_b, path, a.nbytes + hole) == 1
    assert torch.equal(got_b, b)
    got_a = torch.empty_like(a)
    assert h.async_pread(got_a, path, file_offset=0) == 0
    assert h.wait() == 1 and torch.equal(got_a, a)
    assert h.sync_pwrite(b[:4], path, 2) == 1  # no truncation: the rest of the file stays
    rest = _raw(a)[10:] + bytes(hole) + _raw(b)
    assert Path(path).read_bytes() == _raw(a)[:2] + _raw(b[:4]) + rest


def test_several_requests_in_flight_then_one_wait(tmp_path):
    torch.manual_seed(1)
    h = AioHandle(intra_op_parallelism=4)
    tensors = [_random(4 * (n + 1) * 257, dtype) for n, dtype in enumerate(DTYPES)]
    paths = [str(tmp_path / f"{n}.bin") for n in range(len(tensors))]
    assert [h.async_pwrite(t, p) for t, p in zip(tensors, paths, strict=True)] == [0] * 7
    assert h.wait() == len(tensors)
    backs = [torch.empty_like(t) for t in tensors]
    assert [h.async_pread(b, p) for b, p in zip(backs, paths, strict=True)] == [0] * 7
    assert h.wait() == len(tensors)
    assert all(torch.equal(b, t) for b, t in zip(backs, tensors, strict=True))
    assert h.wait() == 0  # nothing in flight (DeepSpeed asserts there)


def test_a_sync_call_also_completes_what_is_in_flight(tmp_path):
    """DeepSpeed's sync calls submit and then wait for everything: their count includes the
    async requests before them."""
    h, t = AioHandle(), torch.arange(8)
    h.async_pwrite(t, str(tmp_path / "a")), h.async_pwrite(t, str(tmp_path / "b"))
    assert h.sync_pwrite(t, str(tmp_path / "c")) == 3
    assert h.wait() == 0


def test_parallel_and_single_calls_with_validate(tmp_path):
    h, t, path = AioHandle(intra_op_parallelism=2), torch.arange(10.0), str(tmp_path / "t")
    assert h.pwrite(t, path, True, False) == 1  # positional (validate, async) as DeepSpeed's
    assert h.pwrite(t, path, False, True, 0) == 0 and h.wait() == 1
    back = torch.zeros(10)
    assert h.pread(back, path, True, False) == 1 and torch.equal(back, t)
    assert h.write(t * 2, path, False) == 0  # DeepSpeed's non-parallel calls return 0
    assert h.read(back, path, True) == 0 and torch.equal(back, t * 2)


def test_write_through_an_open_descriptor(tmp_path):
    """``async_pwrite(buffer, fd, file_offset)``, as ``deepspeed.io``'s writers call it: the
    descriptor stays open."""
    h, t = AioHandle(), torch.arange(6, dtype=torch.int32)
    fd = os.open(tmp_path / "fd.bin", os.O_RDWR | os.O_CREAT, 0o600)
    assert h.async_pwrite(t, fd, 4) == 0 and h.wait() == 1
    os.close(fd)  # raises if the handle had closed it
    assert (tmp_path / "fd.bin").read_bytes() == bytes(4) + _raw(t)


def test_a_short_file_is_refused_naming_it(tmp_path):
    h, path = AioHandle(), str(tmp_path / "short.bin")
    h.sync_pwrite(torch.zeros(3), path)  # 12 bytes
    with pytest.raises(OSError, match=r"file_offset \+ buffer nbytes > file bytes: 16 > 12") as e:
        h.sync_pread(torch.empty(4), path)
    assert e.value.filename == path and path in str(e.value)
    with pytest.raises(OSError, match="short.bin"):
        h.async_pread(torch.empty(2), path, 8)  # 8 + 8 > 12: refused before it is queued
    assert h.wait() == 0
    with pytest.raises(OSError, match="file is 12 bytes, buffer 16"):
        h.read(torch.empty(4), path, False)
    with pytest.raises(FileNotFoundError):
        h.sync_pread(torch.empty(1), str(tmp_path / "missing.bin"))


def test_a_read_into_a_non_contiguous_tensor_is_refused(tmp_path):
    h, path = AioHandle(), str(tmp_path / "t.bin")
    grid = torch.arange(20.0).reshape(4, 5)
    assert h.sync_pwrite(grid.t(), path) == 1  # a write copies: DeepSpeed's does too
    assert Path(path).read_bytes() == _raw(grid.t())
    with pytest.raises(ValueError, match="not contiguous"):
        h.sync_pread(torch.empty(5, 4).t(), path)
    with pytest.raises(ValueError, match="not contiguous"):
        h.async_pread(torch.empty(10, 4)[::2], path)


def test_sizes_must_divide_by_the_parallelism(tmp_path):
    h = AioHandle(intra_op_parallelism=4)
    with pytest.raises(ValueError, match="7 bytes are not divisible by intra_op_parallelism = 4"):
        h.sync_pwrite(torch.zeros(7, dtype=torch.uint8), str(tmp_path / "t"))


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_failed_transfer_is_raised_by_wait_naming_the_file(tmp_path):
    h, ok = AioHandle(intra_op_parallelism=2), str(tmp_path / "ok.bin")
    h.async_pwrite(torch.ones(4), "/dev/full"), h.async_pwrite(torch.ones(4), ok)
    with pytest.raises(OSError) as e:
        h.wait()
    assert e.value.errno == errno.ENOSPC and e.value.filename == "/dev/full"
    assert Path(ok).read_bytes() == _raw(torch.ones(4))  # the other request still finished
    assert h.wait() == 0


def test_handle_settings_and_locked_tensors():
    h = AioHandle(4096, 8, True, True, 3)
    got = [h.get_block_size(), h.get_queue_depth(), h.get_single_submit()]
    got += [h.get_overlap_events(), h.get_intra_op_parallelism()]
    assert got == [4096, 8, True, True, 3]
    assert h.get_alignment() == 3 * 512
    t = h.new_cpu_locked_tensor(100, torch.empty(0, dtype=torch.bfloat16))
    assert t.shape == (100,) and t.dtype == torch.bfloat16 and t.device.type == "cpu"
    assert t.is_pinned() == torch.cuda.is_available()  # page-locked only where CUDA is
    assert h.is_pinned(t) and h.is_pinned(t[10:20])
    assert not h.is_pinned(torch.empty(100))
    other = AioHandle()  # one process-wide registry, as DeepSpeed's pin manager
    assert other.free_cpu_locked_tensor(t) is True
    assert h.free_cpu_locked_tensor(t) is False


def test_builders_as_deepspeeds():
    assert deepspeed.ops.op_builder.AsyncIOBuilder is AsyncIOBuilder
    aio = AsyncIOBuilder()
    assert [aio.NAME, aio.BUILD_VAR] == ["async_io", "DS_BUILD_AIO"]
    assert aio.absolute_name() == "deepspeed.ops.aio.async_io_op"
    assert aio.is_compatible() and aio.load() is AsyncIOBuilder().load()
    assert isinstance(aio.load().aio_handle(), AioHandle)
    pin = PinMemoryBuilder().load().pin_handle()
    assert pin.is_pinned(pin.new_cpu_locked_tensor(3, torch.empty(0)))
    gds = GDSBuilder()
    assert gds.is_compatible() == torch.cuda.is_available()
    if not torch.cuda.is_available():
        why = "Unable to JIT load the gds op due to it not being compatible due to hardware"
        with pytest.raises(RuntimeError, match=why):
            gds.load()


# -- the DeepNVMe tutorial (docs/_tutorials/deepnvme.md), its snippets copied verbatim ---------


PRINTED = {"sync_pwrite": "1", "async_pwrite": "0", "pin_device_tensor": "True"}
PRINTED["unpin_device_tensor"] = "True"


def _adapted(block: str, folder) -> str:
    """The snippet with the tutorial's NVMe path replaced by ``folder``, 1 GiB by 1 MiB,
    ``deepspeed`` by its zerostack name, and without a GPU, ``.cuda()`` / ``.pin_memory()``
    dropped (host tensors). The calls in ``PRINTED`` return a value in DeepSpeed 0.19.8, which
    a REPL prints: the tutorial's transcripts leave it out, so it is put in."""
    lines = []
    for line in block.splitlines():
        lines.append(line)
        call = line.removeprefix(">>> h.").split("(")[0]
        if line.startswith(">>> h.") and call in PRINTED:
            lines.append(PRINTED[call])
    out = "\n".join(lines) + "\n"
    out = out.replace("/local_nvme/", f"{folder}/").replace("1024**3", "1024**2")
    out = out.replace("1073741824", str(1024**2))
    out = out.replace("from deepspeed.", "from zerostack.compat.deepspeed.")
    if not torch.cuda.is_available():
        out = out.replace(".cuda()", "").replace(".pin_memory()", "")
    return out


def _run_transcript(block: str, folder) -> None:
    parser = doctest.DocTestParser()
    test = parser.get_doctest(_adapted(block, folder), {"torch": torch}, "deepnvme.md", None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    assert runner.failures == 0 and runner.tries > 0


TRANSCRIPTS = ["BLOCKING_WRITE", "NON_BLOCKING_WRITE", "DATA_RACE", "PARALLEL_WRITE"]
TRANSCRIPTS += ["PINNED_WRITE", "PIN_MEMORY"]


@pytest.mark.parametrize("block", TRANSCRIPTS)
def test_the_tutorials_transcripts(tmp_path, block):
    _run_transcript(globals()[block], tmp_path)


def test_the_tutorials_gds_transcript(tmp_path):
    if GDSBuilder().is_compatible():  # GPU tensors through host memory: no cuFile here
        exec(_adapted(CREATE_GDS, tmp_path), {})
        return _run_transcript(GDS_WRITE, tmp_path)
    with pytest.raises(RuntimeError, match="Unable to JIT load the gds op"):
        exec(_adapted(CREATE_GDS, tmp_path), {})


def test_the_tutorials_handle_creation_and_api_listing(tmp_path):
    scope: dict = {}
    exec(_adapted(CREATE_AIO, tmp_path), scope)
    listed = {w[2:-1] for w in TAB_COMPLETION.split() if w.startswith("h.") and w.endswith("(")}
    assert len(listed) == 16 and [n for n in listed if not hasattr(scope["aio_handle"], n)] == []
    code = _adapted(ADVANCED_CREATE, tmp_path).replace(">>> ", "")
    exec(code, scope)
    h = scope["h"]
    got = [h.get_queue_depth(), h.get_overlap_events(), h.get_intra_op_parallelism()]
    assert got == [32, True, 8]
    params = inspect.signature(AioHandle).parameters.values()  # help()'s names and defaults
    shown = ", ".join(f"{p.name}: {p.annotation} = {p.default!r}" for p in params)
    assert HELP_INIT == f"__init__(self: async_io.aio_handle, {shown}) -> None"


CREATE_AIO = """\
### Create aio_handle
from deepspeed.ops.op_builder import AsyncIOBuilder
aio_handle = AsyncIOBuilder().load().aio_handle()
"""

CREATE_GDS = """\
### Create gds_handle
from deepspeed.ops.op_builder import GDSBuilder
gds_handle = GDSBuilder().load().gds_handle()
"""

TAB_COMPLETION = """\
>python
Python 3.10.12 (main, Jul 29 2024, 16:56:48) [GCC 11.4.0] on linux
Type "help", "copyright", "credits" or "license" for more information.
>>> from deepspeed.ops.op_builder import AsyncIOBuilder
>>> h = AsyncIOBuilder().load().aio_handle()
>>> h.
h.async_pread(             h.free_cpu_locked_tensor(  h.get_overlap_events(      h.get_single_submit(       h.new_cpu_locked_tensor(   h.pwrite(                  h.sync_pread(              h.wait(
h.async_pwrite(            h.get_block_size(          h.get_queue_depth(         h.get_intra_op_parallelism(        h.pread(                   h.read(                    h.sync_pwrite(             h.write(
"""  # noqa: E501

BLOCKING_WRITE = """\
>>> import os
>>> os.path.isfile('/local_nvme/test_1GB.pt')
False
>>> import torch
>>> t=torch.empty(1024**3, dtype=torch.uint8).cuda()
>>> from deepspeed.ops.op_builder import AsyncIOBuilder
>>> h = AsyncIOBuilder().load().aio_handle()
>>> h.sync_pwrite(t,'/local_nvme/test_1GB.pt')
>>> os.path.isfile('/local_nvme/test_1GB.pt')
True
>>> os.path.getsize('/local_nvme/test_1GB.pt')
1073741824

"""

NON_BLOCKING_WRITE = """\
>>> import os
>>> os.path.isfile('/local_nvme/test_1GB.pt')
False
>>> import torch
>>> t=torch.empty(1024**3, dtype=torch.uint8).cuda()
>>> from deepspeed.ops.op_builder import AsyncIOBuilder
>>> h = AsyncIOBuilder().load().aio_handle()
>>> h.async_pwrite(t,'/local_nvme/test_1GB.pt')
>>> h.wait()
1
>>> os.path.isfile('/local_nvme/test_1GB.pt')
True
>>> os.path.getsize('/local_nvme/test_1GB.pt')
1073741824
"""

DATA_RACE = """\
>>> t=torch.empty(1024**3, dtype=torch.uint8).cuda()
>>> from deepspeed.ops.op_builder import AsyncIOBuilder
>>> h = AsyncIOBuilder().load().aio_handle()
>>> h.async_pwrite(t,'/local_nvme/test_1GB.pt')
>>> t += 1 # <--- Data race; avoid by preceding with `h.wait()`
"""

PARALLEL_WRITE = """\
>>> import os
>>> os.path.isfile('/local_nvme/test_1GB.pt')
False
>>> import torch
>>> t=torch.empty(1024**3, dtype=torch.uint8).cuda()
>>> from deepspeed.ops.op_builder import AsyncIOBuilder
>>> h = AsyncIOBuilder().load().aio_handle(intra_op_parallelism=4)
>>> h.async_pwrite(t,'/local_nvme/test_1GB.pt')
>>> h.wait()
1
>>> os.path.isfile('/local_nvme/test_1GB.pt')
True
>>> os.path.getsize('/local_nvme/test_1GB.pt')
1073741824
"""

PINNED_WRITE = """\
>>> import os
>>> os.path.isfile('/local_nvme/test_1GB.pt')
False
>>> import torch
>>> t=torch.empty(1024**3, dtype=torch.uint8).pin_memory()
>>> from deepspeed.ops.op_builder import AsyncIOBuilder
>>> h = AsyncIOBuilder().load().aio_handle()
>>> h.async_pwrite(t,'/local_nvme/test_1GB.pt')
>>> h.wait()
1
>>> os.path.isfile('/local_nvme/test_1GB.pt')
True
>>> os.path.getsize('/local_nvme/test_1GB.pt')
1073741824
"""

PIN_MEMORY = """\
>>> import torch
>>> from deepspeed.ops.op_builder import PinMemoryBuilder
>>> pin = PinMemoryBuilder().load().pin_handle()
>>> t = pin.new_cpu_locked_tensor(1024**3, torch.empty(0, dtype=torch.uint8))
>>> pin.is_pinned(t)
True
>>> pin.free_cpu_locked_tensor(t)
True
"""

GDS_WRITE = """\
>>> import os
>>> os.path.isfile('/local_nvme/test_1GB.pt')
False
>>> import torch
>>> t=torch.empty(1024**3, dtype=torch.uint8).cuda()
>>> from deepspeed.ops.op_builder import GDSBuilder
>>> h = GDSBuilder().load().gds_handle()
>>> h.pin_device_tensor(t)
>>> h.async_pwrite(t,'/local_nvme/test_1GB.pt')
>>> h.wait()
1
>>> os.path.isfile('/local_nvme/test_1GB.pt')
True
>>> os.path.getsize('/local_nvme/test_1GB.pt')
1073741824
>>> h.unpin_device_tensor(t)
"""

HELP_INIT = (  # the constructor's line in the tutorial's help(aio_handle) output
    "__init__(self: async_io.aio_handle, block_size: int = 1048576, queue_depth: int = 128, "
    "single_submit: bool = False, overlap_events: bool = False, intra_op_parallelism: int = 1) "
    "-> None"
)

ADVANCED_CREATE = """\
>>> from deepspeed.ops.op_builder import AsyncIOBuilder
>>> h = AsyncIOBuilder().load().aio_handle(block_size=1048576,
                                           queue_depth=32,
                                           single_submit=False,
                                           overlap_events=True,
                                           intra_op_parallelism=8)
"""
