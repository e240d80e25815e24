"""ZeRO: partition math, the data-parallel strategies built on it, and stage-3 model building.

``zerostack.zero.Init`` and ``zerostack.zero.GatheredParameters`` have DeepSpeed's names and use.
Stages 0-2 live in :mod:`.flat`, stage 3 in :mod:`.stage3`, the offloads in :mod:`.offload`;
:mod:`.build` is the one place a stage number picks among them.

[Note: ZeRO vocabulary] The words the files under ``zero/`` use, defined here once:

- **flat group**: at stages 0-2, the trained parameters of one optimizer group on one cut, packed
  end to end into one compute-dtype buffer whose views the parameters become
  (:class:`~.flat.params.FlatGroup`); at ep > 1 an optimizer group is two flat groups.
- **slot**: one parameter's place in a flat group's buffer: its index, offset, size and shape
  (:class:`~.partition.Slot`).
- **bucket**: at stages 0-2, a contiguous range of a flat buffer cut at parameter boundaries and
  padded to split evenly, reduced by one collective (:class:`~.partition.Bucket`; its state
  :class:`~.flat.params.BucketState`); at stage 3, a few units' parameters reduced together
  (:mod:`.stage3.reduce`).
- **piece**: one rank's equal, padded part (a multiple of :data:`~.partition.ALIGN_NUMEL`
  elements): of a bucket at stages 0-2 (rank ``r`` holds piece ``r`` of every bucket), of one
  parameter at stage 3 (``p._zs.piece``).
- **shard**: a rank's pieces end to end: of every bucket of a flat group (stage 2's gradient
  shard), or of a stage-3 (sub-)group's parameters (its gradient shard and master).
- **cut**: where a parameter's gradients are summed and its state divided: the grid axis (dp, or
  dp_ep for what every ep rank holds), its size, this rank, how many ranks share the state, and
  the prescale (:class:`~.flat.params.Cut`; at stage 3 the same fields on ``p._zs``).
- **segment**: at stages 0-2, ``(start, end, param)``: the elements of one parameter inside a
  bucket's master (``BucketState.segments``).
- **master**: the fp32 tensor the optimizer steps: this rank's piece of a bucket (stages 0-2; in
  fp32 without offload a view of the parameter buffer itself) or a stage-3 (sub-)group's pieces
  end to end; in host memory or files when the optimizer is offloaded.
- **unit**: at stage 3, a module that owns parameters directly (and the root), whose parameters
  are gathered as one before its forward and backward and freed after
  (:mod:`.stage3.coordinator`).
- **sub-group**: at stage 3 on NVMe, a run of an optimizer group's parameters swapped with the
  disk as one; at stages 0-2 on NVMe, a rank's piece of a bucket is one.
"""

from .init import GatheredParameters, Init
from .stage3.module_hooks import register_external_parameter, unregister_external_parameter
from .stage3.params import StorageMeter

__all__ = [
    "GatheredParameters",
    "Init",
    "StorageMeter",
    "register_external_parameter",
    "unregister_external_parameter",
]
