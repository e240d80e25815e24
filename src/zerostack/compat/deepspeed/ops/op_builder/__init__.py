"""``deepspeed.ops.op_builder``: the DeepNVMe builders, ``AsyncIOBuilder``, ``GDSBuilder`` and
``PinMemoryBuilder``. DeepSpeed compiles a C++ extension at ``load()``; these hand back the
Python handles of :mod:`zerostack.zero.offload.aio` in a module of the extension's name::

    h = AsyncIOBuilder().load().aio_handle(intra_op_parallelism=4)
    h.async_pwrite(t, "/local_nvme/t.pt")
    h.wait()

``async_io`` and ``pin_memory`` are compatible everywhere (no libaio is needed). ``gds`` is
compatible only where CUDA is: there ``load()`` gives a ``gds_handle`` that moves GPU tensors
through host memory (no cuFile); elsewhere ``load()`` raises DeepSpeed's ``RuntimeError`` for an
op that cannot be built."""

from __future__ import annotations

import types

import torch

from zerostack.zero.offload.aio import AioHandle, GdsHandle, PinHandle

from ...utils.logging import logger


class _Builder:
    """DeepSpeed's ``OpBuilder`` surface for an op zerostack serves without compiling."""

    BUILD_VAR = ""
    NAME = ""
    _loaded_ops: dict[str, types.ModuleType] = {}  # DeepSpeed's cache: one module per op
    _handles: dict[str, type] = {}

    def __init__(self) -> None:
        self.name = self.NAME
        self.jit_mode = False
        self.build_for_cpu = False
        self.enable_bf16 = False
        self.error_log: str | None = None

    def is_compatible(self, verbose: bool = False) -> bool:
        return True

    def load(self, verbose: bool = False) -> types.ModuleType:
        """The op's module (its handle class as an attribute), or DeepSpeed's ``RuntimeError``
        when the op is not compatible here."""
        if self.name in _Builder._loaded_ops:
            return _Builder._loaded_ops[self.name]
        if not self.is_compatible(verbose):
            raise RuntimeError(
                f"Unable to JIT load the {self.name} op due to it not being compatible due to "
                f"hardware/software issue. {self.error_log}"
            )
        module = types.ModuleType(self.name, f"DeepSpeed's {self.name} op, served by zerostack")
        for attr, cls in self._handles.items():
            setattr(module, attr, cls)
        _Builder._loaded_ops[self.name] = module
        return module

    def jit_load(self, verbose: bool = True) -> types.ModuleType:
        return self.load(verbose)


class AsyncIOBuilder(_Builder):
    """``AsyncIOBuilder().load().aio_handle(block_size, queue_depth, single_submit,
    overlap_events, intra_op_parallelism)``."""

    BUILD_VAR = "DS_BUILD_AIO"
    NAME = "async_io"
    _handles = {"aio_handle": AioHandle}

    def absolute_name(self) -> str:
        return f"deepspeed.ops.aio.{self.NAME}_op"


class GDSBuilder(AsyncIOBuilder):
    """``GDSBuilder().load().gds_handle(...)``: compatible only where CUDA is."""

    BUILD_VAR = "DS_BUILD_GDS"
    NAME = "gds"
    _handles = {"gds_handle": GdsHandle}

    def absolute_name(self) -> str:
        return f"deepspeed.ops.gds.{self.NAME}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        if torch.cuda.is_available():
            return super().is_compatible(verbose)
        self.error_log = "gds needs a CUDA device, and torch sees none"
        if verbose:
            logger.warning(f"{self.NAME}: {self.error_log}")
        return False


class PinMemoryBuilder(_Builder):
    """``PinMemoryBuilder().load().pin_handle()``: page-locked host tensors (plain memory
    where there is no CUDA to page-lock for)."""

    BUILD_VAR = "DS_BUILD_PIN_MEMORY"
    NAME = "pin_memory"
    _handles = {"pin_handle": PinHandle}

    def absolute_name(self) -> str:
        return f"deepspeed.ops.pin_memory.{self.NAME}_op"


__all__ = ["AsyncIOBuilder", "GDSBuilder", "PinMemoryBuilder"]
