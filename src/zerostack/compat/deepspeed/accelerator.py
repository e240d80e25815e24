"""``deepspeed.accelerator.get_accelerator()``: the device calls Transformers and Accelerate
make through DeepSpeed's accelerator layer, answered by torch (CUDA when this process sees a
GPU, else the CPU)."""

from __future__ import annotations

import torch


class Accelerator:
    """DeepSpeed's accelerator methods that the libraries call, over torch."""

    def __init__(self) -> None:
        self._name = "cuda" if torch.cuda.is_available() else "cpu"
        self._communication_backend_name = "nccl" if self._name == "cuda" else "gloo"

    def device_name(self, device_index=None) -> str:
        """``"cuda:<i>"`` (``"cuda"`` with no index), or ``"cpu"``."""
        if self._name == "cpu" or device_index is None:
            return self._name
        return f"cuda:{int(device_index)}"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._name == "cuda" else 0

    def current_device_name(self) -> str:
        return self.device_name(self.current_device() if self._name == "cuda" else None)

    def device(self, device_index=None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._name == "cuda" else 1

    def is_available(self) -> bool:
        return True

    def set_device(self, device_index) -> None:
        if self._name == "cuda":
            torch.cuda.set_device(int(device_index))

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_bf16_supported(self) -> bool:
        return self._name == "cpu" or torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return True

    def synchronize(self, device_index=None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        if self._name == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._name == "cuda":
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The process's accelerator (made on first call, as DeepSpeed's)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator()
    return _ACCELERATOR
