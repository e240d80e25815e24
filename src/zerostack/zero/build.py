"""The one place a ZeRO stage number chooses a strategy: stages 0-2 are one strategy (flat
buffers) composed of two choices, whether the masters and optimizer state are sharded over dp
(stages 1-2) and which gradient buffer it holds (full, stages 0-1; sharded, stage 2); stage 3
holds per-parameter pieces."""

from __future__ import annotations

from torch import nn

from .flat.grads import FullGrads, ShardedGrads
from .flat.strategy import ShardedDataParallel
from .offload.host import host_offload
from .stage3.strategy import Stage3
from .strategy import ZeroStrategy


def build_strategy(
    module: nn.Module,
    groups: list[dict],
    *,
    config,
    stage: int,
    comm,
    precision,
    prescale: float,
    shared: set[nn.Parameter] | frozenset = frozenset(),
) -> ZeroStrategy:
    """The strategy for ZeRO ``stage`` with the config's buckets, prefetch and offload;
    ``shared``: at ep > 1, the parameters every ep rank holds (all but the experts)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage!r}: zerostack builds stages 0, 1, 2 and 3")
    zcfg = config.zero_optimization
    common = dict(comm=comm, precision=precision, prescale=prescale)
    offload = zcfg.offload_optimizer
    if offload is not None and offload.device != "none":
        common.update(sub_group_numel=zcfg.sub_group_size)
    else:
        offload = None
    # the offload set-up, made once: where the optimizer's state lives and how it travels
    common.update(host=host_offload(offload, comm.topo.device))
    if stage == 3:
        if zcfg.offload_param is not None and zcfg.offload_param.device != "none":
            common.update(offload_param=zcfg.offload_param)
        return Stage3(
            module,
            groups,
            prefetch_numel=zcfg.effective_prefetch_bucket_size,
            max_live_numel=zcfg.stage3_max_live_parameters,
            max_reuse_numel=zcfg.effective_max_reuse_distance,
            persistence_threshold=zcfg.stage3_param_persistence_threshold,
            reduce_bucket_numel=zcfg.effective_reduce_bucket_size,
            quantized_weights=zcfg.zero_quantized_weights,
            quantized_gradients=zcfg.zero_quantized_gradients,
            gradient_bits=zcfg.zero_quantized_gradients_bits,
            hpz_partition_size=zcfg.zero_hpz_partition_size,
            shared=shared,
            quantized_frozen=zcfg.zero_quantized_nontrainable_weights,
            **common,
        )
    return ShardedDataParallel(
        module,
        groups,
        stage=stage,
        sharded_state=stage > 0,
        grads=ShardedGrads if stage == 2 else FullGrads,
        bucket_numel=zcfg.effective_reduce_bucket_size,
        reduce_scatter=zcfg.reduce_scatter,
        shared=shared,
        **common,
    )
