"""DeepSpeed's engine accessors and the engine's state in and out (mixed into
:class:`~.engine.Engine`, which sequences the training step).

Read-only figures (ranks, batch sizes, learning rates, the last gradient norm), checkpoints
(``save_checkpoint`` / ``load_checkpoint``: :mod:`.checkpoint` does the work, given the engine's
counters through ``training_state``), the full fp32 weights, memory figures and ``destroy``.
"""

from __future__ import annotations

import os
import time

import torch

from .tensor_parallel import join_tensors, partition_spec


class EngineAPI:
    def throughput_since_print(self) -> str:
        """Samples per second since the last step log (and, once the flops profiler has measured
        a step, model TFLOP/s per rank), for the step log; resets the clock."""
        now, samples = time.perf_counter(), self.global_samples
        last = getattr(self, "_print_clock", None)
        self._print_clock = (now, samples, self.global_steps)
        if last is None or now <= last[0]:
            return ""
        seconds = now - last[0]
        out = f"samples/s={(samples - last[1]) / seconds:.3g}"
        flops = getattr(self.flops_profile, "last_step_flops", None)
        if flops:
            per_rank = flops * (self.global_steps - last[2]) / seconds / self.world_size
            out += f" TFLOP/s per rank={per_rank / 1e12:.3g}"
        return out

    def training_state(self) -> dict[str, int]:
        """The engine's counters, as checkpoints keep them."""
        return {
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_training_state(self, state: dict) -> None:
        self.global_steps, self.global_samples = state["global_steps"], state["global_samples"]
        self.micro_steps, self.skipped_steps = state["micro_steps"], state["skipped_steps"]
        self.comm.log.step = self.global_steps  # CommLog steps continue from here

    @property
    def device(self) -> torch.device:
        return self.topology.device

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def global_rank(self) -> int:
        return self.topology.global_rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def dp_world_size(self) -> int:
        return self.topology.dp

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    def train_batch_size(self) -> int:
        return self._train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self._gas

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last optimizer step, before clipping (None before any)."""
        return self._global_grad_norm

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held by this rank: params, grads, master (fp32 copy) and optimizer state."""
        state = sum(
            t.nbytes
            for s in self.optimizer.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0  # step counters are scalars
        )
        return {**self.zero.memory_breakdown(), "optimizer": state}

    def save_checkpoint(self, save_dir: str, tag=None, client_state=None, save_latest=True):
        """DeepSpeed's save: every rank writes its own slices (a collective); default tag
        ``global_step<N>``; ``latest`` names the newest complete tag. Returns the tag's path."""
        from .checkpoint import save

        return save(self, save_dir, tag, client_state, save_latest)

    def load_checkpoint(
        self,
        load_dir: str,
        tag=None,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_only=False,
    ):
        """DeepSpeed's load (``tag=None``: the ``latest`` one), on any ZeRO stage and dp size;
        returns ``(path, client_state)``."""
        from .checkpoint import load

        return load(
            self,
            load_dir,
            tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )

    def destroy(self) -> None:
        """Release what the engine holds outside the process (NVMe offload files) and stop its
        watchdog."""
        watchdog = getattr(self, "watchdog", None)
        if watchdog is not None:
            watchdog.stop()
            self.watchdog = None
        self.zero.close()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model weights in fp32 on the CPU, tensor-parallel slices joined (a collective:
        call it on every rank)."""
        master = self.zero.full_master()
        tp = self.topology.tp
        out = {}
        for name, p in self.module.named_parameters():
            src = master.get(p)
            t = (src if src is not None else p.detach()).float()
            spec = partition_spec(p)
            if tp > 1 and spec is not None:
                t = t.contiguous()
                parts = t.new_empty((tp, *t.shape))
                self.comm.all_gather(parts.view(-1), t.view(-1), axis="tp")
                t = join_tensors(list(parts.unbind(0)), dim=spec[0], chunks=spec[1])
            out[name] = t.cpu().clone()
        return out
