"""Muon with an auxiliary Adam: DeepSpeed 0.19's ``"optimizer": {"type": "Muon"}``.

Muon (MomentUm Orthogonalized by Newton-Schulz, Keller Jordan 2024) steps each hidden weight
matrix along the nearest semi-orthogonal matrix to its Nesterov momentum: per matrix,

    m = beta * m + (1 - beta) * g            # the momentum, elementwise
    u = beta * m + (1 - beta) * g            # Nesterov's look-ahead, elementwise
    O = NS5(u) * sqrt(max(1, rows / cols))   # Newton-Schulz: u's polar factor, approximately
    W = W * (1 - lr * weight_decay) - lr * O

Every other parameter (DeepSpeed's rule: fewer than two dimensions, or a name with "embed" or
"lm_head") takes the auxiliary Adam, with decoupled weight decay (``adam_w_mode``, the default)
or L2. The two steps above the orthogonalisation are elementwise, so the momentum is held
wherever the parameter's other state is, a ZeRO piece included; only the orthogonalisation needs
the whole matrix. Where the optimizer steps pieces, ``whole`` (given by the engine:
:class:`zerostack.zero.whole_params.WholeParams`) gathers each piece's look-ahead into whole
matrices, orthogonalises those this piece touches and returns the piece's part; without it each
tensor is a whole parameter.

Newton-Schulz runs in DeepSpeed's dtypes: the "gram" method (the default: iterates on the
small Gram matrix, restarted once) in fp16 where the device has fp16 matrix products, else in
fp32; the "standard" quintic iteration in bf16. Both normalise by the Frobenius norm first.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .lamb import adam_moments

NS_STEPS = 5
_A, _B, _C = 3.4445, -4.7750, 2.0315  # the quintic's coefficients (Jordan's)
NS_METHODS = ("gram", "standard")


def ns_dtype(method: str, device: torch.device) -> torch.dtype:
    """The dtype Newton-Schulz runs in (DeepSpeed's choice): "gram" in fp16 where the device
    multiplies fp16 matrices natively (CUDA; a CPU with oneDNN fp16), else fp32; "standard" in
    bf16."""
    if method == "standard":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.float16
    try:
        fp16 = device.type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        fp16 = False
    return torch.float16 if fp16 else torch.float32


def _standard(x: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic iteration on ``x`` (rows <= cols, spectral norm at most one)."""
    for _ in range(steps):
        a = x @ x.mT
        x = _A * x + (_B * a + _C * a @ a) @ x
    return x


def _gram(x: torch.Tensor, steps: int) -> torch.Tensor:
    """The same iteration carried on the Gram matrix ``r = x x^T`` (rows <= cols): each step's
    polynomial in ``r`` is folded into ``q`` and applied to ``x`` once at the end, with one
    restart (``x = q x``, ``r`` recomputed) after two steps, which keeps half precision stable.
    A square ``x`` gains nothing and takes the standard iteration."""
    if x.size(-2) == x.size(-1):
        return _standard(x, steps)
    r, q, restart = x @ x.mT, None, 2
    for i in range(steps):
        if i == restart:
            x, q = q @ x, None
            r = x @ x.mT
        z = _B * r + _C * r @ r
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(_A)
        else:
            q = _A * q + z @ q
        if i < steps - 1 and i + 1 != restart:
            rz = _A * r + z @ r
            r = _A * rz + z @ rz
    return q @ x


def orthogonalize(u: torch.Tensor, method: str = "gram", steps: int = NS_STEPS) -> torch.Tensor:
    """``u``'s (a matrix, or a batch of them) approximate polar factor by Newton-Schulz, scaled
    by ``sqrt(max(1, rows / cols))``, in ``u``'s dtype. A tensor of more than two dimensions is
    one matrix of its first dimension's rows (a convolution's filters)."""
    if method not in NS_METHODS:
        raise ValueError(f"ns_method: {method!r} (known: {', '.join(NS_METHODS)})")
    shape = u.shape
    g = u.reshape(len(u), -1) if u.ndim > 2 else u
    rows, cols = g.size(-2), g.size(-1)
    dtype = ns_dtype(method, g.device)
    # as DeepSpeed: "gram" normalises before the cast to half precision (fp16 would overflow
    # on large entries), "standard" after the cast to bf16
    x = g.to(dtype) if method == "standard" else g.float() if g.dtype == torch.float16 else g
    tall = rows > cols
    if tall:
        x = x.mT
    x = (x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)).to(dtype)
    x = _gram(x, steps) if method == "gram" else _standard(x, steps)
    if tall:
        x = x.mT
    scale = math.sqrt(rows / cols) if rows > cols else 1.0
    return (x * scale).to(u.dtype).reshape(shape)


class Muon(torch.optim.Optimizer):
    """Muon on the groups with ``use_muon`` true (options ``lr``, ``momentum``,
    ``weight_decay``, ``ns_method``), Adam on the others (``lr``, ``betas``, ``eps``,
    ``weight_decay``); ``adam_w_mode``: the Adam groups' weight decay decoupled (true) or
    added to the gradient. State: ``momentum_buffer`` (Muon), ``step``, ``exp_avg``,
    ``exp_avg_sq`` (Adam), each the shape of its parameter. See the module for the update and
    for ``whole``."""

    def __init__(self, params, *, adam_w_mode: bool = True) -> None:
        groups = list(params)
        for i, g in enumerate(groups):
            if "use_muon" not in g:
                raise ValueError(f"Muon: param group {i} has no 'use_muon' entry")
            if g["use_muon"]:
                g.setdefault("lr", 0.02)
                g.setdefault("momentum", 0.95)
                g.setdefault("weight_decay", 0.0)
                g.setdefault("ns_method", "gram")
                if g["ns_method"] not in NS_METHODS:
                    raise ValueError(f"ns_method: {g['ns_method']!r} (known: gram, standard)")
            else:
                g.setdefault("lr", 3e-4)
                g.setdefault("betas", (0.9, 0.95))
                g.setdefault("eps", 1e-10)
                g.setdefault("weight_decay", 0.0)
        super().__init__(groups, {})
        self.adam_w_mode = adam_w_mode
        # set by the engine where the tensors stepped are pieces of parameters
        self.whole = None

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon(group)
            else:
                self._adam(group)
        return loss

    def _muon(self, group: dict) -> None:
        beta, lr, method = group["momentum"], group["lr"], group["ns_method"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            m = state["momentum_buffer"]
            m.lerp_(p.grad, 1 - beta)
            look = p.grad.lerp(m, beta)  # Nesterov's look-ahead

            def ortho(u: torch.Tensor, method: str = method) -> torch.Tensor:
                return orthogonalize(u, method)

            if self.whole is not None and self.whole.holds(p):
                update = self.whole.apply(p, look, ortho)
            elif p.ndim >= 2:
                update = ortho(look)
            else:
                raise ValueError(
                    f"Muon: a tensor of shape {tuple(p.shape)} in a use_muon group is no "
                    "matrix (Muon is for parameters of two or more dimensions)"
                )
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(update, alpha=-lr)

    def _adam(self, group: dict) -> None:
        (b1, b2), eps, lr, wd = group["betas"], group["eps"], group["lr"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            t, m, v = adam_moments(self.state[p], p)
            grad = p.grad if self.adam_w_mode or wd == 0 else p.grad.add(p, alpha=wd)
            m.lerp_(grad, 1 - b1)
            v.lerp_(grad.square(), 1 - b2)
            update = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
            if self.adam_w_mode:
                p.mul_(1 - lr * wd)
            p.add_(update, alpha=-lr)


def takes_muon(name: str, p: torch.Tensor) -> bool:
    """DeepSpeed's rule: a parameter of two or more dimensions as a layer (``ds_shape`` under
    zero.Init, whose pieces are flat) whose name has neither "embed" nor "lm_head"."""
    shape = getattr(p, "ds_shape", None)
    shape = p.shape if shape is None else shape
    lowered = name.lower()
    return len(shape) >= 2 and "embed" not in lowered and "lm_head" not in lowered


_MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")


def muon_groups(model: torch.nn.Module, groups: list[dict], params) -> list[dict]:
    """Each of ``groups`` split into its Muon half and its Adam half (empty halves left out),
    as DeepSpeed's engine splits them: every parameter of ``model`` tagged ``use_muon`` by
    :func:`takes_muon`; each half's settings the config's (``params``: its
    :class:`~zerostack.config.optim.MuonParams`), ``muon_lr`` / ``adam_lr`` over ``lr``, then
    what the group itself sets of that half's keys; each half named ("muon-params",
    "adam-params", prefixed by the group's name or ``group<i>`` when there are several)."""
    for name, p in model.named_parameters():
        p.use_muon = takes_muon(name, p)
    shared = {
        True: {"lr": params.muon_rate, "momentum": params.momentum,
               "weight_decay": params.weight_decay, "ns_method": params.ns_method},
        False: {"lr": params.adam_rate, "betas": tuple(params.betas), "eps": params.eps,
                "weight_decay": params.weight_decay},
    }  # fmt: skip
    out = []
    for i, group in enumerate(groups):
        own = {k: v for k, v in group.items() if k != "params"}
        for use_muon, label, keys in ((True, "muon", _MUON_KEYS), (False, "adam", _ADAM_KEYS)):
            half = [p for p in group["params"] if p.use_muon is use_muon]
            if not half:
                continue
            settings = {**shared[use_muon], **{k: v for k, v in own.items() if k in keys}}
            prefix = own.get("name") or (f"group{i}" if len(groups) > 1 else None)
            name = f"{prefix}-{label}-params" if prefix else f"{label}-params"
            out.append({"params": half, "use_muon": use_muon, "name": name, **settings})
    return out
