"""``deepspeed.runtime.utils``: the helpers DeepSpeed's tutorials and ALST scripts import
(``move_to_device``, ``see_memory_usage``, ``set_random_seed``)."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist


def move_to_device(item, device, criterion_func=None):
    """``item`` (a tensor, or lists, tuples and dicts of them, nested) with its tensors on
    ``device``, as DeepSpeed's: an item ``criterion_func`` accepts is moved in place (its
    ``.data`` replaced) and returned. Unlike DeepSpeed's, a leaf that is not a tensor (an int, a
    string) is returned as it is instead of raising."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device) if isinstance(item, torch.Tensor) else item


def _host_used_and_percent() -> tuple[float, float]:
    """The host's used memory (GB) and share used, from /proc/meminfo (0, 0 where absent)."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    except OSError:
        return 0.0, 0.0
    total, available = info["MemTotal"], info.get("MemAvailable", info["MemFree"])
    return (total - available) / 2**30, 100 * (total - available) / total


def see_memory_usage(message: str, force: bool = False) -> None:
    """DeepSpeed's: with ``force``, on global rank 0, print ``message``, the device memory
    allocated and reserved (and their peaks, which are then reset) on CUDA, and the host's
    used memory. Without ``force`` it does nothing, as DeepSpeed's."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()
    print(message)
    if torch.cuda.is_available():
        gb = 2**30
        print(
            f"MA {torch.cuda.memory_allocated() / gb:.2f} GB "
            f"Max_MA {torch.cuda.max_memory_allocated() / gb:.2f} GB "
            f"CA {torch.cuda.memory_reserved() / gb:.2f} GB "
            f"Max_CA {torch.cuda.max_memory_reserved() / gb:.2f} GB"
        )
        torch.cuda.reset_peak_memory_stats()
    used, percent = _host_used_and_percent()
    print(f"CPU Virtual Memory:  used = {used:.2f} GB, percent = {percent:.1f}%")


def set_random_seed(seed: int) -> None:
    """DeepSpeed's: seed Python's ``random``, NumPy's global generator (``seed % 2**32``) and
    torch's (``seed % 2**63``)."""
    import random

    import numpy

    random.seed(seed)
    numpy.random.seed(seed % (2**32))
    torch.manual_seed(seed % (2**63))


__all__ = ["move_to_device", "see_memory_usage", "set_random_seed"]
