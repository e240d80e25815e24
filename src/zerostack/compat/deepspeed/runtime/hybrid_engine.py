"""DeepSpeed-Chat's hybrid engine (``"hybrid_engine": {"enabled": true}``): the actor trains at
ZeRO-3 and generates its experience with the same weights. Generating token by token with stage
3's module hooks gathers each module's parameters again at every token; DeepSpeed's hybrid
engine gathers all layers once around ``generate``, and so does this: the module's ``generate``
is wrapped to run inside one :class:`~zerostack.zero.GatheredParameters` of every piece (read
only: the weights are not written back). DeepSpeed's inference kernels are not here (the block's
kernel settings take no effect, see :class:`zerostack.config.runs.HybridEngineConfig`).
"""

from __future__ import annotations

import contextlib
import functools

from zerostack.zero import GatheredParameters
from zerostack.zero.stage3.params import is_sharded


def gather_around_generate(module, config) -> None:
    """With ``config.hybrid_engine.enabled``, make ``module.generate`` (if it has one) run with
    every stage-3 piece of ``module`` gathered once."""
    generate = getattr(module, "generate", None)
    if generate is None or not config.hybrid_engine.enabled:
        return

    @functools.wraps(generate)
    def generate_gathered(*args, **kwargs):
        pieces = [p for p in module.parameters() if is_sharded(p)]
        with GatheredParameters(pieces) if pieces else contextlib.nullcontext():
            return generate(*args, **kwargs)

    module.generate = generate_gathered
