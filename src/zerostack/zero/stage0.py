"""Stage 0 (plain data parallelism): flat buffers and bucketed, overlapped gradient all-reduce.

Each optimizer group's trainable parameters become views into one flat buffer in the compute dtype,
and their ``.grad`` views into a second one, so autograd accumulates in place and a bucket of ready
gradients is one contiguous range. A post-accumulate-grad hook counts the ready parameters of each
bucket; on the micro-step that ends an accumulation window a ready bucket's all-reduce is launched
asynchronously while backward goes on. Buckets launch strictly in order, so every rank issues the
same collectives in the same order even when gradients become ready in a different order.

The optimizer sees one flat fp32 tensor per group. In fp32 training that tensor *is* the parameter
buffer (no copy); in fp16/bf16 it is a separate fp32 master copy made from the original fp32
weights, and updated values are cast back into the parameter buffer after each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..comm import Comm, Handle
from ..precision import Precision
from .partition import Bucket, FlatLayout


@dataclass
class _BucketState:
    bucket: Bucket
    group: int
    pending: int = 0
    handle: Handle | None = None


@dataclass
class FlatGroup:
    """One optimizer group: its parameters, their flat buffers and the fp32 master tensor."""

    params: list[nn.Parameter]
    options: dict
    layout: FlatLayout
    params_flat: torch.Tensor
    grads_flat: torch.Tensor
    master: nn.Parameter
    buckets: list[int] = field(default_factory=list)


def _flatten_fp32(params: list[nn.Parameter], layout: FlatLayout, device) -> torch.Tensor:
    flat = torch.zeros(layout.padded_numel, dtype=torch.float32, device=device)
    for slot in layout.slots:
        flat[slot.offset : slot.end].copy_(params[slot.index].detach().reshape(-1))
    return flat


class DataParallelGrads:
    """Owns flat parameters, gradients and master weights of stage 0, and reduces gradients."""

    def __init__(
        self,
        module: nn.Module,
        groups: list[dict],
        *,
        comm: Comm,
        precision: Precision,
        bucket_numel: int,
        prescale: float = 1.0,
    ) -> None:
        self.module = module
        self.comm = comm
        self.precision = precision
        self.dp = comm.topo.dp
        self.prescale = prescale
        self.groups: list[FlatGroup] = []
        self.buckets: list[_BucketState] = []
        # param -> (group, bucket state, its range in the flat buffer)
        self._where: dict[nn.Parameter, tuple[int, int, slice]] = {}
        self._ready: set[nn.Parameter] = set()
        self._next_launch = 0
        self.boundary = True
        device = next(module.parameters()).device
        dtype = precision.compute_dtype

        for g, group in enumerate(groups):
            params = list(group["params"])
            layout = FlatLayout.build([tuple(p.shape) for p in params], world=self.dp)
            master = _flatten_fp32(params, layout, device)
            if self.dp > 1:
                comm.broadcast(master, src=0, axis="dp")
            params_flat = master if dtype == torch.float32 else master.to(dtype)
            grads_flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
            for slot in layout.slots:
                p = params[slot.index]
                p.data = params_flat[slot.offset : slot.end].view(slot.shape)
                p.grad = grads_flat[slot.offset : slot.end].view(slot.shape)
            options = {k: v for k, v in group.items() if k != "params"}
            fg = FlatGroup(params, options, layout, params_flat, grads_flat, nn.Parameter(master))
            for bucket in layout.buckets(bucket_numel):
                fg.buckets.append(len(self.buckets))
                self.buckets.append(_BucketState(bucket, g))
                for pos in bucket.slots:
                    slot = layout.slots[pos]
                    rng = slice(slot.offset, slot.end)
                    self._where[params[slot.index]] = (g, len(self.buckets) - 1, rng)
            self.groups.append(fg)

        self._sync_untracked(device, dtype)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._where
        ]
        self._reset_pending()

    def _sync_untracked(self, device, dtype) -> None:
        """Broadcast frozen parameters and buffers from dp rank 0, then cast them to the dtype."""
        tracked = set(self._where)
        others = [p for p in self.module.parameters() if p not in tracked]
        others += [b for b in self.module.buffers()]
        if self.dp > 1:
            for t in others:
                self.comm.broadcast(t.data, src=0, axis="dp")
        for t in others:
            if t.is_floating_point() and t.dtype != dtype:
                t.data = t.data.to(dtype)

    # ----------------------------------------------------------------------------- backward
    def _reset_pending(self) -> None:
        for st in self.buckets:
            st.pending = len(st.bucket.slots)
            st.handle = None
        self._next_launch = 0
        self._ready.clear()

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        g, b, rng = self._where[p]
        fg, st = self.groups[g], self.buckets[b]
        view = fg.grads_flat[rng].view_as(p)
        if p.grad.data_ptr() != view.data_ptr():
            # Someone replaced .grad (e.g. set it to None): fold it back into the flat buffer.
            view.add_(p.grad)
            p.grad = view
        if not self.boundary or self.dp == 1:
            return
        if p in self._ready:
            raise RuntimeError(
                f"a parameter of shape {tuple(p.shape)} got its gradient twice in one backward "
                "(reentrant activation checkpointing?); use use_reentrant=False"
            )
        self._ready.add(p)
        st.pending -= 1
        self._launch_ready()

    def _launch(self, st: _BucketState) -> None:
        chunk = self.groups[st.group].grads_flat[st.bucket.start : st.bucket.end]
        if self.prescale != 1.0:
            chunk.mul_(self.prescale)
        st.handle = self.comm.all_reduce(chunk, axis="dp", async_op=True)

    def _launch_ready(self) -> None:
        while (
            self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending <= 0
        ):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def finish_reduction(self) -> None:
        """Launch buckets whose parameters got no gradient this step, then wait for all."""
        if self.dp > 1:
            while self._next_launch < len(self.buckets):
                self._launch(self.buckets[self._next_launch])
                self._next_launch += 1
            for st in self.buckets:
                st.handle.wait()
        self._reset_pending()

    # ----------------------------------------------------------------------------- step
    def master_params(self) -> list[nn.Parameter]:
        return [fg.master for fg in self.groups]

    def unscale(self, loss_scale: float, check_overflow: bool) -> bool:
        """Give each master its averaged, unscaled fp32 gradient; True if any is inf/nan."""
        post = 1.0 / (loss_scale * self.dp * self.prescale) if self.dp > 1 else 1.0 / loss_scale
        overflow = False
        for fg in self.groups:
            if check_overflow and not bool(torch.isfinite(fg.grads_flat).all()):
                overflow = True
            if fg.master.data_ptr() == fg.params_flat.data_ptr():
                fg.master.grad = fg.grads_flat
                if post != 1.0:
                    fg.grads_flat.mul_(post)
            else:
                fg.master.grad = fg.grads_flat.to(torch.float32).mul_(post)
        return overflow

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the master gradients (identical on every dp rank after all-reduce)."""
        sq = sum(
            torch.linalg.vector_norm(fg.master.grad, dtype=torch.float32) ** 2 for fg in self.groups
        )
        return torch.as_tensor(sq).sqrt()

    def scale_grads(self, factor: float) -> None:
        for fg in self.groups:
            fg.master.grad.mul_(factor)

    def after_step(self) -> None:
        """Write updated masters into the compute-dtype parameters."""
        for fg in self.groups:
            if fg.master.data_ptr() != fg.params_flat.data_ptr():
                fg.params_flat.copy_(fg.master.detach())

    def zero_grad(self) -> None:
        for fg in self.groups:
            fg.grads_flat.zero_()
            fg.master.grad = None

    # ----------------------------------------------------------------------------- accounting
    def memory_breakdown(self, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients, fp32 master weights, optimizer state."""
        tracked = set(self._where)
        params = sum(fg.params_flat.nbytes for fg in self.groups)
        params += sum(p.nbytes for p in self.module.parameters() if p not in tracked)
        master = sum(
            fg.master.nbytes
            for fg in self.groups
            if fg.master.data_ptr() != fg.params_flat.data_ptr()
        )
        state = 0
        if optimizer is not None:
            for s in optimizer.state.values():
                state += sum(t.nbytes for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        return {
            "params": params,
            "grads": sum(fg.grads_flat.nbytes for fg in self.groups),
            "master": master,
            "optimizer": state,
        }
