"""How many bytes a layout needs per rank, before renting machines: model states, activations.

Pure arithmetic over plain data, no process group. Three layers of answer:

* :func:`model_states`: the bytes one rank holds for parameters, gradients, fp32 masters and
  optimizer state, as zerostack lays them out (what ``engine.memory_breakdown()`` reports), for
  any ZeRO stage, dp, precision and offload, given the parameters this rank's tp x pp slice holds.
* :func:`zero_paper_bytes`: the ZeRO paper's accounting (Rajbhandari et al., SC'20, Figure 1:
  16-bit parameters and gradients, K = 12 bytes of Adam state per parameter), for comparison.
  zerostack differs at stages 2 and 3 by keeping the gradient shard in fp32 (2 bytes per
  parameter / dp more, in exchange for gradients accumulated without 16-bit rounding).
* :func:`activation_bytes`: activations of one micro-batch through a transformer stage, from
  Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer Models",
  Table 2, with the dtype and dropout masks made explicit.

:func:`estimate` puts them together for a layout; ``zerostack estimate`` prints it. DeepSpeed's
helpers (``estimate_zero2_model_states_mem_needs_all_live`` / ``_all_cold`` and the zero3 pair)
keep their signatures and table, with zerostack's figures.
"""

from .activations import Transformer, layer_activation_bytes, stage_activation_bytes
from .deepspeed import (
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from .memory import (
    OPTIMIZER_STATE_BYTES,
    PRECISION_BYTES,
    EstimateError,
    Layout,
    ModelStates,
    model_states,
    zero_paper_bytes,
)
from .report import Workload, count_parameters, describe, estimate, layouts_for, render

__all__ = [
    "EstimateError",
    "Layout",
    "ModelStates",
    "OPTIMIZER_STATE_BYTES",
    "PRECISION_BYTES",
    "Transformer",
    "Workload",
    "count_parameters",
    "describe",
    "estimate",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "layer_activation_bytes",
    "layouts_for",
    "model_states",
    "render",
    "stage_activation_bytes",
    "zero_paper_bytes",
]
