"""One rank's files under ``nvme_path``: the NVMe store of ZeRO-Infinity.

:class:`NVMeStore` is created in ``initialize`` (so a bad path is a ``ConfigError`` before
training): it refuses a path that is missing, not writable (tried with a real write) or without
the free space the offload needs, and removes what this host's dead processes left there. A
failing read or write (ENOSPC, EIO, EFBIG) raises an ``OSError`` naming the rank, the config key
and the file, on whichever thread swapped; the swapper re-raises it on the training thread.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import socket
import tempfile
import threading
import weakref

import torch

from ...config import ConfigError
from ...core.exit import before_hard_exit, forget

_MMAP_SET = False


def _mmap_large_buffers() -> None:
    """Have glibc serve buffers of 1 MiB and more with mmap, so a freed swap buffer goes back to
    the OS. Left alone, glibc raises this threshold to the largest buffer freed so far (up to
    32 MiB) and keeps freed buffers in its heap: the process's memory then grows with every
    sub-group swapped instead of staying at ``buffer_count`` of them. No-op off glibc."""
    global _MMAP_SET
    if _MMAP_SET:
        return
    _MMAP_SET = True
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


_LIVE: weakref.WeakSet = weakref.WeakSet()  # this process's open stores


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, someone else's
        pass
    return True


def _sweep(root: str) -> int:
    """Remove the folders of this host's processes that no longer run (a job ended by its
    watchdog, ``os._exit``, or killed leaves its files: the next one takes the space back);
    returns the bytes in the folders of those that run (this rank's peers on this host, and this
    process's other store), which a free-space check counts as theirs, not as used."""
    host, held = socket.gethostname(), 0
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    for name in names:
        head, _, rest = name.partition(f"zerostack-{host}-p")
        pid = rest.split("-", 1)[0]
        if head or not pid.isdigit():
            continue
        folder = os.path.join(root, name)
        if not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            continue
        try:
            held += sum(e.stat().st_size for e in os.scandir(folder) if e.is_file())
        except OSError:  # removed meanwhile
            pass
    return held


_REMOVING = threading.Lock()  # the watchdog's exit waits for a removal atexit has begun


def _remove(folder: str) -> None:
    """Remove a store's folder, also while its swap threads still write (the watchdog ends a rank
    whose training goes on meanwhile): renamed first, so no new file can be made under its
    name, then removed; a file whose open had passed the folder already is taken by the next
    round. The new name keeps the prefix: what is left is a dead process's, swept later. Under
    a lock: the interpreter's exit (``atexit``) and the watchdog's (``os._exit``) may remove at
    once, and the second must not end the process halfway through the first."""
    gone = f"{folder}-ending"
    with _REMOVING:
        try:
            os.rename(folder, gone)
        except OSError:  # renamed or removed already
            pass
        for _ in range(3):
            shutil.rmtree(gone, ignore_errors=True)
            if not os.path.exists(gone):
                return


def _local_world() -> int:
    """Ranks on this host (torchrun's LOCAL_WORLD_SIZE): they share ``nvme_path``'s disk."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


class NVMeStore:
    """One rank's files under ``root``; removed on :meth:`close`, at interpreter exit, or when the
    watchdog ends the rank (:func:`~zerostack.core.exit.hard_exit`)."""

    def __init__(self, root: str, rank: int, need_bytes: int, what: str) -> None:
        if not root:
            raise ConfigError(f"{what}.nvme_path: required when device is 'nvme'")
        if not os.path.isdir(root):
            raise ConfigError(f"{what}.nvme_path: {root!r} is not a directory")
        _sweep(root)
        try:  # a real write, not os.access: that says yes to root, or on a read-only mount
            prefix = f"zerostack-{socket.gethostname()}-p{os.getpid()}-rank{rank}-"
            self.dir = tempfile.mkdtemp(prefix=prefix, dir=root)
        except OSError as exc:
            raise ConfigError(
                f"{what}.nvme_path: {root!r} is not writable ({exc.strerror})"
            ) from None
        self.need, self.dev = need_bytes, os.stat(self.dir).st_dev
        self._check_space(root, rank, what)
        _LIVE.add(self)
        _mmap_large_buffers()
        self.what, self.rank = what, rank
        self.bytes_read = 0
        self.bytes_written = 0
        self._counting = threading.Lock()  # the swappers' threads read and write at once
        self._cleanup = weakref.finalize(self, _remove, self.dir)
        atexit.register(self._cleanup)
        self._remove_on_hard_exit = functools.partial(_remove, self.dir)  # not once, as finalize
        before_hard_exit(self._remove_on_hard_exit)  # the watchdog's exit skips atexit

    def _check_space(self, root: str, rank: int, what: str) -> None:
        """The disk must hold what every rank on this host will write there: this store's
        bytes and this process's other store's on that disk (offload_param and
        offload_optimizer on one path), times the ranks on this host. Their folders' bytes
        (``held``) count as free: they are part of what is needed."""
        mine = need = self.need + sum(s.need for s in list(_LIVE) if s.dev == self.dev)
        local = _local_world()
        need *= local
        free = shutil.disk_usage(root).free
        # read after the free space: a peer's write in between is counted on both sides, never
        # on neither (which would refuse a disk big enough)
        held = _sweep(root)
        if free + held >= need:
            return
        os.rmdir(self.dir)
        also = f", {mine} with its other offload on that disk" if mine != self.need else ""
        also += f", {need} for the {local} ranks on this host" if local > 1 else ""
        raise ConfigError(
            f"{what}.nvme_path: {root!r} has {free} bytes free ({free / 2**30:.2f} GiB), rank "
            f"{rank} needs {self.need} ({self.need / 2**30:.2f} GiB){also}"
        )

    def path(self, key: str) -> str:
        return os.path.join(self.dir, f"{key}.bin")

    def _failed(self, doing: str, key: str, exc: OSError) -> OSError:
        """A disk error (ENOSPC, EIO, EFBIG) named by rank, config key and file; raised on the
        thread that swaps, it reaches the training thread at that swap's ``result()``."""
        return OSError(
            exc.errno,
            f"rank {self.rank}: {self.what}.nvme_path: {doing} {self.path(key)} failed: "
            f"{exc.strerror or exc}",
        )

    def write(self, key: str, tensors: list[torch.Tensor]) -> None:
        try:
            with open(self.path(key), "wb") as f:
                for t in tensors:  # a device tensor is copied to host memory first
                    view = t.detach().to("cpu").contiguous().view(torch.uint8).numpy()
                    f.write(memoryview(view))
                    with self._counting:
                        self.bytes_written += view.nbytes
        except OSError as exc:
            raise self._failed("writing", key, exc) from exc

    def read_into(self, key: str, tensors: list[torch.Tensor]) -> None:
        try:
            with open(self.path(key), "rb") as f:
                for t in tensors:
                    host = t if t.device.type == "cpu" else torch.empty_like(t, device="cpu")
                    view = host.view(torch.uint8).numpy()
                    got = f.readinto(memoryview(view))
                    if got != view.nbytes:
                        raise OSError(f"short read ({got} of {view.nbytes} bytes)")
                    with self._counting:
                        self.bytes_read += got
                    if host is not t:  # read into a device tensor: through host memory
                        t.copy_(host)
        except OSError as exc:
            raise self._failed("reading", key, exc) from exc

    def close(self) -> None:
        _LIVE.discard(self)
        self._cleanup()
        forget(self._remove_on_hard_exit)
