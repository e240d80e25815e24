"""DeepSpeed 0.19.8's public Python API as users, Transformers and Accelerate call it, and what
zerostack has for each name.

:data:`DEEPSPEED_API` is the one table, by section (a DeepSpeed module, or an engine class).
Each DeepSpeed name

- **works**: the same name under ``zerostack`` (``deepspeed.zero.Init`` is ``zerostack.zero.Init``;
  an engine method is on the engine ``initialize`` returns, a
  :class:`~zerostack.compat.deepspeed.runtime.engine.DeepSpeedEngine`), reachable the same way after
  ``import zerostack as deepspeed``;
- is **different**: zerostack has it under another name (``ours``), or under the same name with
  a difference a caller can see (``note`` says which); ``zerostack.compat.deepspeed.<path>`` is
  DeepSpeed's own path, which ``import deepspeed`` reaches after
  ``zerostack.compat.deepspeed.install()`` or under ``python -m zerostack.as_deepspeed``; or
- is **not supported**: no such name in zerostack (an ``AttributeError`` / ``ImportError``),
  with why and what to use instead.

The names are those a training script, Transformers' and Accelerate's DeepSpeed integrations
(``engine.backward``, ``deepspeed.zero.GatheredParameters``, ``deepspeed.utils.safe_get_full_*``,
...) and DeepSpeed's tutorials call; DeepSpeed's internal helpers are left out.
``scripts/api_table.py`` writes the docs' table from it (``docs/reference/deepspeed-api.md``),
and tests/test_api_surface.py holds both the table and the code to it.
"""

from __future__ import annotations

from .engine import ENGINES
from .modules import MODULES
from .rows import (
    _SERVED,
    DIFFERENT,
    ENGINE,
    PIPE_ENGINE,
    UNSUPPORTED,
    WORKS,
    Api,
    zerostack_name,
)

DEEPSPEED_API: dict[str, dict[str, Api]] = {**MODULES, **ENGINES}
"""The one table, by section (a DeepSpeed module, or an engine class)."""


for _section in DEEPSPEED_API.values():
    for _name, _entry in _section.items():
        if _entry.ours == _SERVED:
            _section[_name] = Api(_entry.status, _entry.note, "zerostack.compat." + _name)


def entries() -> dict[str, Api]:
    """Every DeepSpeed name in :data:`DEEPSPEED_API`, in table order."""
    return {name: entry for section in DEEPSPEED_API.values() for name, entry in section.items()}


__all__ = [
    "DEEPSPEED_API",
    "DIFFERENT",
    "ENGINE",
    "PIPE_ENGINE",
    "UNSUPPORTED",
    "WORKS",
    "Api",
    "entries",
    "zerostack_name",
]
