"""``engine.config``: DeepSpeed's config dict, read-only, over zerostack's typed config.

DeepSpeed's ``engine.config`` is the dict the run was configured with, and libraries read it as
one (Hugging Face's ``trainer.save_model`` calls ``engine.config.get("zero_optimization", {})``).
zerostack's own code reads typed fields (``engine.config.zero_optimization.stage``). A
:class:`ConfigView` is both: a read-only mapping of :meth:`ZeroStackConfig.to_dict` (every key,
defaults and the resolved batch sizes filled in, DeepSpeed's key names) whose attributes are the
typed config's.

It is read-only on purpose: the run was built from the config at ``initialize``, so writing a key
afterwards would change nothing, and a silent no-op is worse than a ``TypeError``. Values handed
out are copies for the same reason.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

from . import ZeroStackConfig

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class ConfigView(Mapping):
    """DeepSpeed's ``engine.config`` (``.get``, ``[]``, ``in``, iteration) and the typed config
    (``view.zero_optimization.stage``; the model itself is ``view.typed``)."""

    __slots__ = ("typed", "_dict", "_batch")

    def __init__(
        self, typed: ZeroStackConfig, batch: tuple[int, int, int] | None = None
    ) -> None:
        """``batch``: the resolved (train_batch_size, micro batch, accumulation steps), written
        into the dict's three batch keys whether or not the config set them."""
        data = typed.to_dict()
        if batch is not None:
            data.update(zip(_BATCH_KEYS, batch, strict=True))
        object.__setattr__(self, "typed", typed)
        object.__setattr__(self, "_dict", data)
        object.__setattr__(self, "_batch", batch)

    def __getitem__(self, key: str) -> Any:
        return copy.deepcopy(self._dict[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict)

    def __len__(self) -> int:
        return len(self._dict)

    def __getattr__(self, name: str) -> Any:
        if name in ConfigView.__slots__ or name.startswith("__"):
            raise AttributeError(name)  # not set yet (copying, unpickling): no recursion
        return getattr(self.typed, name)

    def __reduce__(self):
        return ConfigView, (self.typed, self._batch)

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError(
            f"engine.config is read-only: the run was built from it at initialize "
            f"(setting {name!r} would change nothing)"
        )

    def __repr__(self) -> str:
        return f"ConfigView({self._dict!r})"
