"""Frozen stage-3 parameters kept as int8 blocks (DeepSpeed's Mixed Precision ZeRO++:
``zero_quantized_nontrainable_weights``).

A LoRA run trains adapters beside a frozen base model whose pieces are most of what each rank
holds. With this setting each frozen parameter's piece is quantized once, at ``initialize``, in
the blocks and format of ZeRO++'s qwZ (:mod:`.quantize`: 32 elements to a bf16 scale, 1.0625
bytes an element where bf16 takes 2 and fp32 4) and kept so: the gathers carry those bytes as
they are and every rank computes with the same dequantized weights. It is lossy by design, as
DeepSpeed's: the frozen weights become their quantized values (within half a block step), once;
trained parameters are untouched.

:class:`QuantizedPiece` is the parameter's shard record with its piece stored so: reading
``piece`` dequantizes (checkpoints, consolidation and ``GatheredParameters`` see plain values),
writing it quantizes, unless the value is the one the blocks already hold (a checkpoint of the
run loaded back keeps the blocks bit for bit: quantizing twice is not the identity).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from ...config import ConfigError
from . import quantize
from .params import ShardState, is_sharded

log = logging.getLogger("zerostack")


class QuantizedPiece(ShardState):
    """A frozen parameter's shard record whose piece is held as one qwZ payload (``payload``):
    the piece's block scales then its int8 values."""

    payload: torch.Tensor
    dtype: torch.dtype
    width: int  # the piece's elements, padding included

    @property
    def piece(self) -> torch.Tensor:
        rows = self.payload.view(1, -1)
        return quantize.unpack(rows, [self.width], self.dtype)[0].view(-1)

    @piece.setter
    def piece(self, value: torch.Tensor) -> None:
        held = self.__dict__.get("payload")
        if held is not None and value.dtype == self.dtype and torch.equal(value, self.piece):
            return  # the value these blocks hold: kept as they are
        self.dtype, self.width = value.dtype, value.numel()
        payload = quantize.pack([value.reshape(-1)])
        self.payload = payload if self.meter is None else self.meter.track(payload)

    @property
    def stored(self) -> torch.Tensor:
        return self.payload  # also its ds_tensor: DeepSpeed's quantized one is int8 and scales

    def write(self, value: torch.Tensor) -> None:
        self.piece = value.to(self.dtype)


def quantize_frozen(params: list[nn.Parameter]) -> int:
    """Make each stage-3 parameter of ``params`` that is not yet one a :class:`QuantizedPiece`
    (its piece quantized); returns how many were."""
    done = 0
    for p in params:
        if not is_sharded(p) or isinstance(p._zs, QuantizedPiece):
            continue
        old = p._zs
        fields = {f.name: getattr(old, f.name) for f in dataclasses.fields(old)}
        fields["owner"] = None  # set again below, once the payload exists
        fields["meter"] = None  # the payload is counted once made (below)
        st = p._zs = QuantizedPiece(**fields)
        st.owner, st.meter = old.owner, old.meter
        if st.meter is not None:
            st.meter.track(st.payload)
        p.ds_tensor = st.payload  # DeepSpeed's quantized ds_tensor: int8 and its scales
        done += 1
    return done


def quantize_at_start(enabled: bool, params: list, trainable: set, swapper) -> None:
    """Stage 3's ``initialize``: with the setting (``enabled``), the pieces of ``params`` not
    in ``trainable`` quantized (refused when ``zero.Init(remote_device=...)`` put the pieces in
    files: they must stay in memory)."""
    if not enabled:
        return
    if swapper.offloads:
        raise ConfigError(
            "zero_optimization.zero_quantized_nontrainable_weights: keeps frozen pieces "
            "quantized in memory; zero.Init(remote_device=...) put them in files"
        )
    quantize_frozen([p for p in params if p not in trainable])


def quantize_nontrainable(zero, module: nn.Module) -> int:
    """DeepSpeed's stage-3 ``optimizer.quantize_nontrainable_params()``: quantize the frozen
    parameters not quantized yet (with ``zero_quantized_nontrainable_weights``; without it,
    a warning and nothing done, as DeepSpeed). A parameter frozen after ``initialize`` still
    has its master and optimizer state: refused, naming how many (freeze before)."""
    if not getattr(zero, "quantized_frozen", False):
        log.warning(
            "quantize_nontrainable_params() called with zero_quantized_nontrainable_weights "
            "disabled: nothing quantized"
        )
        return 0
    params = list(dict.fromkeys(module.parameters()))
    later = [p for p in params if zero.is_trained(p) and not p.requires_grad]
    if later:
        raise RuntimeError(
            f"quantize_nontrainable_params: {len(later)} parameters were frozen after "
            "initialize and keep their masters and optimizer state; freeze them before "
            "initialize (DeepSpeed-Chat's LoRA scripts do)"
        )
    from .gather import gather_now

    zero.release_gathered()
    frozen = [p for p in params if not zero.is_trained(p)]
    done = quantize_frozen(frozen)
    kept = [p for p in frozen if p._zs.persistent]  # gathered whole: from the blocks now
    if kept:
        gather_now(kept, kept[0]._zs.comm, kept[0]._zs.meter)
    return done
