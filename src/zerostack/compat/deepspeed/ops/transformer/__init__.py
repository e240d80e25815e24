"""``deepspeed.ops.transformer``: DeepSpeed's fused BERT layer and its config, served by
zerostack's plain-torch :mod:`zerostack.models.bert_layer` (no compiled kernel)."""

from zerostack.models.bert_layer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer

__all__ = ["DeepSpeedTransformerConfig", "DeepSpeedTransformerLayer"]
