"""The rows of the DeepSpeed API table: :class:`Api` (what zerostack has for one DeepSpeed
name) and the short ways the sections write one."""

from __future__ import annotations

from dataclasses import dataclass

WORKS = "works"
DIFFERENT = "different"
UNSUPPORTED = "not supported"

ENGINE = "DeepSpeedEngine"  # deepspeed.runtime.engine -> zerostack.compat.deepspeed.runtime.engine
PIPE_ENGINE = "PipelineEngine"  # deepspeed.runtime.pipe.engine -> zerostack.pipeline


@dataclass(frozen=True)
class Api:
    """What zerostack has for one DeepSpeed name."""

    status: str
    """WORKS, DIFFERENT or UNSUPPORTED."""
    note: str = ""
    """For DIFFERENT: what differs; for UNSUPPORTED: why, and what to use (one short phrase)."""
    ours: str | None = None
    """zerostack's name where it is not DeepSpeed's with ``zerostack`` for ``deepspeed``."""


def _works(note: str = "") -> Api:
    return Api(WORKS, note)


def _different(note: str, ours: str | None = None) -> Api:
    return Api(DIFFERENT, note, ours)


def _no(note: str) -> Api:
    return Api(UNSUPPORTED, note)


_SERVED = "<served>"  # ours: the same path under zerostack.compat (filled in below the table)


def _served(note: str) -> Api:
    """DeepSpeed's path under ``zerostack.compat.deepspeed``, which ``import deepspeed`` is after
    ``zerostack.compat.deepspeed.install()`` (and under ``python -m zerostack.as_deepspeed``)."""
    return Api(DIFFERENT, note, _SERVED)


def zerostack_name(name: str, entry: Api) -> str:
    """Where zerostack has ``name`` (a dotted path, or ``Engine.x`` / ``PipelineEngine.x``)."""
    if entry.ours is not None:
        return entry.ours
    if name.startswith(f"{ENGINE}."):
        return "Engine." + name.split(".", 1)[1]
    if name.startswith(f"{PIPE_ENGINE}."):
        return name
    return "zerostack" + name[len("deepspeed") :]


_IMPORT_PIPE = "as DeepSpeed's, after `import zerostack.pipe` (`import zerostack` does not load it)"
_NO_OPS = (
    "no compiled ops: optimizers are torch's (fused where torch has a kernel), the other ops "
    "torch code"
)
_CFG = "read the value from `engine.config`"
_LOGGER = 'zerostack\'s logger (`logging.getLogger("zerostack")`)'
