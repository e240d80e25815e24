"""Stage 3's parameter pieces off the device (``offload_param``): in files on NVMe, or in host
memory, read in for each gather (:class:`ParamSwapper`); :class:`ResidentPieces` is the same
interface when they stay in memory.

Reads from files run on a thread of their own, ahead of the gathers that need them (the
coordinator submits them, :meth:`ParamSwapper.read_ahead`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from ...core.pinned import host_empty
from .host import HostMeter, HostStore, _placeholder
from .nvme import NVMeStore


class ResidentPieces:
    """Stage-3 parameter pieces that all stay in memory: the :class:`ParamSwapper` interface with
    nothing to swap (``offload_param`` off)."""

    offloads = False
    reads_ahead = False

    def holds(self, p: nn.Parameter) -> bool:
        return False

    def read_ahead(self, params: list[nn.Parameter]) -> None:
        pass

    def forget_reads(self) -> None:
        pass

    def fetch(self, params: list[nn.Parameter]) -> None:
        pass

    def drop(self, params: list[nn.Parameter]) -> None:
        pass

    def close(self) -> None:
        pass


class ParamSwapper:
    """Stage-3 parameter shards (this rank's pieces, compute dtype) in an NVMeStore.

    A swapped-out piece is a placeholder of its size; :meth:`fetch` reads pieces in for a gather
    (counted in the meter until :meth:`drop`), :meth:`update` writes a stepped piece back.

    Reads from files run on a thread of their own, never on the training thread: the coordinator
    submits the next units' reads ahead (:meth:`read_ahead`, into page-locked memory on a GPU), so
    that their gather finds the pieces in memory and only queues the copy up. A read not
    submitted ahead is submitted by :meth:`fetch`, which waits for it. A disk error raised on the
    thread reaches the training thread there.
    """

    offloads = True

    def __init__(
        self, params: list[nn.Parameter], store, meter: HostMeter, device: torch.device
    ) -> None:
        self.store, self.meter, self.device = store, meter, device
        self.key: dict[nn.Parameter, str] = {}
        self._count = 0
        self._stream = None
        # files are read on a thread; host memory (offload_param "cpu") needs no read
        self.reads_ahead = isinstance(store, NVMeStore)
        self._pool = None
        if self.reads_ahead:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="zerostack-nvme")
        self._reads: dict[nn.Parameter, Future] = {}
        self.read_early = self.read_on_demand = 0  # pieces read ahead of / at their fetch
        for p in params:
            self.add(p)

    @property
    def stream(self):
        """The side stream the pieces go up on for a gather (on a GPU; None on the CPU): the
        copies and the gather overlap the compute queued after them."""
        if self.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def add(self, p: nn.Parameter) -> None:
        """Write p's piece to its file and drop it from memory."""
        self.key[p] = f"param{self._count}"
        self._count += 1
        self.store.write(self.key[p], [p._zs.piece])
        p._zs.piece = _placeholder(p._zs.piece)

    def keep(self, p: nn.Parameter) -> None:
        """Bring p's piece back into memory for good (a persistent parameter)."""
        self.fetch([p])
        self.meter.sub(p._zs.piece.nbytes)
        del self.key[p]

    def rewrite(self, p: nn.Parameter, value: torch.Tensor, dtype: torch.dtype) -> None:
        """Store ``value`` as p's piece in ``dtype`` and drop it from memory."""
        if p._zs.piece.stride() != (0,):
            self.meter.sub(p._zs.piece.nbytes)
        self.store.write(self.key[p], [value.to(dtype=dtype, device="cpu")])
        p._zs.piece = torch.zeros((), dtype=dtype, device=self.device).expand(value.numel())

    def holds(self, p: nn.Parameter) -> bool:
        return p in self.key

    def _out(self, p: nn.Parameter) -> bool:
        """p's piece is in its file only: neither in memory nor being read."""
        return p in self.key and p._zs.piece.stride() == (0,) and p not in self._reads

    def _read(self, p: nn.Parameter) -> None:
        """Submit p's read into host memory (page-locked on a GPU) to the thread."""
        piece = p._zs.piece
        self.meter.add(piece.nbytes)
        host = host_empty(piece.numel(), piece.dtype, pin=self.device.type == "cuda")
        self._reads[p] = self._pool.submit(self._read_file, self.key[p], host)

    def _read_file(self, key: str, host: torch.Tensor) -> torch.Tensor:
        self.store.read_into(key, [host])
        return host

    def read_ahead(self, params: list[nn.Parameter]) -> None:
        """Start reading these pieces from their files on the thread, for a later fetch."""
        if self.reads_ahead:
            for p in params:
                if self._out(p):
                    self._read(p)
                    self.read_early += 1

    def fetch(self, params: list[nn.Parameter]) -> None:
        """Bring these pieces into memory: the device's copy queued up (without blocking the
        host, on a GPU) from the read, which is waited for first."""
        if not self.reads_ahead:
            for p in params:
                if self._out(p):
                    st = p._zs
                    n, dtype = st.piece.numel(), st.piece.dtype
                    st.piece = self.store.load(self.key[p], n, dtype, self.device)
                    self.meter.add(st.piece.nbytes)
            return
        for p in params:
            if self._out(p):
                self._read(p)
                self.read_on_demand += 1
        for p in params:
            read = self._reads.pop(p, None)
            if read is not None:
                host = read.result()
                p._zs.piece = host.to(self.device, non_blocking=True)

    def drop(self, params: list[nn.Parameter]) -> None:
        for p in params:
            if p in self.key and p._zs.piece.stride() != (0,):
                self.meter.sub(p._zs.piece.nbytes)
                p._zs.piece = _placeholder(p._zs.piece)

    def forget_reads(self) -> None:
        """Discard the reads ahead no gather used (the pass took another order than the one
        recorded). The coordinator calls this as each pass ends, before a step writes the files
        again: a read kept past that would hold the old values."""
        for p, read in list(self._reads.items()):
            read.result()  # no thread writes into the buffer once it is dropped
            self.meter.sub(p._zs.piece.nbytes)
        self._reads.clear()

    def update(self, p: nn.Parameter, value: torch.Tensor) -> None:
        self.store.write(self.key[p], [value.to(dtype=p._zs.piece.dtype, device="cpu")])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.store.close()


def offload_pieces(
    params: list[nn.Parameter], offload_param, comm, meter: HostMeter
) -> ParamSwapper:
    """``offload_param``: these stage-3 pieces moved to files ("nvme") or host memory ("cpu")."""
    need = sum(p._zs.piece.nbytes for p in params)
    if offload_param.device == "nvme":
        what = "zero_optimization.offload_param"
        store = NVMeStore(offload_param.nvme_path, comm.topo.global_rank, need, what)
    else:
        store = HostStore(offload_param.pin_memory)
    return ParamSwapper(params, store, meter, comm.topo.device)
