"""DeepNVMe's I/O handles (DeepSpeed's ``aio_handle``, ``gds_handle`` and ``pin_handle``) over
``os.preadv``/``os.pwritev`` and a thread pool, for code written against DeepSpeed's
``AsyncIOBuilder().load().aio_handle()``.

Each request moves a tensor's bytes to or from a file at ``file_offset``, split into
``intra_op_parallelism`` equal parts that the handle's threads transfer at once, as DeepSpeed's
threads do. The ``sync_*`` calls return when done; the ``async_*`` calls return 0 at once and
:meth:`AioHandle.wait` blocks until every request in flight is done::

    h = AioHandle(intra_op_parallelism=4)
    h.async_pwrite(t, "/local_nvme/t.pt")
    assert h.wait() == 1
    h.sync_pread(u, "/local_nvme/t.pt")       # returns 1: the requests it completed

Return values are DeepSpeed 0.19.8's: a count of completed requests from ``sync_*``, ``pread``
and ``pwrite`` (when not async) and ``wait``, 0 from ``async_*``, ``read`` and ``write``. Where
DeepSpeed returns -1 and prints (an open that fails, a size not divisible by the parallelism) or
aborts on a C ``assert`` (a file shorter than the read), this raises an ``OSError`` or
``ValueError`` naming the file: a failed transfer in a thread is raised by the ``wait`` that
collects it, after every request has finished and its file is closed.

Unlike DeepSpeed: files are opened without ``O_DIRECT`` (the page cache serves them, so no
alignment is needed); a tensor on a GPU goes through host memory; ``validate`` raises on a
mismatch instead of printing; ``wait`` with nothing in flight returns 0 (DeepSpeed asserts).
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ...core.pinned import can_pin, host_empty

O_DIRECT_ALIGNMENT = 512
"""DeepSpeed's per-thread alignment unit: ``get_alignment()`` is this times the parallelism."""


class _LockedTensors:
    """The process's tensors from ``new_cpu_locked_tensor``, by base address and size. One for
    the process, as DeepSpeed's pin manager, so one handle may free what another allocated."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: dict[int, int] = {}

    def alloc(self, num_elem: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(int(num_elem), dtype=dtype, pin_memory=can_pin())
        with self._lock:
            self._spans[t.data_ptr()] = t.nbytes
        return t

    def free(self, address: int) -> bool:
        with self._lock:
            return self._spans.pop(address, None) is not None

    def holds(self, t: torch.Tensor) -> bool:
        if t.device.type != "cpu":
            return False
        start, end = t.data_ptr(), t.data_ptr() + t.nbytes
        with self._lock:
            return any(b <= start and end <= b + n for b, n in self._spans.items())


_LOCKED = _LockedTensors()


class PinHandle:
    """DeepSpeed's ``pin_handle`` (``PinMemoryBuilder().load().pin_handle()``): host tensors for
    I/O. They are page-locked where CUDA is present and plain memory otherwise (page-locking
    only speeds up copies to and from a GPU); freeing forgets the tensor, whose memory goes
    when its last reference does (DeepSpeed frees it at once)."""

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """An uninitialised 1-D host tensor of ``num_elem`` elements of the example's dtype."""
        return _LOCKED.alloc(num_elem, example_tensor.dtype)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` came from :meth:`new_cpu_locked_tensor` and was not freed yet."""
        return _LOCKED.free(tensor.data_ptr())

    def free_cpu_locked_tensor_by_ptr(self, address: int) -> bool:
        return _LOCKED.free(int(address))

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` is torch-pinned or inside a tensor this process's handles made."""
        return (buffer.device.type == "cpu" and buffer.is_pinned()) or _LOCKED.holds(buffer)


def _bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous host tensor's storage (no copy)."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def _transfer(read: bool, fd: int, view: memoryview, offset: int, path: str) -> None:
    """Move all of ``view`` at ``offset``, looping over partial transfers; EOF is an error."""
    done = 0
    while done < len(view):
        try:
            if read:
                n = os.preadv(fd, [view[done:]], offset + done)
            else:
                n = os.pwritev(fd, [view[done:]], offset + done)
        except OSError as exc:
            doing = "read from" if read else "write to"
            raise OSError(
                exc.errno, f"aio {doing} at offset {offset + done} failed: {exc.strerror}", path
            ) from exc
        if n == 0:
            raise OSError(
                errno.EIO, f"short read: end of file at offset {offset + done}", path
            )
        done += n


@dataclass
class _Request:
    """One request in flight: its parts' futures, and what finishing it takes."""

    path: str
    fd: int
    own_fd: bool
    parts: list[Future] = field(default_factory=list)
    copy_back: tuple[torch.Tensor, torch.Tensor] | None = None  # (device tensor, host buffer)
    check: tuple[memoryview, int] | None = None  # validate: (bytes, file offset)


class AioHandle(PinHandle):
    """DeepSpeed's ``aio_handle(block_size=1048576, queue_depth=128, single_submit=False,
    overlap_events=False, intra_op_parallelism=1)``. ``block_size``, ``queue_depth``,
    ``single_submit`` and ``overlap_events`` tune libaio in DeepSpeed; here they are kept and
    reported by the getters only."""

    def __init__(
        self,
        block_size: int = 1024 * 1024,
        queue_depth: int = 128,
        single_submit: bool = False,
        overlap_events: bool = False,
        intra_op_parallelism: int = 1,
    ) -> None:
        if intra_op_parallelism < 1:
            raise ValueError(f"intra_op_parallelism must be >= 1, got {intra_op_parallelism}")
        self._block_size, self._queue_depth = int(block_size), int(queue_depth)
        self._single_submit, self._overlap_events = bool(single_submit), bool(overlap_events)
        self._parallelism = int(intra_op_parallelism)
        self._io_parts = self._parallelism  # parts per request (1 for the gds handle)
        self._pool = ThreadPoolExecutor(self._parallelism, thread_name_prefix="zerostack-aio")
        self._lock = threading.Lock()
        self._pending: list[_Request] = []

    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._parallelism

    def get_alignment(self) -> int:
        return self._parallelism * O_DIRECT_ALIGNMENT

    # -- the parallel calls -------------------------------------------------------------------

    def pread(self, buffer, filename, validate, is_async, file_offset=0) -> int:
        """Read ``buffer.nbytes`` bytes of ``filename`` at ``file_offset`` into ``buffer``.
        ``is_async`` is DeepSpeed's positional ``async``: then 0, else :meth:`wait`'s count."""
        self._submit(True, buffer, filename, bool(validate), int(file_offset))
        return 0 if is_async else self.wait()

    def pwrite(self, buffer, filename, validate, is_async, file_offset=0) -> int:
        """Write ``buffer``'s bytes to ``filename`` (created if missing, never truncated) at
        ``file_offset``; ``filename`` may be an open file descriptor, left open."""
        self._submit(False, buffer, filename, bool(validate), int(file_offset))
        return 0 if is_async else self.wait()

    def sync_pread(self, buffer, filename, file_offset=0) -> int:
        return self.pread(buffer, filename, False, False, file_offset)

    def sync_pwrite(self, buffer, filename, file_offset=0) -> int:
        return self.pwrite(buffer, filename, False, False, file_offset)

    def async_pread(self, buffer, filename, file_offset=0) -> int:
        return self.pread(buffer, filename, False, True, file_offset)

    def async_pwrite(self, buffer, filename, file_offset=0) -> int:
        return self.pwrite(buffer, filename, False, True, file_offset)

    def wait(self) -> int:
        """Block until every request in flight is done; returns how many there were. The first
        failure is raised once all have finished (their files closed, GPU copies made)."""
        with self._lock:
            pending, self._pending = self._pending, []
        first: Exception | None = None
        for req in pending:
            futures.wait(req.parts)  # every part, before its file is closed
            try:
                for part in req.parts:
                    part.result()
                if req.copy_back is not None:
                    req.copy_back[0].copy_(req.copy_back[1])
                if req.check is not None:
                    self._validate(req)
            except Exception as exc:  # raised below, once the others have finished
                first = first or exc
            finally:
                if req.own_fd:
                    os.close(req.fd)
        if first is not None:
            raise first
        return len(pending)

    # -- the single-threaded calls ------------------------------------------------------------

    def read(self, buffer, filename, validate, file_offset=0) -> int:
        """DeepSpeed's non-parallel blocking read: the whole file must be ``buffer``'s size."""
        size = os.path.getsize(filename)
        if size != buffer.nbytes:
            raise OSError(
                errno.EINVAL, f"file is {size} bytes, buffer {buffer.nbytes}", filename
            )
        return self._single(True, buffer, filename, validate, file_offset)

    def write(self, buffer, filename, validate, file_offset=0) -> int:
        """DeepSpeed's non-parallel blocking write."""
        return self._single(False, buffer, filename, validate, file_offset)

    # -- internals -----------------------------------------------------------------------------

    def _single(self, read, buffer, filename, validate, file_offset) -> int:
        host, copy_back, view = self._host_view(read, buffer, filename)
        fd = os.open(filename, os.O_RDONLY if read else os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            _transfer(read, fd, view, int(file_offset), filename)
        finally:
            os.close(fd)
        if copy_back:
            buffer.copy_(host)
        if validate:
            self._validate(_Request(filename, -1, False, check=(view, int(file_offset))))
        return 0

    def _host_view(self, read: bool, buffer: torch.Tensor, path):
        """(host tensor, whether to copy it back into ``buffer``, its bytes) for a transfer."""
        if read and not buffer.is_contiguous():
            raise ValueError(
                f"aio read into {path}: the buffer is not contiguous (shape "
                f"{tuple(buffer.shape)}, stride {buffer.stride()}); read into a contiguous one"
            )
        if buffer.device.type == "cpu":
            host = buffer if read else buffer.contiguous()
            return host, False, _bytes(host)
        if read:  # into a GPU tensor: through a host buffer, copied up when the read is done
            host = host_empty(buffer.shape, buffer.dtype)
        else:
            host = buffer.detach().to("cpu").contiguous()
        return host, read, _bytes(host)

    def _submit(self, read, buffer, filename, validate, offset) -> None:
        nbytes = buffer.nbytes
        path = filename if isinstance(filename, str | os.PathLike) else f"fd {filename}"
        if nbytes % self._io_parts:
            raise ValueError(
                f"aio {'read' if read else 'write'} of {path}: {nbytes} bytes are not divisible "
                f"by intra_op_parallelism = {self._io_parts}"
            )
        if read:
            size = os.path.getsize(filename)
            if offset + nbytes > size:
                raise OSError(
                    errno.EINVAL,
                    f"file_offset + buffer nbytes > file bytes: {offset + nbytes} > {size}",
                    path,
                )
        host, copy_back, view = self._host_view(read, buffer, path)
        own_fd = not isinstance(filename, int)
        if own_fd:
            fd = os.open(filename, os.O_RDONLY if read else os.O_WRONLY | os.O_CREAT, 0o600)
        else:
            fd = filename
        req = _Request(str(path), fd, own_fd)
        req.copy_back = (buffer, host) if copy_back else None
        req.check = (view, offset) if validate else None
        per = nbytes // self._io_parts
        for i in range(self._io_parts):
            part = view[i * per : (i + 1) * per]
            req.parts.append(
                self._pool.submit(_transfer, read, fd, part, offset + i * per, req.path)
            )
        with self._lock:
            self._pending.append(req)

    @staticmethod
    def _validate(req: _Request) -> None:
        """DeepSpeed's ``validate``: the file's bytes at the offset are the buffer's."""
        view, offset = req.check
        with open(req.path, "rb") as f:
            f.seek(offset)
            on_disk = f.read(len(view))
        if on_disk != view.tobytes():
            raise OSError(errno.EIO, "validate: the file's bytes differ from the buffer", req.path)


class GdsHandle(AioHandle):
    """DeepSpeed's ``gds_handle``: the same calls, and pinning of GPU tensors for GPUDirect
    Storage. There is no cuFile here: GPU tensors go through host memory, pinning only records
    the tensor, and a request is one transfer (DeepSpeed's gds handle does not split a request
    either; ``get_intra_op_parallelism`` still reports the argument)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._io_parts = 1
        self._pinned_device: set[int] = set()

    def new_pinned_device_tensor(self, num_elem: int, example_tensor: torch.Tensor):
        t = torch.empty(int(num_elem), dtype=example_tensor.dtype, device="cuda")
        self.pin_device_tensor(t)
        return t

    def free_pinned_device_tensor(self, tensor: torch.Tensor) -> bool:
        return self.unpin_device_tensor(tensor)

    def pin_device_tensor(self, tensor: torch.Tensor) -> bool:
        self._pinned_device.add(tensor.data_ptr())
        return True

    def unpin_device_tensor(self, tensor: torch.Tensor) -> bool:
        self._pinned_device.discard(tensor.data_ptr())
        return True


__all__ = ["AioHandle", "GdsHandle", "PinHandle"]
