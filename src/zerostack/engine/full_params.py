"""One parameter's full fp32 value, gradient and optimizer state, read and written by every rank.

This is the engine's side of DeepSpeed's ``deepspeed.utils.safe_get_full_fp32_param`` and its
siblings (:mod:`zerostack.utils` is the facade). "Full" is the parameter as the model defines
it: its dp pieces (ZeRO 1-3) put together and its tensor-parallel slices joined. Reads are
collectives over the dp and tp groups of the parameter's pipeline stage, so every rank that holds
the parameter calls them, as in DeepSpeed; writes take the same full value on every rank and need
no communication.

The values come from the strategy's own records (``owned_slices``, ``read_master`` /
``write_master``, ``window_grad``), so offloaded masters (host memory or NVMe files) are read and
written where they live. Only parameters the optimizer steps have a master: a frozen one gives
None, as in DeepSpeed.

Gradients are the mean over the global batch so far in the accumulation window, unscaled: what
the optimizer step would apply before clipping. (DeepSpeed's fp16 gradients at that point are
still multiplied by the loss scale; in bf16 and fp32 the two agree.) A gradient set is given in
the same terms and stored as the strategy holds it (summed over dp and scaled), so the step
clips, unscales and averages it like one backward made; later micro-steps of the window add to it.
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict

import torch
from torch import nn

from ..tensor_parallel import join_tensors, partition_spec, split_tensor
from ..zero.stage3.collectives import gather_full
from ..zero.stage3.params import full_shape
from ..zero.strategy import Pieces


class _EngineRef:
    """A parameter's link to the engine that trains it (``p._zerostack_engine``): a weak
    reference that a copied or pickled model does not carry along."""

    def __init__(self, engine=None) -> None:
        self._ref = weakref.ref(engine) if engine is not None else None

    def __call__(self):
        return self._ref() if self._ref is not None else None

    def __reduce__(self):
        return (_EngineRef, ())

    def __deepcopy__(self, memo):
        return _EngineRef()


def attach(engine, module: nn.Module) -> None:
    """Mark ``module``'s parameters as trained by ``engine`` (for :func:`engine_of`)."""
    for p in module.parameters():
        p._zerostack_engine = _EngineRef(engine)


def engine_of(p: torch.Tensor):
    """The engine training ``p``, or None."""
    ref = getattr(p, "_zerostack_engine", None)
    return ref() if ref is not None else None


class FullParams:
    """Full values of single parameters of one engine (``engine.full_params``)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._slices: dict[nn.Parameter, list[tuple]] | None = None

    @property
    def device(self) -> torch.device:
        return self.engine.topology.device

    # ------------------------------------------------------------------ where values live
    def _slices_of(self, p: nn.Parameter) -> list[tuple]:
        """``(lo, hi, master, a, b)``: elements ``[lo, hi)`` of ``p`` (flat, this tp rank's
        slice) are ``master[a:b]`` on this rank."""
        if self._slices is None:
            index = defaultdict(list)
            for q, lo, hi, master, a, b in self.engine.zero.owned_slices():
                if hi > lo:
                    index[q].append((lo, hi, master, a, b))
            self._slices = dict(index)
        return self._slices.get(p, [])

    def _check_kind(self, kind: str, what: str) -> None:
        """The optimizer keeps ``kind`` (checked on this rank's first master; every rank has the
        same optimizer and masters, so all raise alike, before any collective)."""
        if kind == "master":
            return
        zero = self.engine.zero
        keys = zero.read_master(zero.masters()[0], self.engine.optimizer).keys() - {"master"}
        if kind not in keys:
            raise KeyError(
                f"{what}: the optimizer has no state {kind!r} per element "
                f"(it has {sorted(keys)}; none before its first step)"
            )

    # ------------------------------------------------------------------ tensor parallelism
    def join_tp(self, p: nn.Parameter, t: torch.Tensor) -> torch.Tensor:
        """The whole parameter from this tp rank's slice ``t`` (a collective over tp)."""
        tp, spec = self.engine.topology.tp, partition_spec(p)
        if tp == 1 or spec is None:
            return t
        t = t.contiguous()
        parts = t.new_empty((tp, *t.shape))
        self.engine.comm.all_gather(parts.view(-1), t.view(-1), axis="tp")
        return join_tensors(list(parts.unbind(0)), dim=spec[0], chunks=spec[1])

    def split_tp(self, p: nn.Parameter, value: torch.Tensor, what: str) -> torch.Tensor:
        """This tp rank's slice of the whole ``value``, flat fp32 on the engine's device."""
        topo, spec = self.engine.topology, partition_spec(p)
        shape = list(full_shape(p))
        if spec is not None:
            shape[spec[0]] *= topo.tp
        if list(value.shape) != shape:
            raise ValueError(
                f"{what}: value has shape {tuple(value.shape)}, the parameter {tuple(shape)}"
            )
        if topo.tp > 1 and spec is not None:
            value = split_tensor(
                value, parts=topo.tp, rank=topo.rank("tp"), dim=spec[0], chunks=spec[1]
            )
        return value.detach().reshape(-1).to(device=self.device, dtype=torch.float32)

    # ------------------------------------------------------------------ full values
    def value(self, p: nn.Parameter, kind: str = "master", what: str = "") -> torch.Tensor | None:
        """``p``'s fp32 master (``kind="master"``) or optimizer state ``kind``, whole; None for a
        parameter the optimizer does not step. A collective over dp and tp."""
        zero = self.engine.zero
        if not zero.is_trained(p):
            return None
        self._check_kind(kind, what)
        out = torch.zeros(math.prod(full_shape(p)), dtype=torch.float32, device=self.device)
        for lo, hi, master, a, b in self._slices_of(p):
            out[lo:hi] = zero.read_master(master, self.engine.optimizer)[kind][a:b]
        axis = zero.state_axis(p)
        if axis is not None:  # each rank of the axis holds other elements (the rest are zeros)
            self.engine.comm.all_reduce(out, axis=axis)
        return self.join_tp(p, out.view(full_shape(p)))

    def set_value(
        self, p: nn.Parameter, value: torch.Tensor, kind: str = "master", what: str = ""
    ) -> None:
        """Set ``p``'s fp32 master (and its compute-dtype value, so the next forward uses it) or
        its optimizer state ``kind`` to the whole ``value`` (the same on every rank). A no-op for
        a parameter the optimizer does not step."""
        if not self.engine.zero.is_trained(p):
            return
        self._check_kind(kind, what)
        self.set_local(p, self.split_tp(p, value, what), kind)

    def set_local(self, p: nn.Parameter, flat: torch.Tensor, kind: str = "master") -> None:
        """As :meth:`set_value`, given this tp rank's slice of ``p`` flat in fp32."""
        zero, opt = self.engine.zero, self.engine.optimizer
        for lo, hi, master, a, b in self._slices_of(p):
            values = zero.read_master(master, opt)
            values[kind][a:b].copy_(flat[lo:hi])
            zero.write_master(master, opt, values)
        if kind == "master":
            zero.write_param(p, flat)

    def grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """``p``'s gradient so far in this accumulation window: the mean over the global batch,
        unscaled, fp32, whole (None for a parameter the optimizer does not step). Between
        ``backward`` and ``step`` on the boundary it is what the step applies before clipping.
        A collective over dp and tp (over dp x ep for what MoE's ep ranks share)."""
        zero = self.engine.zero
        if not zero.is_trained(p):
            return None
        post = zero.grad_post(self.engine.loss_scaler.loss_scale)
        grad = zero.window_grad(p).mul(post)  # not in place: it may be the shard itself (dp 1)
        return self.join_tp(p, grad.view(full_shape(p)))

    def set_grad(self, p: nn.Parameter, value: torch.Tensor, what: str = "") -> None:
        """Make the whole ``value`` (the same on every rank) ``p``'s gradient so far in this
        window: what :meth:`grad` reads back and, between ``backward`` and ``step`` on the
        boundary, what the step applies before clipping. A no-op for a parameter the optimizer
        does not step. At stages 0-1 a collective over dp (it waits for the boundary's
        reduction)."""
        zero = self.engine.zero
        if not zero.is_trained(p):
            return
        flat = self.split_tp(p, value, what)
        zero.hold_grad(p, self._held(flat))

    def _held(self, mean: torch.Tensor) -> torch.Tensor:
        """A mean, unscaled gradient as the strategy holds it: summed over dp and scaled."""
        return mean / self.engine.zero.grad_post(self.engine.loss_scaler.loss_scale)

    # ------------------------------------------------------------------ this rank's piece
    def _local_extent(self, p: nn.Parameter) -> int:
        """How many elements of this rank's stage-3 piece are the parameter's (the rest pad)."""
        lo, hi = p._zs.extent()
        return hi - lo

    def _check_piece(self, p: nn.Parameter, value: torch.Tensor, what: str) -> torch.Tensor:
        """``value`` as this rank's piece of ``p``: flat fp32 on the engine's device."""
        pn = p._zs.piece.numel()
        if value.numel() != pn:
            raise ValueError(
                f"{what}: value has {value.numel()} elements, this rank's piece {pn} "
                "(padding included)"
            )
        flat = value.detach().reshape(-1)
        return flat.to(device=self.device, dtype=torch.float32, copy=True)

    def _require_stage3(self, what: str) -> None:
        if not isinstance(self.engine.zero, Pieces):
            raise ValueError(
                f"{what}: only defined for ZeRO stage 3 partitioned parameters "
                f"(this engine runs stage {self.engine.zero.stage})"
            )

    def local_value(self, p: nn.Parameter, kind: str = "master", what: str = ""):
        """This rank's piece of ``p``'s fp32 master or optimizer state ``kind`` (stage 3; its
        padding included, as DeepSpeed's partition)."""
        self._require_stage3(what)
        if not self.engine.zero.is_trained(p):
            return None
        self._check_kind(kind, what)
        out = torch.zeros(p._zs.piece.numel(), dtype=torch.float32, device=self.device)
        for lo, hi, master, a, b in self._slices_of(p):
            out[: hi - lo] = self.engine.zero.read_master(master, self.engine.optimizer)[kind][a:b]
        return out

    def local_grad(self, p: nn.Parameter, what: str = ""):
        """This rank's piece of :meth:`grad` (stage 3)."""
        self._require_stage3(what)
        zero = self.engine.zero
        if not zero.is_trained(p):
            return None
        post = zero.grad_post(self.engine.loss_scaler.loss_scale)
        return zero.local_grad(p).to(self.device).mul_(post)

    def set_local_value(self, p: nn.Parameter, value: torch.Tensor, kind: str, what: str) -> None:
        """Set this rank's piece of ``p``'s fp32 master (``kind="master"``) or optimizer state
        ``kind`` (stage 3; ``value`` padded as :meth:`local_value` gives it). Setting the master
        is a collective over dp (every rank sets its own piece): the pieces are gathered so that
        a parameter kept whole (``stage3_param_persistence_threshold``) is updated too, and the
        next forward uses the new value, as :meth:`set_value`."""
        self._require_stage3(what)
        if not self.engine.zero.is_trained(p):
            return
        self._check_kind(kind, what)
        piece, n, st = self._check_piece(p, value, what), self._local_extent(p), p._zs
        piece[n:] = 0.0
        if kind == "master":
            flat = gather_full([st.like(piece)], self.engine.comm)[0]
            self.set_local(p, flat.reshape(-1), kind)
            return
        # only this rank's elements [lo, lo + n) are read from ``flat``: no communication
        lo, _ = st.extent()
        flat = torch.zeros(st.numel, dtype=torch.float32, device=piece.device)
        flat[lo : lo + n] = piece[:n]
        self.set_local(p, flat, kind)

    def set_local_grad(self, p: nn.Parameter, value: torch.Tensor, what: str = "") -> None:
        """Set this rank's piece of ``p``'s gradient (stage 3; mean, unscaled, as
        :meth:`local_grad` gives it). No communication."""
        self._require_stage3(what)
        if self.engine.zero.is_trained(p):
            self.engine.zero.hold_local_grad(p, self._held(self._check_piece(p, value, what)))
