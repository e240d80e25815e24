"""Tiled compute over the sequence (DeepSpeed ALST's ``TiledMLP``, ``SequenceTiledCompute``,
``sequence_tiled_compute`` and ``TiledFusedLogitsLoss``, with their signatures)::

    out = TiledMLP.apply(mlp_forward, mlp, x, shards, compute_params)     # x: [b, s, h]
    loss = TiledFusedLogitsLoss.apply(loss_fn, model, hidden, labels, None, shards, params, "mean")

A per-token function over a long sequence makes an intermediate far larger than its input and
output: the MLP's ``[b, s, ffn]`` hidden, the ``[b, s, vocab]`` logits. Run over ``shards``
slices ("tiles") of the sequence, one tile's intermediate is alive at a time. Forward keeps no
graph; backward runs each tile again (the loss takes its gradients in forward, as DeepSpeed's).

How these differ from DeepSpeed's, by design:

- The parameters ``fn`` uses (``compute_params``, and those of ``self`` or ``kwargs_to_pass``)
  are inputs of the autograd Function: autograd accumulates their gradients once per backward,
  and a post-accumulate-grad hook (ZeRO's reducers) fires once, not per tile (DeepSpeed's flag
  ``ds_grad_is_ready`` is not needed).
- Tiles are ``torch.tensor_split``'s: exactly ``shards`` of them, the first ``n % shards`` one
  position longer. DeepSpeed's ``ceil(n / shards)`` steps can make fewer tiles (or an empty
  one) while its ``"mean"`` still divides by ``shards``. ``shards`` outside ``1..n`` is an error.
- ``TiledFusedLogitsLoss``'s ``"mean"`` is over every counted token (see its docstring), and
  its parameter gradients, scaled by the incoming gradient, reach ``.grad`` in backward only.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..zero.init import GatheredParameters  # ZeRO-3: compute_params whole while the tiles run

IGNORE_INDEX = -100
_REDUCTIONS = (None, "mean", "sum")


def _tiles(n: int, shards: Any, what: str) -> list[tuple[int, int]]:
    """``(start, length)`` of ``shards`` consecutive tiles of ``n`` positions, the first
    ``n % shards`` one longer, so every tile holds at least one position."""
    shards = operator.index(shards)
    if not 1 <= shards <= n:
        raise ValueError(f"{what}: shards={shards} must be between 1 and the {n} positions tiled")
    step, extra = divmod(n, shards)
    sizes = [step + (1 if i < extra else 0) for i in range(shards)]
    return list(zip(itertools.accumulate(sizes[:-1], initial=0), sizes, strict=True))


def _params(
    compute_params: Iterable[torch.Tensor] | None,
    owners: Iterable[Any],
    exclude: Iterable[Any] = (),
) -> list[torch.Tensor]:
    """The tensors to differentiate ``fn`` by, besides its tensor arguments: ``compute_params``
    and the parameters of any module among ``owners``, each once, those requiring grad."""
    seen = {id(t) for t in exclude if torch.is_tensor(t)}
    found = list(compute_params or ())
    for o in owners:
        if isinstance(o, nn.Module):
            found.extend(o.parameters())
    out = []
    for p in found:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class _Sums:
    """Per-input gradient sums over the tiles; a sum is added into in place only once it is a
    tensor of its own (the first tile's gradient may alias one autograd handed out)."""

    def __init__(self, n: int) -> None:
        self.acc: list[torch.Tensor | None] = [None] * n
        self.owned = [False] * n

    def add(self, j: int, g: torch.Tensor | None) -> None:
        if g is not None and self.acc[j] is None:
            self.acc[j] = g
        elif g is not None:
            self.acc[j] = self.acc[j].add_(g) if self.owned[j] else self.acc[j] + g
            self.owned[j] = True


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], grad_out: torch.Tensor) -> tuple:
    """``out``'s gradients by ``inputs`` (None where unused, all None when none is needed)."""
    if not inputs or not out.requires_grad:
        return (None,) * len(inputs)
    return torch.autograd.grad(out, inputs, grad_out, allow_unused=True)


class TiledMLP(torch.autograd.Function):
    """``fn(self, x)`` over ``shards`` tiles of ``x``'s second-to-last dimension (the sequence
    of ``[b, s, h]``, or the tokens of ``[tokens, h]``), so only one tile's MLP hidden exists at
    a time; backward runs each tile again. ``fn`` must treat positions independently.

    ``compute_params`` (DeepSpeed needs it for ZeRO) may be None: the parameters of ``self``
    get their gradients either way, also when ``x`` does not require grad.

    Example, a Llama MLP::

        def mlp_forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

        out = TiledMLP.apply(mlp_forward, mlp, x, 4, list(mlp.parameters()))
    """

    @classmethod
    def apply(
        cls,
        fn: Callable,
        self: Any,
        x: torch.Tensor,
        shards: int,
        compute_params: Iterable[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        params = _params(compute_params, [self], exclude=[x])
        return super().apply(fn, self, x, shards, compute_params, *params)

    @staticmethod
    def forward(ctx, fn, self, x, shards, compute_params, *params) -> torch.Tensor:
        if x.dim() < 2:
            raise ValueError(f"TiledMLP: x must be [..., seq, hidden], got shape {tuple(x.shape)}")
        tiles = _tiles(x.shape[-2], shards, "TiledMLP")
        ctx.fn, ctx.self, ctx.tiles, ctx.params = fn, self, tiles, params
        ctx.save_for_backward(x)
        out = None
        with torch.no_grad():
            for start, size in tiles:
                piece = fn(self, x.narrow(-2, start, size))
                if piece.dim() < 2 or piece.shape[-2] != size:
                    raise ValueError(
                        f"TiledMLP: fn must keep dim -2: a tile of {size} "
                        f"positions became {tuple(piece.shape)}"
                    )
                if out is None:
                    out = piece.new_empty(*piece.shape[:-2], x.shape[-2], piece.shape[-1])
                out.narrow(-2, start, size).copy_(piece)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        need_x = ctx.needs_input_grad[2]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[5:]) if need]
        x_grad = torch.zeros_like(x) if need_x else None  # zeros where fn ignores x
        sums = _Sums(len(ctx.params))
        for start, size in ctx.tiles:
            xt = x.narrow(-2, start, size).detach().requires_grad_(need_x)
            with torch.enable_grad():
                out = ctx.fn(ctx.self, xt)
            inputs = [xt] * need_x + [ctx.params[i] for i in wanted]
            gs = list(_grads(out, inputs, grad.narrow(-2, start, size)))
            if need_x and (gx := gs.pop(0)) is not None:
                x_grad.narrow(-2, start, size).copy_(gx)
            for i, g in zip(wanted, gs, strict=True):
                sums.add(i, g)
        return (None, None, x_grad, None, None, *sums.acc)


def sequence_tiled_compute(
    fn: Callable,
    seqlen: int,
    shards: int,
    kwargs_to_shard: dict,
    kwargs_to_pass: dict,
    grad_requiring_tensor_key: str,
    compute_params: Iterable[torch.Tensor] | None = None,
    output_unshard_dimension: int = 1,
    output_reduction: str | None = "mean",
) -> torch.Tensor:
    """``fn(**kwargs_to_shard, **kwargs_to_pass)`` over ``shards`` tiles of the sequence, the
    dimension 1 of every ``[b, seqlen, ...]`` tensor in ``kwargs_to_shard``; ``kwargs_to_pass``
    goes to every call whole. The tiles' outputs are joined along ``output_unshard_dimension``
    (0 stacks them: one scalar loss per tile), then reduced by ``output_reduction`` (None,
    ``"mean"`` or ``"sum"``). This is :class:`SequenceTiledCompute` with keyword dicts and
    defaults, which an autograd Function cannot take.

    Every tensor argument that requires grad gets its gradient (DeepSpeed returns one only for
    ``grad_requiring_tensor_key``, which must name a sharded tensor), as do ``compute_params``
    and the parameters of modules in ``kwargs_to_pass`` or bound to ``fn``.
    """
    return SequenceTiledCompute.apply(
        fn,
        seqlen,
        shards,
        list(kwargs_to_shard),
        list(kwargs_to_pass),
        grad_requiring_tensor_key,
        compute_params,
        output_unshard_dimension,
        output_reduction,
        *kwargs_to_shard.values(),
        *kwargs_to_pass.values(),
    )


class SequenceTiledCompute(torch.autograd.Function):
    """The autograd Function behind :func:`sequence_tiled_compute` (see it for the arguments):
    forward without a graph, tile by tile; backward runs each tile again and takes its
    gradient. A reduced output (``"mean"``, ``"sum"``) is summed tile by tile, so the joined
    output never exists."""

    @classmethod
    def apply(
        cls,
        fn,
        seqlen,
        shards,
        keys_to_shard,
        keys_to_pass,
        grad_requiring_tensor_key,
        compute_params,
        output_unshard_dimension,
        output_reduction,
        *args,
    ):
        n = len(keys_to_shard) + len(keys_to_pass)
        if len(args) != n:
            raise ValueError(f"SequenceTiledCompute: {len(args)} values for {n} keys")
        owners = [fn, getattr(fn, "__self__", None), *args[len(keys_to_shard) :]]
        params = _params(compute_params, owners, exclude=args)
        return super().apply(
            fn,
            seqlen,
            shards,
            keys_to_shard,
            keys_to_pass,
            grad_requiring_tensor_key,
            compute_params,
            output_unshard_dimension,
            output_reduction,
            *args,
            *params,
        )

    @staticmethod
    def forward(
        ctx,
        fn,
        seqlen,
        shards,
        keys_to_shard,
        keys_to_pass,
        grad_requiring_tensor_key,
        compute_params,
        output_unshard_dimension,
        output_reduction,
        *args,
    ):
        what = "SequenceTiledCompute"
        if grad_requiring_tensor_key not in keys_to_shard:
            raise ValueError(
                f"{what}: grad_requiring_tensor_key {grad_requiring_tensor_key!r} "
                f"is not a key of kwargs_to_shard {list(keys_to_shard)}"
            )
        if output_reduction not in _REDUCTIONS:
            raise ValueError(
                f"{what}: output_reduction {output_reduction!r} is not one of None, 'mean', 'sum'"
            )
        n_user = len(keys_to_shard) + len(keys_to_pass)
        shard_vals, params = args[: len(keys_to_shard)], args[n_user:]
        for k, v in zip(keys_to_shard, shard_vals, strict=True):
            if not torch.is_tensor(v) or v.dim() < 2 or v.shape[1] != seqlen:
                shape = tuple(v.shape) if torch.is_tensor(v) else type(v).__name__
                raise ValueError(
                    f"{what}: kwargs_to_shard[{k!r}] must be [b, seqlen={seqlen}, ...], got {shape}"
                )
        tiles = _tiles(seqlen, shards, what)
        user = args[:n_user]
        ctx.save_for_backward(*(a if torch.is_tensor(a) else None for a in user))
        ctx.other = [None if torch.is_tensor(a) else a for a in user]
        ctx.fn, ctx.tiles, ctx.params = fn, tiles, params
        ctx.keys, ctx.n_shard = list(keys_to_shard) + list(keys_to_pass), len(keys_to_shard)
        ctx.reduction = output_reduction
        dim = ctx.dim = output_unshard_dimension
        pieces, total, numel, sizes = [], None, 0, []
        with torch.no_grad():
            for start, size in tiles:
                out = fn(**_tile_kwargs(ctx, user, start, size))
                if dim == 0:
                    out = out.unsqueeze(0)
                sizes.append(out.shape[dim])
                if output_reduction is None:
                    pieces.append(out)
                    continue
                part = out.sum(dtype=torch.float32)
                total = part if total is None else total + part
                numel += out.numel()
        ctx.sizes, ctx.numel = sizes, numel
        if output_reduction is None:
            return torch.cat(pieces, dim=dim)
        return (total / numel if output_reduction == "mean" else total).to(out.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        user = [t if o is None else o for o, t in zip(ctx.other, ctx.saved_tensors, strict=True)]
        needs = ctx.needs_input_grad[9:]
        n_user, ns = len(user), ctx.n_shard
        # Passed tensors that need a gradient: one graph leaf for every tile, outside the caller's
        # graph (their gradient returns through this Function).
        for j in range(ns, n_user):
            if needs[j]:
                user[j] = user[j].detach().requires_grad_(True)
        full = [torch.zeros_like(user[j]) if needs[j] else None for j in range(ns)]
        sums = _Sums(n_user + len(ctx.params))
        wanted = [j for j in range(len(needs)) if needs[j]]
        offset = 0
        for i, (start, size) in enumerate(ctx.tiles):
            kw = _tile_kwargs(ctx, user, start, size)
            for j in range(ns):
                if needs[j]:
                    kw[ctx.keys[j]] = kw[ctx.keys[j]].detach().requires_grad_(True)
            with torch.enable_grad():
                out = ctx.fn(**kw)
                if ctx.dim == 0:
                    out = out.unsqueeze(0)
            if ctx.reduction is None:
                g = grad.narrow(ctx.dim, offset, ctx.sizes[i])
                offset += ctx.sizes[i]
            else:
                g = grad / ctx.numel if ctx.reduction == "mean" else grad
                g = g.to(out.dtype).expand(out.shape)
            inputs = [
                kw[ctx.keys[j]] if j < ns else user[j] if j < n_user else ctx.params[j - n_user]
                for j in wanted
            ]
            for j, gj in zip(wanted, _grads(out, inputs, g), strict=True):
                if j >= ns:
                    sums.add(j, gj)
                elif gj is not None:
                    full[j].narrow(1, start, size).copy_(gj)
        grads = full + sums.acc[ns:]
        return (None,) * 9 + tuple(grads)


def _tile_kwargs(ctx, user: list, start: int, size: int) -> dict[str, Any]:
    """The keyword arguments of one tile's call: sharded values narrowed, passed ones whole."""
    return {
        k: v.narrow(1, start, size) if j < ctx.n_shard else v
        for j, (k, v) in enumerate(zip(ctx.keys, user, strict=True))
    }


def _check_loss_args(x, y, mask, output_reduction) -> None:
    what = "TiledFusedLogitsLoss"
    if output_reduction not in ("mean", "sum"):
        raise ValueError(f"{what}: output_reduction {output_reduction!r} is not 'mean' or 'sum'")
    if x.dim() < 2 or y.dim() < 2:
        raise ValueError(
            f"{what}: x and y must be [batch, seq, ...], got shapes "
            f"{tuple(x.shape)} and {tuple(y.shape)}"
        )
    if x.shape[:2] != y.shape[:2]:
        raise ValueError(f"{what}: x {tuple(x.shape)} and y {tuple(y.shape)} differ in batch/seq")
    if mask is not None and mask.shape != x.shape[:2]:
        raise ValueError(
            f"{what}: mask must be [batch, seq] = {tuple(x.shape[:2])}, got {tuple(mask.shape)}"
        )


def _tiled_loss(
    fn, self, x, y, mask, shards, reduction, need_x: bool, params: list[torch.Tensor]
) -> tuple:
    """The loss over the tiles of the flattened tokens, and (taken tile by tile as it goes)
    its gradients by ``x`` (when ``need_x``) and by ``params``."""
    xf, yf = x.reshape(-1, *x.shape[2:]), y.reshape(-1, *y.shape[2:])
    mf = None if mask is None else mask.reshape(-1)
    tiles = _tiles(xf.shape[0], shards, "TiledFusedLogitsLoss")
    # The tokens a mean counts: label not -100 (one integer label a token), mask nonzero.
    keep = torch.ones(yf.shape[0], dtype=torch.bool, device=yf.device)
    if yf.dim() == 1 and not yf.is_floating_point():
        keep &= yf != IGNORE_INDEX
    if mf is not None:
        keep &= mf.bool()
    counts = torch.stack([keep.narrow(0, s, n).sum() for s, n in tiles]).tolist()
    total = sum(counts)
    grads = need_x or bool(params)
    x_grad = torch.zeros_like(xf) if need_x else None
    sums = _Sums(len(params))
    loss, dtype = None, x.dtype
    for (start, size), count in zip(tiles, counts, strict=True):
        if count == 0:  # a mean over no tokens is nan; the tile adds nothing
            continue
        w = count / total if reduction == "mean" else 1.0
        xt = xf.narrow(0, start, size).detach().requires_grad_(need_x)
        args = (self, xt, yf.narrow(0, start, size))
        if mf is not None:
            args += (mf.narrow(0, start, size),)
        with torch.enable_grad() if grads else torch.no_grad():
            out = fn(*args)
        if out.numel() != 1:
            raise ValueError(
                f"TiledFusedLogitsLoss: fn must return a scalar loss, got shape {tuple(out.shape)}"
            )
        dtype = out.dtype
        part = out.detach().float().reshape(()) * w
        loss = part if loss is None else loss + part
        if grads:
            gs = list(_grads(out, [xt] * need_x + params, torch.full_like(out, w)))
            if need_x and (gx := gs.pop(0)) is not None:
                x_grad.narrow(0, start, size).copy_(gx)
            for j, g in enumerate(gs):
                sums.add(j, g)
    loss = x.new_zeros((), dtype=dtype) if loss is None else loss.to(dtype)
    return loss, None if x_grad is None else x_grad.view(x.shape), sums.acc


class TiledFusedLogitsLoss(torch.autograd.Function):
    """The loss ``fn(self, x, y[, mask])`` over ``shards`` tiles of the batch's tokens, so the
    ``[b, s, vocab]`` logits never exist: only one tile's ``[tokens, vocab]`` does. As in
    DeepSpeed, ``x`` (``[b, s, h]`` hidden states), ``y`` (``[b, s]`` labels, pre-shifted) and
    ``mask`` (``[b, s]`` or None; passed to ``fn`` only when given) are flattened to tokens and
    tiled, and the gradients are taken during forward, tile by tile, so no tile is run twice.

    ``output_reduction="sum"`` adds the tiles' losses. ``"mean"`` weights each tile's loss by
    its share of the counted tokens (label not -100, mask nonzero) and so equals the untiled
    mean when ``fn`` returns the mean over its tile's counted tokens, e.g.
    ``CrossEntropyLoss()`` (ignore index -100). DeepSpeed's ``"mean"`` averages the tiles'
    losses equally, which is that mean only when every tile holds as many counted tokens; its
    docs ask for ``"sum"`` and a division by the count otherwise. A tile with no counted token is
    skipped (its mean would be nan); with none in the batch the loss is 0.

    The gradients reach ``x`` and the parameters (of ``self`` and ``compute_params``, which may
    be None) in backward, scaled by the incoming gradient (a loss divided by its count or by
    the accumulation steps), and once. DeepSpeed's writes the parameters' ``.grad`` during
    forward, unscaled, which ArcticTraining's ``loss / good_tokens`` use is reported to inflate.
    Under ``torch.no_grad`` (or with nothing requiring grad) only the loss is computed.

    ZeRO-3: list in ``compute_params`` every parameter ``fn`` reads (as DeepSpeed asks); they
    are gathered once for all the tiles (no module's forward runs around the loss to do it).

    Example::

        def loss_fn(self, x, y):
            return F.cross_entropy(self.lm_head(x).float(), y)

        loss = TiledFusedLogitsLoss.apply(loss_fn, model, hidden, labels, None, 4,
                                          [model.lm_head.weight], "mean")
    """

    @classmethod
    def apply(cls, fn, self, x, y, mask, shards, compute_params=None, output_reduction="mean"):
        _check_loss_args(x, y, mask, output_reduction)
        params = _params(compute_params, [self], exclude=[x])
        if not (torch.is_grad_enabled() and (x.requires_grad or params)):
            return _tiled_loss(fn, self, x, y, mask, shards, output_reduction, False, [])[0]
        with GatheredParameters(list(compute_params or ())):
            return super().apply(
                fn, self, x, y, mask, shards, compute_params, output_reduction, *params
            )

    @staticmethod
    def forward(ctx, fn, self, x, y, mask, shards, compute_params, output_reduction, *params):
        need_x = ctx.needs_input_grad[2]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[8:]) if need]
        loss, x_grad, got = _tiled_loss(
            fn, self, x, y, mask, shards, output_reduction, need_x, [params[i] for i in wanted]
        )
        p_grads: list[torch.Tensor | None] = [None] * len(params)
        for i, g in zip(wanted, got, strict=True):
            p_grads[i] = g
        ctx.save_for_backward(x_grad, *p_grads)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scaled = [None if t is None else t * grad for t in ctx.saved_tensors]
        return (None, None, scaled[0], None, None, None, None, None, *scaled[1:])
