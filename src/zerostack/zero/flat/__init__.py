"""ZeRO stages 0-2: flat parameter buffers, bucketed gradient reduction, sharded masters.

:class:`~.strategy.ShardedDataParallel` sequences the step over parts that are each given the
state they work on: :class:`~.buffers.FlatBuffers` (the flat groups, their buckets and the
parameter index: the one owner), the gradient buffer (:mod:`.grads`), the write-back
(:mod:`.write_back`) and the checkpoint view (:mod:`.checkpoint`). The words are defined in
:mod:`zerostack.zero`'s vocabulary.
"""
