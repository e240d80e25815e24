"""ZeRO stage 3: parameters cut into per-parameter pieces, gathered per unit just before use.

:class:`~.strategy.Stage3` holds the masters and gradient shards; :mod:`.coordinator` decides
which units are gathered when (:mod:`.gather` gathers one, :mod:`.collectives` holds the
collectives, ZeRO++'s :mod:`.quantize` their int8 form); :mod:`.reduce` reduce-scatters the
gradients; :mod:`.params` is each parameter's piece record (``p._zs``), :mod:`.groups` the
optimizer groups' masters and :mod:`.checkpoint` what a checkpoint reads and writes. The words
are defined in :mod:`zerostack.zero`'s vocabulary.
"""
