"""DeepSpeed's fused BERT encoder layer, ``deepspeed.DeepSpeedTransformerLayer``, in plain torch.

DeepSpeed's BERT tutorials and DeepSpeedExamples' BingBert scripts build their encoder from
``DeepSpeedTransformerLayer(DeepSpeedTransformerConfig(...))``, a layer whose forward and
backward are one compiled CUDA kernel (``csrc/transformer/ds_transformer_cuda.cpp``). This is
the same layer -- the config's fields and defaults, the parameter names and shapes, the
initialisation and the forward -- written with torch operations, so autograd gives the backward
and it runs on any device and dtype::

    cfg = DeepSpeedTransformerConfig(batch_size=8, hidden_size=1024, heads=16,
                                     attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1,
                                     num_hidden_layers=24, initializer_range=0.02,
                                     pre_layer_norm=True)
    layer = DeepSpeedTransformerLayer(cfg)
    out = layer(hidden_states, extended_attention_mask)  # [B, S, H], mask [B, 1, 1, S]

The arithmetic is the kernel's. Post-LN (``pre_layer_norm=False``) is Hugging Face's
``BertLayer``; pre-LN is DeepSpeedExamples' ``modelingpreln.BertLayer``: ``norm_w``/``norm_b``
normalise the layer's input before attention, ``attn_nw``/``attn_nb`` the residual sum before
the MLP, and nothing normalises the output (the model's ``FinalLayerNorm`` after the last layer
does). GELU is the tanh approximation, as ``csrc/transformer/gelu_kernels.cu`` computes it (the
examples' own non-kernel layers use erf; the two differ by ~1e-3).
"""

from __future__ import annotations

import difflib
import json
import math

import torch
import torch.nn.functional as F
from torch import nn

MAX_HIDDEN = 65536
"""The widest hidden size the kernel's layer norm takes ("Unsupport hidden_dim." beyond)."""

PARAMETERS = ("attn_qkvw", "attn_qkvb", "attn_ow", "attn_ob", "attn_nw", "attn_nb",
              "inter_w", "inter_b", "output_w", "output_b", "norm_w", "norm_b")
"""The layer's parameters, in the order DeepSpeed's kernel takes them."""

_GRAD_TAGS = {"attn_qkvw": "V_W", "attn_qkvb": "V_B", "attn_ow": "O_W", "attn_ob": "O_B",
              "attn_nw": "N2_W", "attn_nb": "N2_B", "inter_w": "int_W", "inter_b": "int_B",
              "output_w": "out_W", "output_b": "out_B", "norm_w": "norm_W", "norm_b": "norm_B"}


class DeepSpeedTransformerConfig:
    """DeepSpeed's config of the layer: the same fields, defaults and class methods.

    ``intermediate_size`` <= 0 means ``4 * hidden_size``. ``batch_size`` (the kernel's workspace
    size), ``local_rank`` (the kernel's device), ``seed`` (the kernel's curand stream), ``fp16``
    (the kernel's dtype: here the parameters' dtype decides, ``layer.half()``), ``stochastic_mode``
    and the memory savers ``normalize_invertible``, ``gelu_checkpoint`` and
    ``attn_dropout_checkpoint`` change no result and are kept only to be read back. Dropout draws
    from torch's generator (``torch.manual_seed``). ``local_rank`` still matters in one place, as
    in DeepSpeed: see :meth:`DeepSpeedTransformerLayer.init_transformer_weights`.
    """

    def __init__(self, batch_size=-1, hidden_size=-1, intermediate_size=-1, heads=-1,
                 attn_dropout_ratio=-1, hidden_dropout_ratio=-1, num_hidden_layers=-1,
                 initializer_range=-1, layer_norm_eps=1e-12, local_rank=-1, seed=-1, fp16=False,
                 pre_layer_norm=True, normalize_invertible=False, gelu_checkpoint=False,
                 adjust_init_range=True, attn_dropout_checkpoint=False, stochastic_mode=False,
                 return_tuple=False, training=True):
        self.layer_id = -1
        self.batch_size = batch_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size if intermediate_size > 0 else 4 * hidden_size
        self.heads = heads
        self.attn_dropout_ratio = attn_dropout_ratio
        self.hidden_dropout_ratio = hidden_dropout_ratio
        self.num_hidden_layers = num_hidden_layers
        self.initializer_range = initializer_range
        self.fp16 = fp16
        self.pre_layer_norm = pre_layer_norm
        self.local_rank = local_rank
        self.seed = seed
        self.normalize_invertible = normalize_invertible
        self.gelu_checkpoint = gelu_checkpoint
        self.adjust_init_range = adjust_init_range
        self.test_gemm = False
        self.layer_norm_eps = layer_norm_eps
        self.training = training
        self.is_grad_enabled = True
        self.attn_dropout_checkpoint = attn_dropout_checkpoint
        self.stochastic_mode = stochastic_mode
        self.return_tuple = return_tuple

    @classmethod
    def from_dict(cls, json_object: dict) -> DeepSpeedTransformerConfig:
        """A default config with ``json_object``'s fields set. Unlike DeepSpeed, a key that is
        no field is refused (DeepSpeed stores a misspelt one and ignores it), and a missing or
        non-positive ``intermediate_size`` is ``4 * hidden_size`` (DeepSpeed leaves -4)."""
        config = cls()
        known = vars(config)
        for key in json_object:
            if key not in known:
                near = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise ValueError(f"DeepSpeedTransformerConfig: unknown key {key!r}{hint}")
        config.__dict__.update(json_object)
        if config.intermediate_size <= 0:
            config.intermediate_size = 4 * config.hidden_size
        return config

    @classmethod
    def from_json_file(cls, json_file) -> DeepSpeedTransformerConfig:
        """:meth:`from_dict` of a JSON file. DeepSpeed reads it as UTF-16; a file with a UTF-16
        byte-order mark is read so, any other as UTF-8."""
        with open(json_file, "rb") as reader:
            raw = reader.read()
        utf16 = raw.startswith((b"\xff\xfe", b"\xfe\xff"))
        return cls.from_dict(json.loads(raw.decode("utf-16" if utf16 else "utf-8-sig")))


def _check_config(c: DeepSpeedTransformerConfig) -> None:
    """Refuse what DeepSpeed's kernel refuses or cannot compute, naming the field."""
    for name in ("hidden_size", "heads", "intermediate_size"):
        if getattr(c, name) <= 0:
            raise ValueError(f"DeepSpeedTransformerConfig.{name} must be > 0, got "
                             f"{getattr(c, name)}")
    if c.hidden_size % c.heads:
        raise ValueError(f"DeepSpeedTransformerConfig: hidden_size {c.hidden_size} is not "
                         f"divisible by heads {c.heads}")
    if c.hidden_size > MAX_HIDDEN:
        raise ValueError(f"DeepSpeedTransformerConfig.hidden_size {c.hidden_size}: the kernel "
                         f"takes at most {MAX_HIDDEN}")


class DeepSpeedTransformerLayer(nn.Module):
    """DeepSpeed's ``DeepSpeedTransformerLayer(config, initial_weights=None,
    initial_biases=None)``: one BERT encoder layer over parameters named as the kernel's.

    ``layer_id`` (class attribute) counts the layers built, from 0, and each layer writes its
    number into ``config.layer_id``, as DeepSpeed does. ``initial_weights`` and
    ``initial_biases`` (both or neither) are 8-entry lists in the order q, k, v, attention
    output, attention norm, intermediate, output, norm: q, k and v weights are concatenated
    into ``attn_qkvw`` (a copy); ``attn_qkvb`` is zero, as in DeepSpeed, which ignores
    ``initial_biases[0:3]``; entries 3-7 that are ``nn.Parameter`` become this layer's
    parameters themselves (shared, as in DeepSpeed), plain tensors are wrapped.
    """

    layer_id = 0

    def __init__(self, config: DeepSpeedTransformerConfig, initial_weights=None,
                 initial_biases=None):
        super().__init__()
        _check_config(config)
        self.config = config
        self.config.layer_id = DeepSpeedTransformerLayer.layer_id
        DeepSpeedTransformerLayer.layer_id += 1
        shapes = self._shapes()
        if initial_weights is None and initial_biases is None:
            for name in PARAMETERS:
                setattr(self, name, nn.Parameter(torch.empty(shapes[name])))
            self.init_transformer_weights(config.adjust_init_range)
        else:
            self._adopt(initial_weights, initial_biases)
        for name in PARAMETERS:
            if tuple(getattr(self, name).shape) != shapes[name]:
                raise ValueError(f"DeepSpeedTransformerLayer.{name}: shape "
                                 f"{tuple(getattr(self, name).shape)}, the config says "
                                 f"{shapes[name]}")

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        h, i = self.config.hidden_size, self.config.intermediate_size
        return {"attn_qkvw": (3 * h, h), "attn_qkvb": (3 * h,), "attn_ow": (h, h),
                "attn_ob": (h,), "attn_nw": (h,), "attn_nb": (h,), "inter_w": (i, h),
                "inter_b": (i,), "output_w": (h, i), "output_b": (h,), "norm_w": (h,),
                "norm_b": (h,)}

    def _adopt(self, weights, biases) -> None:
        if weights is None or biases is None or len(weights) != 8 or len(biases) != 8:
            raise ValueError("DeepSpeedTransformerLayer: pass initial_weights and initial_biases "
                             "together, 8 tensors each (q, k, v, attention output, attention "
                             "norm, intermediate, output, norm)")
        self.attn_qkvw = nn.Parameter(torch.cat([w.detach() for w in weights[:3]]))
        self.attn_qkvb = nn.Parameter(torch.zeros(3 * self.config.hidden_size,
                                                  dtype=self.attn_qkvw.dtype,
                                                  device=self.attn_qkvw.device))
        # DeepSpeed's registration order: the weights, then the biases
        for names, tensors in ((PARAMETERS[2::2], weights[3:]), (PARAMETERS[3::2], biases[3:])):
            for name, t in zip(names, tensors, strict=True):
                setattr(self, name, t if isinstance(t, nn.Parameter) else nn.Parameter(t))

    @torch.no_grad()
    def init_transformer_weights(self, adjust_init_range: bool = False) -> None:
        """DeepSpeed's initialisation: weights ~ N(0, initializer_range), biases 0, norms 1.

        With ``adjust_init_range`` the two matrices that write into the residual stream
        (``attn_ow``, ``output_w``) take std ``initializer_range / sqrt(2 * num_hidden_layers)``
        -- but, as in DeepSpeed, only where ``config.local_rank == 0`` (DeepSpeed's
        engine then broadcasts rank 0's weights, so a launched job gets the adjusted ones and a
        single process with the default ``local_rank=-1`` does not).
        """
        c = self.config
        if c.initializer_range < 0:
            raise ValueError(f"DeepSpeedTransformerConfig.initializer_range must be >= 0 to "
                             f"initialise the weights, got {c.initializer_range}")
        output_std = c.initializer_range
        if adjust_init_range and c.local_rank == 0:
            if c.num_hidden_layers <= 0:
                raise ValueError("DeepSpeedTransformerConfig.num_hidden_layers must be > 0 "
                                 "for adjust_init_range")
            output_std = c.initializer_range / math.sqrt(2.0 * c.num_hidden_layers)
        self.attn_qkvw.normal_(mean=0.0, std=c.initializer_range)
        self.attn_ow.normal_(mean=0.0, std=output_std)
        self.inter_w.normal_(mean=0.0, std=c.initializer_range)
        self.output_w.normal_(mean=0.0, std=output_std)
        for name in ("attn_qkvb", "attn_ob", "attn_nb", "inter_b", "output_b", "norm_b"):
            getattr(self, name).zero_()
        self.attn_nw.fill_(1.0)
        self.norm_w.fill_(1.0)

    def forward(self, hidden_states, attention_mask=None, head_mask=None, layer_head_mask=None,
                encoder_hidden_states=None, encoder_attention_mask=None, past_key_value=None,
                output_attentions=False, grads=None):
        """The layer on ``hidden_states`` [B, S, hidden_size] with BERT's additive
        ``attention_mask`` (0 to attend, -10000 or -inf not to; [B, 1, 1, S] as the kernel
        reads it, or anything that broadcasts to [B, heads, S, S]; None attends to all).

        Returns the output, or ``(output,)`` when ``config.return_tuple`` (for callers that
        take ``layer(...)[0]``, as Hugging Face's encoders do). Dropout is on when the module
        is training and autograd is recording (the kernel's test); ``output_attentions`` is
        ignored, as in DeepSpeed. The head mask, cross-attention and cache arguments, which
        DeepSpeed silently ignores, are refused when given. ``grads``: DeepSpeed's test hook,
        a list that backward appends ``[gradient, tag]`` pairs to (of ``attn_qkvw``/``attn_qkvb``
        only the v rows, "V_W"/"V_B").
        """
        unused = {"head_mask": head_mask, "layer_head_mask": layer_head_mask,
                  "encoder_hidden_states": encoder_hidden_states,
                  "encoder_attention_mask": encoder_attention_mask,
                  "past_key_value": past_key_value}
        given = [name for name, value in unused.items() if value is not None]
        if given:
            raise ValueError(f"DeepSpeedTransformerLayer: {', '.join(given)} not supported "
                             "(DeepSpeed's kernel ignores them; an encoder self-attention "
                             "layer has no use for them)")
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.config.hidden_size:
            raise ValueError(f"DeepSpeedTransformerLayer: hidden_states must be [batch, seq, "
                             f"{self.config.hidden_size}], got {tuple(hidden_states.shape)}")
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            raise ValueError("DeepSpeedTransformerLayer: attention_mask must be BERT's additive "
                             "float mask (0 / -10000), not a boolean one")
        self.config.is_grad_enabled = torch.is_grad_enabled()
        self.config.training = self.training
        dropout = self.training and torch.is_grad_enabled()
        if dropout:
            self._check_dropout()
        out = bert_layer(hidden_states, attention_mask, self._tensors(grads), self.config, dropout)
        return (out,) if self.config.return_tuple else out

    def _check_dropout(self) -> None:
        for name in ("attn_dropout_ratio", "hidden_dropout_ratio"):
            ratio = getattr(self.config, name)
            if not 0 <= ratio < 1:
                raise ValueError(f"DeepSpeedTransformerConfig.{name} must be in [0, 1) to "
                                 f"train, got {ratio}")

    def _tensors(self, grads: list | None) -> dict[str, torch.Tensor]:
        """The parameters by name; with ``grads``, views of them whose gradient hooks report
        this call's gradients under DeepSpeed's tags."""
        tensors = {name: getattr(self, name) for name in PARAMETERS}
        if grads is None:
            return tensors
        h = self.config.hidden_size
        for name, t in tensors.items():
            if not t.requires_grad:
                continue
            tensors[name] = view = t.view_as(t)
            rows = slice(2 * h, 3 * h) if name in ("attn_qkvw", "attn_qkvb") else slice(None)
            view.register_hook(lambda g, tag=_GRAD_TAGS[name], rows=rows: grads.append(
                [g[rows], tag]))
        return tensors


def bert_layer(x: torch.Tensor, mask: torch.Tensor | None, p: dict[str, torch.Tensor],
               config: DeepSpeedTransformerConfig, dropout: bool) -> torch.Tensor:
    """The kernel's arithmetic over the parameters ``p`` (named as :data:`PARAMETERS`), pre- or
    post-LN as ``config.pre_layer_norm`` says; ``dropout`` turns the three dropouts on."""
    hidden_p = config.hidden_dropout_ratio if dropout else 0.0
    attn_p = config.attn_dropout_ratio if dropout else 0.0

    def norm(t, w, b):
        return F.layer_norm(t, t.shape[-1:], p[w], p[b], config.layer_norm_eps)

    def attention_block(t):
        ctx = self_attention(t, mask, p["attn_qkvw"], p["attn_qkvb"], config.heads, attn_p)
        return F.dropout(F.linear(ctx, p["attn_ow"], p["attn_ob"]), hidden_p, dropout)

    def mlp_block(t):
        inner = F.gelu(F.linear(t, p["inter_w"], p["inter_b"]), approximate="tanh")
        return F.dropout(F.linear(inner, p["output_w"], p["output_b"]), hidden_p, dropout)

    if config.pre_layer_norm:
        mid = x + attention_block(norm(x, "norm_w", "norm_b"))
        return mid + mlp_block(norm(mid, "attn_nw", "attn_nb"))
    mid = norm(x + attention_block(x), "attn_nw", "attn_nb")
    return norm(mid + mlp_block(mid), "norm_w", "norm_b")


def self_attention(x: torch.Tensor, mask: torch.Tensor | None, qkvw: torch.Tensor,
                   qkvb: torch.Tensor, heads: int, dropout_p: float) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v over ``heads`` heads, q, k and v being the first,
    second and third ``hidden`` rows of ``qkvw``. The softmax runs in fp32 whatever the dtype, as
    the kernel's does, and its probabilities go through dropout, as BERT's do. Returns
    [B, S, hidden]."""
    b, s, h = x.shape
    d = h // heads
    q, k, v = F.linear(x, qkvw, qkvb).view(b, s, 3, heads, d).permute(2, 0, 3, 1, 4)
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d)
    if mask is not None:
        scores = scores + mask.to(scores.dtype)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
    probs = F.dropout(probs, dropout_p, training=dropout_p > 0)
    return torch.matmul(probs, v).transpose(1, 2).reshape(b, s, h)


__all__ = ["DeepSpeedTransformerConfig", "DeepSpeedTransformerLayer", "bert_layer",
           "self_attention"]
