"""Activation bytes of a transformer, per layer and per pipeline stage (Korthikanti et al., 2022,
"Reducing Activation Recomputation in Large Transformer Models", Table 2), with the compute dtype
and dropout masks made explicit.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .memory import EstimateError

ROTARY = frozenset({"llama", "mistral", "mixtral", "qwen2", "gemma", "phi3"})
NORMS = {  # what one norm keeps for backward: bytes per element of its input, fp32 per token
    "layer": (None, 8),  # LayerNorm: its input (the compute dtype), mean and rstd
    "rms": (None, 4),  # a fused RMSNorm (Megatron's, Transformer Engine's): its input, rstd
    "hf-rms": (4, 4),  # Hugging Face's eager RMSNorm: an fp32 copy of its input, rstd, and
    # the normalized values in the compute dtype (the weight multiplies after the cast back)
}


@lru_cache(maxsize=256)
def _stage_layers(layers: int, pp: int) -> tuple[int, ...]:
    """:meth:`Transformer.stage_layers`, once per (layers, pp): the partition searches every
    span of layers (cubic in them), and the planner asks for it per candidate and stage."""
    from ..pipeline.module import partition_layers

    try:
        bounds = partition_layers([None] * layers, pp, "uniform")
    except ValueError as exc:
        raise EstimateError(f"pp: {pp} stages for {layers} layers") from exc
    return tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))


@dataclass(frozen=True)
class Transformer:
    """A GPT-style description: what the activation and parameter formulas need."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: int = 0  # 0: 4 x hidden
    dropout: bool = True  # dropout masks are kept (1 byte per element) when dropout is on
    bias: bool = True  # Linear and LayerNorm biases (the parameter count only)
    kv_heads: int = 0  # key/value heads (grouped-query attention); 0: as many as heads
    gated: bool = False  # a gated MLP (SwiGLU: gate, up and down matrices), as Llama's
    positions: bool = True  # learned position embeddings (GPT-2); False: rotary, no table
    tied: bool = True  # the output layer is the token embedding (False: its own matrix)
    vocab_parallel: bool = True  # the embedding and output layer split over tp (zerostack's
    # GPT); False: whole on every tp rank (a Hugging Face model under AutoTP)
    norm: str = "layer"  # what each norm keeps for backward: a key of NORMS
    embedding_dropout: bool = True  # with dropout on, also after the embeddings (GPT-2's
    # embd_pdrop, Megatron's); zerostack's GPT has none there
    ends_as_layers: bool = False  # the pipeline split counts the embedding and the output
    # layer as a layer each, so the first and last stages hold one layer fewer (Llama 3's
    # training, arXiv 2407.21783 section 3.3.2; Megatron Core's account_for_embedding_ and
    # account_for_loss_in_pipeline_split); False: the engine's uniform partition

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab", "seq"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise EstimateError(f"{name}: {getattr(self, name)!r} is not a positive integer")
        if self.hidden % self.heads:
            raise EstimateError(f"hidden: {self.hidden} is not divisible by heads {self.heads}")
        if self.norm not in NORMS:
            raise EstimateError(f"norm: {self.norm!r} is not one of {', '.join(NORMS)}")

    def norm_bytes(self, dtype_bytes: int) -> tuple[float, int]:
        """What one norm keeps for backward besides its output: bytes per element of its input
        (its input in the compute dtype, or Hugging Face's fp32 copy of it plus the normalized
        values), and fp32 bytes per token (LayerNorm's mean and rstd, RMSNorm's rstd)."""
        copy, per_token = NORMS[self.norm]
        return (dtype_bytes if copy is None else copy + dtype_bytes), per_token

    @property
    def ffn_hidden(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv_hidden(self) -> int:
        """Width of the key (and of the value) projection."""
        return (self.kv_heads or self.heads) * (self.hidden // self.heads)

    @property
    def params(self) -> int:
        """Weights and biases: per layer QKV, projection, two MLP matrices and two LayerNorms;
        token and position embeddings (the output layer tied to the token embedding), final
        LayerNorm."""
        h, f, b, kv = self.hidden, self.ffn_hidden, int(self.bias), self.kv_hidden
        attention = (h * h + 2 * h * kv + (h + 2 * kv) * b) + (h * h + h * b)
        mats = 3 if self.gated else 2
        mlp = mats * h * f + ((mats - 1) * f + h) * b
        per_layer = attention + mlp + 2 * (h + h * b)
        embeddings = self.vocab * h * (1 if self.tied else 2)
        embeddings += self.seq * h if self.positions else 0
        return self.layers * per_layer + embeddings + (h + h * b)

    def stage_layers(self, pp: int) -> list[int]:
        """The layers each of ``pp`` pipeline stages holds, as the engine's ``uniform``
        partition cuts them (:func:`zerostack.pipeline.module.partition_layers`): as even as can
        be, the first stages taking the larger share (126 layers on 16 stages: 8 each, the last
        6); with ``ends_as_layers``, 128 units cut so and the first and last stages' embedding
        and output layer taken out (7, then 8 on each of 14 stages, then 7)."""
        if not self.ends_as_layers or pp == 1:
            return list(_stage_layers(self.layers, pp))
        split = list(_stage_layers(self.layers + 2, pp))
        split[0], split[-1] = split[0] - 1, split[-1] - 1
        return split

    def layer_tensors(self, tp: int = 1) -> list[int]:
        """One layer's parameter tensors on a tp rank, in the order the layer uses them (its
        last matrix is the MLP's output projection): see :meth:`rank_tensors`."""
        h, f, t, b, kv = self.hidden, self.ffn_hidden, tp, self.bias, self.kv_hidden
        if self.gated:
            layer = [h, h * h // t, kv * h // t, kv * h // t, h * h // t]  # norm, q, k, v, o
            layer += [h, f * h // t, f * h // t, h * f // t]  # norm; gate, up, down
            if b:
                layer += [h // t, kv // t, kv // t, h, h, h]  # q, k, v, o biases; norm shifts
            return layer
        layer = [h, (h + 2 * kv) * h // t, h * h // t, h, f * h // t, h * f // t]
        if b:  # LN shifts, QKV, proj, fc, out biases
            layer += [h, h, (h + 2 * kv) // t, h, f // t, h]
        return layer

    def rank_tensors(self, tp: int = 1, pp: int = 1, stage: int = 0) -> list[int]:
        """The element counts of the parameter tensors one rank holds, as the models lay them
        out: zerostack's reference GPT (fused QKV, the MLP's first matrix and their biases, and
        the token embedding split over tp; the rest whole) or, for a gated model, a Hugging Face
        Llama under AutoTP (Q, K, V, the output projection, gate, up and down split over tp; the
        norms and, unless ``vocab_parallel``, the embedding and output layer whole); the stage's
        layers (:meth:`stage_layers`), the embeddings on the first stage, the final norm and the
        output layer on the last (a tied one as a copy of the token embedding, when pp > 1)."""
        if not 0 <= stage < pp:
            raise EstimateError(f"stage: {stage} is not in 0..{pp - 1}")
        h, t, b = self.hidden, tp, self.bias
        out = self.layer_tensors(tp) * self.stage_layers(pp)[stage]
        first, last = stage == 0, stage == pp - 1
        norm = [h, h] if b else [h]
        vocab = self.vocab * h // (t if self.vocab_parallel else 1)
        if first:
            out += [vocab] + ([self.seq * h] if self.positions else [])
        if last:
            out += norm + ([vocab] if pp > 1 or not self.tied else [])
        return out

    @classmethod
    def from_gpt_config(cls, cfg) -> Transformer:
        """From zerostack's reference GPT's ``GPTConfig`` (``zerostack.models``)."""
        return cls(
            layers=cfg.n_layer,
            hidden=cfg.d_model,
            heads=cfg.n_head,
            vocab=cfg.vocab_size,
            seq=cfg.block_size,
            dropout=cfg.dropout > 0,
            bias=cfg.bias,
            embedding_dropout=False,
        )

    @classmethod
    def from_hf_config(cls, config: dict, seq: int | None = None) -> Transformer:
        """From a Hugging Face ``config.json`` (GPT-2, Llama, Mistral, GPT-NeoX, OPT, BERT key
        names); ``seq`` overrides the config's maximum length. Llama-style models (rotary
        positions: Llama, Mistral, Qwen2, ...) have a gated MLP, no biases, no position table,
        no residual dropout, grouped-query attention, Hugging Face's RMSNorm and, unless tied,
        their own output matrix."""

        def pick(*names):
            for n in names:
                if n in config:
                    return config[n]
            raise EstimateError(f"config.json: none of {', '.join(names)} is given")

        rotary = config.get("model_type") in ROTARY or "rope_theta" in config
        heads = int(pick("num_attention_heads", "n_head"))
        # residual dropout: GPT-2's resid_pdrop, BERT's hidden_dropout_prob; Llama-style
        # models have none (only attention_dropout, which flash attention keeps no mask for)
        residual = ("resid_pdrop", "hidden_dropout_prob", "hidden_dropout")
        dropout = next((config[k] for k in residual if k in config), 0.0 if rotary else 0.1)
        return cls(
            layers=int(pick("num_hidden_layers", "n_layer", "num_layers")),
            hidden=int(pick("hidden_size", "n_embd", "d_model")),
            heads=heads,
            vocab=int(pick("vocab_size")),
            seq=int(seq or pick("max_position_embeddings", "n_positions", "n_ctx", "seq_length")),
            ffn=int(config.get("intermediate_size") or config.get("n_inner") or 0),
            dropout=float(dropout) > 0,
            bias=not rotary and bool(config.get("bias", True)),
            kv_heads=int(config.get("num_key_value_heads") or heads),
            gated=rotary,
            positions=not rotary,
            tied=bool(config.get("tie_word_embeddings", not rotary)),
            vocab_parallel=False,  # AutoTP leaves a Hugging Face model's embeddings whole
            norm="hf-rms" if rotary else "layer",
        )


def layer_activation_bytes(
    m: Transformer,
    micro_batch: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    dtype_bytes: int = 2,
    flash: bool = False,
    fused_mlp: bool = False,
    distribute_saved: bool = False,
) -> float:
    """Bytes one transformer layer keeps for backward, for one micro-batch.

    Korthikanti et al., Table 2, with the compute dtype (``d`` bytes) and dropout masks
    (``m`` = 1 byte per element when dropout is on, else 0) made explicit; in 16-bit with
    dropout and LayerNorm it is their s b h (10 + 24 / t + 5 a s / (h t)), plus the norms'
    statistics, 16 s b:

    * kept whole on every tp rank (split by t only under sequence parallelism): both LayerNorm
      inputs, the QKV input, the MLP input (4 d) and the two dropout masks (2 m), per s b h;
      and what Korthikanti leaves out, each norm's fp32 statistics per token (8 bytes for
      LayerNorm's mean and rstd, 4 for RMSNorm's rstd; :meth:`Transformer.norm_bytes` also
      says what Hugging Face's eager RMSNorm keeps in place of its input);
    * split by t: Q, K, V and the projection input (4 d) and the MLP's two 4h-wide activations
      (8 d, scaled by ffn / 4h), per s b h; a gated MLP (SwiGLU) keeps four ffn-wide tensors
      run eagerly (gate, up, act(gate), their product) and three when ``fused_mlp`` (one
      kernel keeps its input, gate and up, and recomputes its output in backward: Megatron's
      and Transformer Engine's SwiGLU);
    * the attention core, per a s^2 b / t: the softmax output (d), its dropout mask and output
      (m + m d). ``flash``: a fused kernel keeps none of it, only the fp32 log-sum-exp, 4 a s b / t.

    ``recompute``: "none"; "selective" (the attention core is recomputed: its terms go);
    "full" (only the layer's input is kept: d s b h, split by t under sequence parallelism,
    or where ``distribute_saved``: each tp rank keeps 1/t of it and backward gathers it again,
    as Megatron's ``--distribute-saved-activations`` and metaseq's
    ``--distribute-checkpointed-activations``).
    """
    if recompute not in ("none", "selective", "full"):
        raise EstimateError(f"recompute: {recompute!r} is not none, selective or full")
    s, b, h, a, t, d = m.seq, micro_batch, m.hidden, m.heads, tp, dtype_bytes
    sp = t if sequence_parallel else 1
    sbh = s * b * h
    if recompute == "full":
        return d * sbh / (t if sequence_parallel or distribute_saved else 1)
    mask = 1 if m.dropout else 0
    wide = m.ffn_hidden / (4 * h)
    kv = m.kv_hidden / h  # K and V relative to Q (grouped-query attention keeps them smaller)
    norm_input, norm_stats = m.norm_bytes(d)
    whole = ((2 * norm_input + 2 * d + 2 * mask) * sbh + 2 * norm_stats * s * b) / sp
    # gate, up, act(gate), product (the fused kernel keeps no act(gate)); or fc, gelu
    mlp = (3 if fused_mlp else 4) * 4 * wide if m.gated else 8 * wide
    split = ((2 + 2 * kv) * d + mlp * d) * sbh / t
    if recompute == "selective":
        core = 0.0
    elif flash:
        core = 4 * a * s * b / t
    else:
        core = (d + mask + mask * d) * a * s * s * b / t
    return whole + split + core


def stage_activation_bytes(
    m: Transformer,
    micro_batch: int,
    *,
    tp: int = 1,
    pp: int = 1,
    stage: int = 0,
    in_flight: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    dtype_bytes: int = 2,
    flash: bool = False,
    fused_mlp: bool = False,
    distribute_saved: bool = False,
) -> float:
    """Activation bytes a pipeline stage holds at its peak: ``in_flight`` micro-batches through
    its layers (:meth:`Transformer.stage_layers`; 1F1B: ``min(pp - stage, gas)`` micro-batches,
    no pipeline: 1), plus the first stage's embedding-dropout mask, a rotary model's cos and
    sin tables (2 d s h / a, shared by its layers) and the last stage's final norm (as
    :func:`layer_activation_bytes` counts a norm), the output layer's input and the loss's fp32
    log-probabilities (Korthikanti's 4 s b v / t; the logits in the compute dtype are not kept,
    and under AutoTP the output layer is whole: t = 1; split, the embedding and the loss each
    keep a boolean per token, whether it falls in this rank's slice of the vocabulary). With
    full recompute, also the one layer
    whose activations backward is recomputing. Integer tensors (token ids, targets) and
    scalars are not counted."""
    if not 0 <= stage < pp:
        raise EstimateError(f"stage: {stage} is not in 0..{pp - 1}")
    per_layer = layer_activation_bytes(
        m,
        micro_batch,
        tp=tp,
        sequence_parallel=sequence_parallel,
        recompute=recompute,
        dtype_bytes=dtype_bytes,
        flash=flash,
        fused_mlp=fused_mlp,
        distribute_saved=distribute_saved,
    )
    s, b, h, d = m.seq, micro_batch, m.hidden, dtype_bytes
    sp = tp if sequence_parallel else 1
    extra, once = 0.0, 0.0
    if recompute == "full":  # backward recomputes one layer at a time: its activations too
        once = layer_activation_bytes(
            m,
            micro_batch,
            tp=tp,
            sequence_parallel=sequence_parallel,
            dtype_bytes=d,
            flash=flash,
            fused_mlp=fused_mlp,
        )
    if stage == 0 and m.dropout and m.embedding_dropout:
        extra += s * b * h / sp
    if not m.positions:  # rotary: the cos and sin tables every layer multiplies by
        extra += 2 * d * s * (h // m.heads)
    if m.vocab_parallel and tp > 1:  # which tokens fall outside this rank's vocabulary slice:
        extra += s * b * ((stage == 0) + (stage == pp - 1))  # the embedding's, the loss's
    if stage == pp - 1:  # the final norm's and the output layer's inputs, the loss's fp32
        norm_input, norm_stats = m.norm_bytes(d)
        extra += ((norm_input + d) * s * b * h + norm_stats * s * b) / sp
        extra += 4 * s * b * m.vocab / (tp if m.vocab_parallel else 1)
    return in_flight * (per_layer * m.stage_layers(pp)[stage] + extra) + once
