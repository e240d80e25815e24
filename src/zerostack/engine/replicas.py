"""Parameters more than one rank holds and counts: each must start alike everywhere and count
once (in the gradient norm, in checkpoints).

Parameters not split by tensor parallelism are replicas on the tp ranks: they start as tp rank
0 has them (with the buffers), and tp rank 0 counts them. With expert parallelism every ep rank
holds all but the experts: ep rank 0 counts those, unless the ZeRO strategy cuts their state
over the ep ranks too (stages 1-2: each rank counts its piece), and the strategy sums their
gradients over ep.
"""

from __future__ import annotations

from torch import nn

from ..moe.utils import is_moe_param
from ..tensor_parallel import partition_spec
from ..zero.stage3.params import is_sharded


class Replicas:
    """The replicated parameters of ``module`` on this rank's grid (see the module)."""

    def __init__(self, module: nn.Module, topology, comm) -> None:
        self.topology = topology
        replicas = [p for p in module.parameters() if partition_spec(p) is None]
        self._tp_replicas = set(replicas)
        self._ep_replicas = (  # what every ep rank holds: counted on ep rank 0 only
            {p for p in module.parameters() if not is_moe_param(p)} if topology.ep > 1 else set()
        )
        if topology.tp > 1:  # start alike: as tp rank 0 has them, in model order
            for t in [*replicas, *module.buffers()]:
                if not is_sharded(t):  # zero.Init shards are broadcast when they are made
                    comm.broadcast(t.data, src=0, axis="tp")

    @property
    def ep_shared(self) -> set[nn.Parameter]:
        """What every ep rank holds (empty without expert parallelism)."""
        return self._ep_replicas

    def elsewhere(self, cut_over_ep: set[nn.Parameter] | frozenset = frozenset()):
        """Those another rank also holds and counts: tp replicas off tp rank 0, all but the
        experts off ep rank 0, save those in ``cut_over_ep`` (whose state each rank holds a
        piece of)."""
        topo = self.topology
        held = self._tp_replicas if topo.tp > 1 and topo.rank("tp") != 0 else set()
        if topo.ep > 1 and topo.rank("ep") != 0:
            held = held | (self._ep_replicas - cut_over_ep)
        return held
