"""One gradient reducer for every ZeRO stage: buckets that launch their own collective when ready.

Parameters are grouped into buckets (stages 0-2: ranges of a flat buffer, see
:mod:`.partition`; stage 3: a few modules' parameters). As backward produces each gradient, the
strategy stages it and reports it (:meth:`GradReducer.arrived`); once every parameter of the
earliest bucket not yet launched has arrived, that bucket's collective starts, asynchronously,
while backward goes on. Buckets launch strictly in order, so every rank issues the same
collectives in the same order even when gradients become ready in a different order.
:meth:`GradReducer.flush` launches the buckets left (some of their parameters got no gradient)
and waits for all of them.

What a bucket's collective is (all-reduce, reduce-scatter) and where its result goes is the
strategy's ``launch(bucket) -> Handle | None`` (None: nothing to wait for). A strategy whose
buffers take memory until it consumes them (stage 3's reduced pieces, stage 2's staged buckets;
stage 1 too, so its waits overlap backward) passes ``done(bucket)``: then at most
``in_flight`` buckets are outstanding, the oldest is waited for and handed to ``done`` as a new
one launches, and its buffers go while backward goes on (as FSDP2 waits for the previous
reduce-scatter). A bucket is reduced in ``communication_data_type``: :func:`in_dtype` gives
the tensor to send (a cast copy when the gradients are held in another dtype), and
:class:`CastBack` copies an all-reduce's result back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..comm import Handle


def in_dtype(grads: torch.Tensor, dtype: torch.dtype, prescale: float = 1.0) -> torch.Tensor:
    """``grads`` as the collective sends them: in ``dtype`` (a copy when it differs, else
    ``grads`` itself), times ``prescale`` (in place)."""
    out = grads if grads.dtype == dtype else grads.to(dtype)
    return out.mul_(prescale) if prescale != 1.0 else out


class CastBack:
    """An all-reduce run on a copy in another dtype: :meth:`wait` waits, then writes the result
    into the gradients it was made from (once, however often it is waited on)."""

    def __init__(self, handle: Handle, sent: torch.Tensor, into: torch.Tensor) -> None:
        self._handle, self._sent, self._into = handle, sent, into

    def wait(self) -> None:
        self._handle.wait()
        if self._sent is not None:
            self._into.copy_(self._sent)
            self._sent = None


class GradReducer:
    """Readiness and in-order async launch of gradient buckets."""

    def __init__(
        self,
        sizes: list[int],
        launch: Callable[[int], Handle | CastBack | None],
        done: Callable[[int], None] | None = None,
        in_flight: int = 2,
    ) -> None:
        self._sizes = list(sizes)  # parameters per bucket
        self._launch = launch
        self._done, self._in_flight = done, in_flight
        self.reset()

    def reset(self) -> None:
        """Start a new backward: nothing arrived, nothing launched."""
        self._arrived = [0] * len(self._sizes)
        self._next = 0
        self._handles: list[tuple[int, Handle | CastBack | None]] = []
        self._waited = 0  # self._handles[:_waited] are complete (and handed to ``done``)

    def arrived(self, bucket: int, *, launch: bool = True) -> None:
        """One parameter of ``bucket`` has its gradient staged; launch what is ready (unless
        ``launch`` is false: this backward only counts, a later flush communicates)."""
        self._arrived[bucket] += 1
        if launch:
            self.launch_ready()

    def launch_ready(self) -> None:
        while (
            self._next < len(self._sizes) and self._arrived[self._next] >= self._sizes[self._next]
        ):
            self._start(self._next)

    def _start(self, bucket: int) -> None:
        self._handles.append((bucket, self._launch(bucket)))
        self._next += 1
        if self._done is not None:
            while len(self._handles) - self._waited > self._in_flight:
                self._wait_oldest()

    def _wait_oldest(self) -> None:
        bucket, handle = self._handles[self._waited]
        if handle is not None:
            handle.wait()
        self._handles[self._waited] = (bucket, None)  # the collective's buffers may go
        self._waited += 1
        if self._done is not None:
            self._done(bucket)

    def settle(self) -> bool:
        """If this backward has reported or launched anything: launch the buckets left and wait
        for every one, keeping the record (a later :meth:`flush` launches nothing again).
        Returns whether there was anything (False: no reduction of this window has begun)."""
        if self._next == 0 and not any(self._arrived):
            return False
        self._launch_rest_and_wait()
        return True

    def _launch_rest_and_wait(self) -> None:
        while self._next < len(self._sizes):
            self._start(self._next)
        while self._waited < len(self._handles):
            self._wait_oldest()

    def flush(self) -> list[int]:
        """Launch every bucket not launched yet, wait for all; the buckets of this backward, in
        launch order. The reducer is then reset."""
        self._launch_rest_and_wait()
        done = [b for b, _ in self._handles]
        self.reset()
        return done


def hook_grads(params: list[nn.Parameter], hook) -> list:
    """``hook(p)`` registered as each of ``params``' post-accumulate-grad hook, skipped while
    ``p.ds_grad_is_ready`` is False: DeepSpeed's flag (True on each parameter here, as its
    default), which a tiled backward calling autograd once per tile sets False on all but the
    last tile (ALST's TiledMLP in axolotl), so that the gradient, summed in ``p.grad``, is
    taken once."""

    def when_ready(p: nn.Parameter) -> None:
        if p.ds_grad_is_ready:
            hook(p)

    for p in params:
        p.ds_grad_is_ready = True
    return [p.register_post_accumulate_grad_hook(when_ready) for p in params]
