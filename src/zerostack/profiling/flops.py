"""Analytic flops of a GPT-style transformer, and model flops utilisation (MFU).

The count of Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC'21), which counts matrix products only, 2 flops per multiply-add. With
batch B, sequence s, layers l, hidden h, vocabulary V and MLP width f (4h by default), one
layer's forward is::

    Q, K, V projections  6·B·s·h²         attention scores  q·kᵀ   2·B·s²·h
    output projection    2·B·s·h²         scores · values          2·B·s²·h
    MLP (h→f→h)          4·B·s·h·f  (= 16·B·s·h² for f = 4h)

so 24·B·s·h² + 4·B·s²·h with f = 4h, and the logits add 2·B·s·h·V. The backward costs twice
its forward; full activation recomputation runs each layer's forward once more (the logits are
not recomputed). Per training step, for f = 4h::

    recompute=False:  72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))
    recompute=True:   96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))    <- the paper's formula

The paper's 96 is 4 x 24: it assumes full recomputation. Embedding lookups, norms, softmax,
activations and residual adds are left out, as ``torch.utils.flop_counter`` leaves them out, so
:class:`~zerostack.profiling.FlopsProfiler` measures the forward count exactly (attention taken as
the full s x s products, causal or not).

MFU is the achieved share of peak: ``model_flops_utilization(flops_per_step, step_seconds,
peak_flops_per_second)``, with flops and peak over the same devices (both per GPU, or both for
the whole job). Count the flops without recomputation for MFU proper, with it for the hardware
utilisation the paper reports.
"""

from __future__ import annotations


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"transformer_flops: {name} must be a positive int, got {value!r}")


def transformer_flops(
    layers: int,
    hidden: int,
    heads: int,
    vocab: int,
    seq: int,
    batch: int,
    ffn: int | None = None,
    backward: bool = True,
    recompute: bool = False,
    kv_hidden: int | None = None,
    gated: bool = False,
) -> int:
    """Flops of one step over ``batch`` sequences of ``seq`` tokens (an exact int).

    ``backward=False``: the forward only. ``recompute=True`` (needs ``backward``): every layer's
    forward is run again in the backward, Narayanan et al.'s 96·B·s·l·h²·(...) count.
    ``ffn``: the MLP's inner width (default 4 · hidden). ``heads`` must divide ``hidden``; the
    count does not depend on it (the attention products cost the same however h is split).
    ``kv_hidden``: the key and value projections' width under grouped-query attention (default
    ``hidden``); ``gated``: a gated MLP (SwiGLU's three matrices: 6·B·s·h·f, not 4).

    >>> transformer_flops(2, 64, 4, 256, 32, 2, backward=False)
    15728640
    """
    sizes = dict(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq, batch=batch)
    for name, value in sizes.items():
        _positive(name, value)
    ffn = 4 * hidden if ffn is None else ffn
    _positive("ffn", ffn)
    if hidden % heads:
        raise ValueError(f"transformer_flops: heads {heads} does not divide hidden {hidden}")
    if recompute and not backward:
        raise ValueError("transformer_flops: recompute=True needs backward=True")
    tokens = batch * seq
    kv = hidden if kv_hidden is None else kv_hidden
    mlp = (6 if gated else 4) * hidden * ffn
    layer = tokens * (4 * hidden * hidden + 4 * hidden * kv + mlp) + 4 * tokens * seq * hidden
    logits = 2 * tokens * hidden * vocab
    passes = 1 + (2 if backward else 0)  # a backward is two forwards' worth of products
    return layers * layer * (passes + (1 if recompute else 0)) + logits * passes


def model_flops_utilization(
    flops_per_step: float, step_seconds: float, peak_flops_per_second: float
) -> float:
    """The share of peak achieved: flops_per_step / step_seconds / peak_flops_per_second.

    >>> model_flops_utilization(6e12, 0.1, 120e12)
    0.5
    """
    if flops_per_step < 0:
        raise ValueError(
            f"model_flops_utilization: flops_per_step must be >= 0, got {flops_per_step}"
        )
    if step_seconds <= 0:
        raise ValueError(f"model_flops_utilization: step_seconds must be > 0, got {step_seconds}")
    if peak_flops_per_second <= 0:
        raise ValueError(
            "model_flops_utilization: peak_flops_per_second must be > 0, "
            f"got {peak_flops_per_second}"
        )
    return flops_per_step / step_seconds / peak_flops_per_second
