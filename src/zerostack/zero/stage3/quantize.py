"""ZeRO++ quantized weights (qwZ, DeepSpeed's ``zero_quantized_weights``): stage 3's parameter
all-gathers for forward and backward carry int8 values, in blocks of :data:`BLOCK` elements with
one bf16 scale per block, instead of the compute dtype's values.

Symmetric, per block: ``scale = max |x| / 127`` (in fp32), rounded up to the next bf16 value so
that no ``|x| / scale`` passes 127; ``q = round(x / scale)``; the value used is ``q * scale``,
within ``scale / 2`` of ``x`` (a step at most 2**-7 coarser than an fp32 scale's). Each
parameter's piece is quantized on its own, from its first element, so what a rank sends depends
on its pieces alone, never on which parameters a gather happens to group. Every rank, the
piece's owner included, computes with the dequantized bytes the collective delivered, so the
ranks' weights stay identical. Only the gathered copies are approximate: the pieces, the fp32
masters, the optimizer and checkpoints keep exact values (the gradient is taken at the
quantized weights and applied to the exact ones).

One rank's payload is one uint8 tensor: every piece's block scales (bf16, in piece order), then
every piece's int8 values, padded to a multiple of 2 bytes so that the next rank's scales start
aligned in the gathered buffer. Per element that is 1 byte plus 2 / BLOCK of scale (1.0625):
3.76x fewer bytes than fp32, 1.88x fewer than bf16.

``bits=4`` (qgZ's ``zero_quantized_gradients_bits``, DeepSpeed's wire format size): the same
blocks and scales with ``scale = max |x| / 7`` and values -7 .. 7, two to a byte (element
``2i`` in the low nibble, ``2i + 1`` in the high one, each as value + 8; a piece of odd length
ends in a half byte). Per element 0.5 byte plus 2 / BLOCK: 7.11x fewer bytes than fp32.
"""

from __future__ import annotations

import torch

BLOCK = 32
"""Elements that share one scale: small enough that one large weight does not coarsen many
others (the demo's 300 steps end 0.4% above plain stage 3's loss at 32, 1.4% at 256), large
enough that the scales cost a sixteenth of a byte per element (3.76x fewer bytes than fp32)."""

LEVELS = 127
"""Largest quantized magnitude (int8, symmetric: -127 .. 127)."""

BITS = (8, 4)
"""The value widths a payload may use."""


def levels(bits: int) -> int:
    """Largest quantized magnitude of ``bits``-bit values: 127 (int8), 7 (int4)."""
    if bits not in BITS:
        raise ValueError(f"quantized values are 8 or 4 bits, not {bits}")
    return LEVELS if bits == 8 else 7


def value_bytes(numel: int, bits: int = 8) -> int:
    """Bytes of one piece's values: one each at 8 bits, two to a byte at 4."""
    return numel if bits == 8 else -(-numel // 2)


SCALE = torch.bfloat16
"""The scales' dtype on the wire: fp32's range, 2 bytes."""


def blocks(numel: int) -> int:
    """Blocks of a piece of ``numel`` elements (the last one may be short)."""
    return -(-numel // BLOCK)


def payload_bytes(numels: list[int], bits: int = 8) -> int:
    """Bytes one rank sends for pieces of ``numels`` elements."""
    raw = 2 * sum(blocks(n) for n in numels) + sum(value_bytes(n, bits) for n in numels)
    return -(-raw // 2) * 2


def _bf16_up(x: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 ``x`` rounded up to the nearest bf16 value (its top 16 bits, plus one
    in the last of them when any lower bit is set), as fp32."""
    bits = x.view(torch.int32)
    return ((bits + 0xFFFF) & -0x10000).view(torch.float32)


def _quantize_blocks(x: torch.Tensor, top: int = LEVELS) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 values in -top .. top, bf16 scale per block, as fp32)`` of fp32 blocks ``x``
    (blocks, BLOCK), which it overwrites."""
    scale = _bf16_up(x.abs().amax(dim=1) / top)
    divisor = scale.masked_fill(scale == 0, 1.0)  # an all-zero block stays zero
    q = torch.round(x.div_(divisor[:, None])).clamp_(-top, top).to(torch.int8)
    return q.view(-1), scale


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """int8 values -7 .. 7, two to a uint8, each as value + 8: element 2i in the low nibble,
    2i + 1 in the high one (a lone last element gets 8, a zero, above it)."""
    u = q.to(torch.uint8) + 8  # wraps -7 .. -1 to 1 .. 7 (mod 256, then + 8: exact)
    if u.numel() % 2:
        u = torch.cat([u, u.new_full((1,), 8)])
    pairs = u.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _from_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The values :func:`_nibbles` packed, per row of ``packed`` (rows, bytes): (rows, numel)
    int8."""
    low = (packed & 15).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=-1).view(packed.shape[0], -1)[:, :numel]


def _block_offsets(numels: list[int]) -> list[int]:
    """Where each piece's first block is among all the pieces' blocks."""
    offsets, at = [], 0
    for n in numels:
        offsets.append(at)
        at += blocks(n)
    return offsets


def pack(pieces: list[torch.Tensor], bits: int = 8) -> torch.Tensor:
    """One rank's payload for ``pieces`` (see the module doc): the pieces laid out block-aligned
    in one fp32 buffer, quantized in one pass, their values copied out without the padding."""
    top = levels(bits)
    numels = [p.numel() for p in pieces]
    starts, n_scales = _block_offsets(numels), sum(blocks(n) for n in numels)
    device = pieces[0].device
    x = torch.zeros(n_scales * BLOCK, dtype=torch.float32, device=device)
    for piece, b in zip(pieces, starts, strict=True):
        x[b * BLOCK : b * BLOCK + piece.numel()].copy_(piece.reshape(-1))
    q, scale = _quantize_blocks(x.view(n_scales, BLOCK), top)
    out = torch.zeros(payload_bytes(numels, bits), dtype=torch.uint8, device=device)
    out[: 2 * n_scales].view(SCALE).copy_(scale)  # exact: each scale is a bf16 value
    values = out[2 * n_scales :]
    v_off = 0
    for n, b in zip(numels, starts, strict=True):
        qp = q[b * BLOCK : b * BLOCK + n]
        size = value_bytes(n, bits)
        values[v_off : v_off + size].copy_(qp.view(torch.uint8) if bits == 8 else _nibbles(qp))
        v_off += size
    return out


def unpack(
    rows: torch.Tensor, numels: list[int], dtype: torch.dtype, bits: int = 8
) -> list[torch.Tensor]:
    """Every rank's dequantized pieces from the gathered payloads ``rows`` (world, bytes) of
    ``bits``-bit values: one (world, numel) tensor of ``dtype`` per piece."""
    levels(bits)
    starts, n_scales = _block_offsets(numels), sum(blocks(n) for n in numels)
    world = rows.shape[0]
    scales = rows[:, : 2 * n_scales].view(SCALE).float()
    values = rows[:, 2 * n_scales :]
    x = torch.zeros(world, n_scales * BLOCK, dtype=torch.float32, device=rows.device)
    v_off = 0
    for n, b in zip(numels, starts, strict=True):
        size = value_bytes(n, bits)
        raw = values[:, v_off : v_off + size]
        x[:, b * BLOCK : b * BLOCK + n].copy_(
            raw.view(torch.int8) if bits == 8 else _from_nibbles(raw, n)
        )
        v_off += size
    x.view(world, n_scales, BLOCK).mul_(scales.unsqueeze(-1))
    return [x[:, b * BLOCK : b * BLOCK + n].to(dtype) for n, b in zip(numels, starts, strict=True)]
