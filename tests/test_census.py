"""The census of real DeepSpeed use (scripts/census/deepspeed_census.json) against zerostack: the
reference page's section is the output of scripts/census_coverage.py, and the names TRL,
Accelerate, Transformers, Lightning and DeepSpeed's tutorials use that do not work yet are
exactly :data:`GAPS` (each with why): a name that starts to work must leave the list, and a name
that stops working fails here."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import census_coverage  # noqa: E402
from _pages import between  # noqa: E402

GAPS: dict[str, str] = {}
"""What TRL, Accelerate, Transformers, Lightning and DeepSpeed's tutorials use that does not work
yet, and why. It may only shrink."""


def test_the_census_is_reproducible_data():
    census = json.load(open(census_coverage.CENSUS))
    assert census["command"].startswith("DS_ACCELERATOR=cpu .peers/bin/python scripts/")
    packages = {s["package"] for s in census["sources"] if "error" not in s}
    assert set(census_coverage.MUST) <= packages
    for row in census["rows"][:50]:
        assert {"package", "version", "file", "line", "kind", "name"} <= set(row)


def test_the_page_and_the_gaps_are_the_lookups():
    names, works, absent = census_coverage.coverage()
    shown = between(census_coverage.PAGE, census_coverage.BEGIN, census_coverage.END)
    assert shown == census_coverage.table(names, works, absent), (
        "run: python scripts/census_coverage.py --write"
    )
    must = {n for n, e in names.items() if e["packages"] & set(census_coverage.MUST)}
    assert {n for n in must if not works[n]} == set(GAPS)
    # what the lookups must find: the names this work served
    for name in (
        "deepspeed.runtime.utils.move_to_device",
        "deepspeed.utils.set_z3_leaf_modules",
        "DeepSpeedZeRoOffload._register_deepspeed_module",
        "PartitionedParameterCoordinator._invalidate_trace",
        "ds_active_sub_modules",
        "ds_external_parameters",
        "zero_optimization.stage3_prefetch_bucket_size",
        "DeepSpeedEngine.offload_states",
        "deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum.optim_states",
        "deepspeed.runtime.activation_checkpointing.offload_activations."
        "get_checkpoint_hidden_states_offloading_ctx_manager",
        "deepspeed.DeepSpeedConfig",
        "deepspeed.monitor.monitor.MonitorMaster",
        "deepspeed.ops.lion.DeepSpeedCPULion",
        "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad",
        "cur_scale",
        "deepspeed.init_inference",
        "deepspeed.DeepSpeedTransformerLayer",
        "deepspeed.ops.deepspeed4science.DS4Sci_EvoformerAttention",
        "deepspeed.ops.op_builder.AsyncIOBuilder",
        "DeepSpeedEngine.tput_timer",
        "DeepSpeedEngine.reset_activation_shape",
        "ds_tensor",
        "deepspeed.compression.helper.recursive_setattr",
        "DeepSpeedZeroOptimizer_Stage3.quantize_nontrainable_params",
        "zero_optimization.zero_quantized_nontrainable_weights",
    ):
        assert works[name], name
