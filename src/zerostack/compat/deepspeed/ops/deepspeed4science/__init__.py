"""``deepspeed.ops.deepspeed4science``: ``DS4Sci_EvoformerAttention`` (OpenFold's Evoformer
attention), in torch rather than DeepSpeed's CUTLASS kernel: see
:mod:`zerostack.models.evoformer` for what it takes and where it differs."""

from zerostack.models.evoformer import DS4Sci_EvoformerAttention

__all__ = ["DS4Sci_EvoformerAttention"]
