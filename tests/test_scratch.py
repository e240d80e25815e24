"""Stage 3's large transient CPU buffers live in mappings of their own (zerostack.core.scratch),
outside glibc's heap, and go back to the system when freed.

Where a buffer lives is read from glibc (``mallinfo2``: malloc's own count of what it handed out)
and from the kernel (``/proc/self/maps``: a buffer mapped on its own starts a page of an anonymous
mapping other than the heap, and its address is unmapped once it is freed), not from the
library. What it buys (peak RSS against FSDP2) is measured by ``benchmarks/memory_timeline.py``.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

import zerostack
from zerostack.core import scratch
from zerostack.models import GPT, GPTConfig

from tests.support.models import batch
from tests.support.ranks import run_distributed

PAGE = 4096


_MALLINFO2_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS.split()]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _MallInfo2


def _malloc_bytes() -> int:
    """Bytes glibc's malloc has handed out and not had back (heap and its own mmapped chunks)."""
    m = _LIBC.mallinfo2()
    return m.uordblks + m.hblkhd


def _region(ptr: int) -> str | None:
    """The name of the mapping holding address ``ptr`` ("" when anonymous), None if unmapped."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(a, 16) for a in fields[0].split("-"))
            if lo <= ptr < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    return None


def _outside_heap(t: torch.Tensor) -> bool:
    """``t``'s storage starts a page of an anonymous mapping other than the main heap: where an
    mmap of its own puts it. Blocks from malloc start 16 or 64 bytes into their chunk (glibc's
    mmapped chunks) or at a 64-byte boundary of the heap (a page start 1 time in 64)."""
    ptr = t.untyped_storage().data_ptr()
    return ptr % PAGE == 0 and _region(ptr) == ""


def test_a_large_buffer_has_a_mapping_of_its_own_that_goes_when_freed():
    numel = scratch.MIN_BYTES // 4 + 3
    before = _malloc_bytes()
    t = scratch.empty(numel, torch.float32)
    assert _malloc_bytes() - before < 4 * numel  # not from malloc (torch.empty would be)
    assert t.shape == (numel,) and t.dtype == torch.float32 and t.is_contiguous()
    assert _outside_heap(t)
    start = t.untyped_storage().data_ptr()
    t.fill_(2.0)
    assert float(t.sum()) == 2.0 * numel
    view = t[5:].view(-1)  # a view keeps the mapping
    del t
    assert _region(start) == ""
    del view
    assert _region(start) is None  # unmapped: back to the system
    z = scratch.zeros(2 * numel, torch.bfloat16)
    assert _outside_heap(z) and not z.any()
    before = _malloc_bytes()
    plain = torch.empty(numel, dtype=torch.float32)  # the checks tell malloc's blocks apart
    assert _malloc_bytes() - before >= 4 * numel and not _outside_heap(plain)


def _vm_flags(ptr: int) -> list[str]:
    """The kernel's ``VmFlags`` for the mapping holding address ``ptr`` (``/proc/self/smaps``)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line
                lo, hi = (int(a, 16) for a in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {ptr:#x}")


def test_a_large_buffer_asks_for_huge_pages():
    """Its mapping carries the kernel's "hg" flag (``madvise(MADV_HUGEPAGE)``), so its pages are
    faulted in 2 MiB at a time where transparent huge pages are on; a heap block does not."""
    t = scratch.empty(scratch.MIN_BYTES // 4, torch.float32)
    assert "hg" in _vm_flags(t.untyped_storage().data_ptr())
    t.fill_(1.0)  # usable as any buffer
    assert float(t.sum()) == t.numel()
    plain = torch.empty(scratch.MIN_BYTES // 4, dtype=torch.float32)
    assert "hg" not in _vm_flags(plain.untyped_storage().data_ptr())


def test_small_or_off_cpu_buffers_are_plain_tensors():
    before = _malloc_bytes()
    small = scratch.zeros(scratch.MIN_BYTES // 4 - 1, torch.float32)
    assert _malloc_bytes() - before >= small.nbytes and not small.any()
    meta = scratch.empty(scratch.MIN_BYTES, torch.float32, "meta")
    assert meta.device.type == "meta" and meta.numel() == scratch.MIN_BYTES


def test_a_buffer_given_back_as_a_matrix_is_taken_flat():
    """Stage 3 gives back a bucket's (dp, width) staging matrix; a later bucket whose row has
    as many elements takes it as its flat row. Taken in its old shape, the row's slices were
    rows of the matrix, and a gradient piece of 4096 met one of (2, 2048) (an HF Llama at dp
    2 whose reduce_bucket_size was below a weight's size)."""
    pool = scratch.Pool()
    matrix = torch.zeros(2, 3)
    pool.give(matrix)
    pool.give(matrix.view(-1))  # the same buffer again: kept once
    row = pool.take(6, torch.float32, "cpu")
    assert row.shape == (6,) and row.data_ptr() == matrix.data_ptr()
    assert pool.take(6, torch.float32, "cpu").data_ptr() != matrix.data_ptr()
    pool.give(matrix.t())  # not contiguous: not a buffer to hand out flat
    assert pool.kept() == []


def _stage3(rank, world):
    """Rank 0's findings in one stage-3 step of a GPT whose blocks' Linear layers are 1-4 MiB:
    whether each gathered weight (forward), each weight gradient autograd hands over, and each
    staged reduce-scatter matrix had a mapping of its own (with the threshold at 1 MiB, so that
    a small model's layers cross it)."""
    scratch.MIN_BYTES = 1 << 20  # this rank's process only
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=4, d_model=512, bias=True)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerostack.initialize(model=GPT(cfg), config=config)
    linears = {n: m for n, m in engine.module.named_modules() if n.startswith("blocks.0.")}
    linears = {n: m for n, m in linears.items() if isinstance(m, torch.nn.Linear)}
    seen: dict[str, bool] = {}

    def gathered(name):
        return lambda module, args: seen.update({f"{name} weight": _outside_heap(module.weight)})

    def grad(name):
        def hook(g):
            seen[f"{name} grad"] = _outside_heap(g)
            staging = engine.zero.reduce._staging.values()
            seen[f"{name} staging"] = all(_outside_heap(s) for s in staging)

        return hook

    for name, m in linears.items():
        m.register_forward_pre_hook(gathered(name), prepend=False)
        m.weight.register_hook(grad(name))
    x, y = batch(0, world, cfg.block_size)
    engine.backward(engine(x[rank : rank + 1], y[rank : rank + 1]))
    engine.step()
    return seen


@pytest.mark.distributed
def test_stage3_gathers_gradients_and_staging_are_outside_the_heap():
    seen = run_distributed(_stage3, 2, timeout=300)[0]
    names = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    want = [f"blocks.0.{n} {what}" for n in names for what in ("weight", "grad", "staging")]
    assert sorted(seen) == sorted(want)
    assert all(seen.values()), seen
