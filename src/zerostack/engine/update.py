"""The update at the end of an accumulation window: reduce, norm, clip, step, write back.

The masters get their gradients summed over dp and loss-scaled; the norm is taken on those, and
averaging, unscaling and clipping are then one coefficient. Every rank sees the same norm (its
square is summed over every axis), so a NaN or inf gradient on any rank skips the step on all of
them, in every precision: in fp16 that is the dynamic loss scaler's overflow; in bf16 and fp32 a
bad batch or a diverging run, skipped (or raised, with ``on_nonfinite_grads: "error"``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ..core.clock import HostScalar
from ..core.pinned import host_empty
from ..core.run import Run
from ..zero.strategy import GradStats

log = logging.getLogger("zerostack")


@dataclass(frozen=True)
class StepOutcome:
    """What one ``step()`` did: the global gradient norm before clipping (non-finite on a
    skipped update; None before the first), and whether the weights changed."""

    grad_norm: float | None = None
    applied: bool = False

    def between_updates(self) -> StepOutcome:
        """A micro-step inside a window: nothing applied, the last update's norm kept (as
        DeepSpeed's ``get_global_grad_norm()`` keeps it)."""
        return StepOutcome(self.grad_norm, applied=False)


class BoundaryUpdate:
    """The engine's update (``engine.apply_step()``), over the run's parts; :meth:`apply`
    returns what it did."""

    def __init__(self, run: Run) -> None:
        self.run = run
        # the norm's host read, and whether the optimizer can skip a step without it
        self._norm_reader = HostScalar(run.device)
        self._sq_host: torch.Tensor | None = None  # an offloaded norm's way up to the device
        self._masters_on_device = all(m.device == run.device for m in run.zero.masters())
        fused = getattr(run.optimizer, "_step_supports_amp_scaling", False)
        self._skips_on_device = fused and self._masters_on_device

    def apply(self) -> StepOutcome:
        """Reduce, norm, clip, step and write back (see the module); the outcome says whether
        the weights changed."""
        run = self.run
        zero, opt, scaler = run.zero, run.optimizer, run.state.loss_scaler
        stats = zero.reduce_grads(scaler.loss_scale, run.replicated_elsewhere())
        norm = self._global_norm(stats)  # a 0-dim tensor on the device: nothing has waited yet
        self._norm_reader.start(norm)
        if self._skips_on_device:
            # torch's fused optimizers skip their update where ``found_inf`` is 1 (GradScaler's
            # protocol): the step and the write-back are queued before the host reads the norm,
            # so the GPU has them to run while the host waits for the norm alone.
            opt.found_inf = torch.isfinite(norm).logical_not().to(torch.float32)
            try:
                zero.step(opt, self._coef(norm, stats.post))
            finally:
                del opt.found_inf
        value = self._norm_reader.value()
        overflow = not math.isfinite(value)
        if overflow:
            self._skip_step(value)
        else:
            if not self._skips_on_device:  # the step waits for the norm
                if self._masters_on_device:
                    coef = self._coef(norm, stats.post)
                else:  # a float, from the norm's host copy (the device's fp32 arithmetic)
                    coef = float(self._coef(self._norm_reader.host, stats.post))
                zero.step(opt, coef)
            if run.lr_scheduler is not None:
                run.lr_scheduler.step()
        scaler.update(overflow)
        zero.zero_grad()
        return StepOutcome(value, applied=not overflow)

    def _coef(self, norm: torch.Tensor, post: float) -> torch.Tensor | float:
        """What the masters' gradients are multiplied by: ``post`` (the mean over the global
        batch, unscaled) times the clipping factor ``min(clip / (norm + 1e-6), 1)``, computed
        on the device (a tensor) when clipping is on."""
        clip = self.run.config.gradient_clipping
        if clip <= 0:
            return post
        return (clip / (norm + 1e-6)).clamp(max=1.0) * post

    def _global_norm(self, stats: GradStats) -> torch.Tensor:
        """The gradient norm over the whole model, averaged and unscaled, as a 0-dim fp32 tensor
        on the device. Each tp-split parameter is counted by every tp rank (its own slice), each
        replica once, each pipeline stage its own layers."""
        run, sq = self.run, stats.sq
        if sq.device != run.device:  # offloaded: summed on the host, up through pinned memory
            # (from pageable memory the copy would wait for the stream); written again only
            # after this step's norm read, which waits for the copy
            if self._sq_host is None or self._sq_host.dtype != sq.dtype:
                self._sq_host = host_empty((), sq.dtype)
            sq = self._sq_host.copy_(sq).to(run.device, non_blocking=True)
        if stats.sharded:
            run.comm.all_reduce(sq, axis="dp")
        for axis in ("tp", "pp", "ep"):
            if run.topology.size(axis) > 1:
                run.comm.all_reduce(sq, axis=axis)
        return sq.sqrt() * stats.post

    def _skip_step(self, norm: float) -> None:
        """A non-finite gradient norm: leave weights, optimizer state and LR schedule as they
        are (see the module)."""
        run = self.run
        run.state.skipped_steps += 1
        step = run.global_steps + 1
        if run.precision.name == "fp16":
            if run.global_rank == 0:
                log.info(
                    "step %d: fp16 gradient overflow, step skipped (loss scale %g)",
                    step,
                    run.state.loss_scaler.loss_scale,
                )
            return
        if run.config.on_nonfinite_grads == "error":
            raise FloatingPointError(
                f"step {step}: the global gradient norm is {norm} (on_nonfinite_grads: error)"
            )
        if run.global_rank == 0:
            log.warning(
                "step %d: non-finite gradient norm (%s), step skipped (%d skipped so far)",
                step,
                norm,
                run.state.skipped_steps,
            )
