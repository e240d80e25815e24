"""The engine's accessors and the engine's state in and out (mixed into
:class:`~.engine.Engine`, which sequences the training step).

Read-only figures (ranks, batch sizes, learning rates, the last gradient norm, pipeline stage),
the accumulation controls (``set_gradient_accumulation_boundary``, ``no_sync``), checkpoints
(``save_checkpoint`` / ``load_checkpoint``: :mod:`.checkpoint` does the work, on the engine's
:class:`~.checkpoint.view.TrainingView`), the full fp32 weights, memory figures and
``destroy``. The accessors that exist for DeepSpeed's callers alone are on
:class:`zerostack.compat.deepspeed.runtime.engine.DeepSpeedEngine`, the engine ``initialize``
returns.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from .checkpoint.model_files import full_weights
from .pinned import pinned_bytes
from .zero.strategy import tally

log = logging.getLogger("zerostack")


class EngineAPI:
    @property
    def device(self) -> torch.device:
        return self.topology.device

    @property
    def global_rank(self) -> int:
        return self.topology.global_rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def dp_world_size(self) -> int:
        """Data-parallel replicas (different batches): the dp axis over sequence_parallel_size,
        as DeepSpeed counts it."""
        return self.topology.data_parallel_size

    def train_batch_size(self) -> int:
        return self._train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self._gas

    def is_first_stage(self) -> bool:
        """Whether this rank runs the first pipeline stage (without a pipeline: True)."""
        return self.runner.is_first_stage

    def is_last_stage(self) -> bool:
        """Whether this rank runs the last pipeline stage (without a pipeline: True)."""
        return self.runner.is_last_stage

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the weights (False between accumulation
        boundaries and when a non-finite gradient skipped the step)."""
        return self.update.applied

    # ------------------------------------------------------------------ accumulation control
    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """From now on, the next backward and ``step()`` close a window (True) or not (False),
        whatever ``gradient_accumulation_steps`` says: set it before each micro-step, as in
        DeepSpeed. The loss is still divided by ``gradient_accumulation_steps``."""
        self._boundary_override = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients on each rank without reducing them; the
        first backward outside, on a boundary, reduces the sum. ``step()`` is refused inside. As
        in DeepSpeed, ZeRO stages 2 and 3 (which reduce gradients as they go, keeping only this
        rank's part) refuse it, and it does not nest."""
        stage = self.config.zero_optimization.stage
        if stage >= 2:
            raise RuntimeError(
                f"no_sync context manager is incompatible with gradient partitioning logic of "
                f"ZeRO stage {stage}"
            )
        if self._inside_no_sync:
            raise RuntimeError("no_sync context manager reentry is unsupported")
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    def get_lr(self) -> list[float]:
        """Each group's learning rate (none for a forward-only engine)."""
        return [g["lr"] for g in self._optimizer_groups()]

    def _optimizer_groups(self) -> list[dict]:
        return self.optimizer.param_groups if self.optimizer is not None else []

    def _optimizer_state(self) -> list[dict]:
        return list(self.optimizer.state.values()) if self.optimizer is not None else []

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last optimizer step, before clipping (None before any)."""
        return self.update.grad_norm

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held by this rank: params, grads, master (fp32 copy) and optimizer state."""
        state = sum(
            t.nbytes
            for s in self._optimizer_state()
            for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0  # step counters are scalars
        )
        return {**self.zero.memory_breakdown(), "optimizer": state}

    def memory_by_device(self) -> dict[str, dict[str, int]]:
        """:meth:`memory_breakdown`'s bytes apart per device type (``{"cuda": {...}, "cpu":
        {...}}``): with offload, what stays on the GPU and what went to host memory. Only the
        places something is held appear (on a CPU run, ``cpu`` alone)."""
        out = tally(self.zero.held(), by_device=True)
        for s in self._optimizer_state():
            for t in s.values():
                if torch.is_tensor(t) and t.dim() > 0:
                    place = out.setdefault(t.device.type, tally(()))
                    place["optimizer"] = place.get("optimizer", 0) + t.nbytes
        for place in out.values():
            place.setdefault("optimizer", 0)
        return out

    def device_memory(self) -> dict[str, int]:
        """The CUDA caching allocator's figures for this rank's device, beside
        :meth:`memory_breakdown`'s census of what zerostack holds: ``allocated`` (now),
        ``max_allocated`` (the peak since the last ``reset_peak_memory_stats``) and ``reserved``
        (held by the allocator, free blocks included); and ``pinned``, the page-locked host bytes
        torch's host allocator holds (each block rounded up to a power of two: up to twice what
        the census counts in pinned tensors). Empty on the CPU."""
        if self.device.type != "cuda":
            return {}
        out = {
            "allocated": torch.cuda.memory_allocated(self.device),
            "max_allocated": torch.cuda.max_memory_allocated(self.device),
            "reserved": torch.cuda.memory_reserved(self.device),
        }
        pinned = pinned_bytes()
        if pinned is not None:
            out["pinned"] = pinned
        return out

    def save_checkpoint(
        self,
        save_dir: str,
        tag=None,
        client_state=None,
        save_latest=True,
        exclude_frozen_parameters=False,
        async_save=None,
    ):
        """DeepSpeed's save: every rank writes its own slices (a collective); default tag
        ``global_step<N>``; ``latest`` names the newest complete tag. Returns the tag's path.
        ``exclude_frozen_parameters``: leave out parameters with ``requires_grad=False`` (a
        LoRA run's frozen base); loading keeps the model's own values for them.
        ``async_save`` (None: the config's ``checkpoint.async_save``): copy the state to host
        memory and write it in the background (:mod:`zerostack.checkpoint.async_save`);
        :meth:`wait_for_checkpoint` waits for it. Any save first waits for a pending one."""
        return self.checkpoints.save(
            save_dir,
            tag,
            client_state,
            save_latest,
            exclude_frozen=exclude_frozen_parameters,
            async_save=async_save,
        )

    def wait_for_checkpoint(self) -> None:
        """Wait until the pending background save is written and ``latest`` moved; raise
        :class:`~.checkpoint.CheckpointError` (on every rank) if it failed on any rank."""
        self.checkpoints.wait()

    def load_checkpoint(
        self,
        load_dir: str,
        tag=None,
        load_module_strict=True,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_only=False,
        custom_load_fn=None,
    ):
        """DeepSpeed's load (``tag=None``: the ``latest`` one), on any ZeRO stage and dp size;
        returns ``(path, client_state)``, or ``(None, None)`` with a warning when ``tag`` is None
        and there is no ``latest`` file (nothing saved yet). A named tag that is missing, or a
        damaged checkpoint, raises :class:`~.checkpoint.CheckpointError`.

        ``load_module_strict=False``: parameters and buffers the checkpoint lacks keep their
        values, and those the model lacks are ignored (shapes must still agree).
        ``custom_load_fn(src=state_dict, dst=module)`` replaces the loading of the weights:
        ``state_dict`` is the checkpoint's, shaped as this rank's module holds them (its
        tensor-parallel slices; at stage 3 the module's parameters are gathered while it runs),
        and what it leaves in the module becomes the fp32 masters."""
        return self.checkpoints.load(  # once a pending background save has completed
            load_dir,
            tag,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            custom_load_fn=custom_load_fn,
        )

    def destroy(self) -> None:
        """Finish a pending background save (raising its error), release what the engine holds
        outside the process (NVMe offload files) and stop its watchdog."""
        watchdog = getattr(self, "watchdog", None)
        if watchdog is not None:
            watchdog.stop()
            self.watchdog = None
        for callback in self.callbacks:  # the monitors flush and close their files
            if callable(getattr(callback, "close", None)):
                callback.close()
        self.zero.close()
        self.checkpoints.wait()  # a pending background save is written (or its error raised)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model weights in fp32 on the CPU, tensor-parallel slices joined (a collective:
        call it on every rank)."""
        return full_weights(self.run)
