"""``deepspeed.runtime.dataloader``: ``RepeatingLoader``, which pipeline and tutorial scripts wrap
their loader in before ``engine.train_batch(data_iter=...)``."""

from __future__ import annotations


class RepeatingLoader:
    """An endless iterator over ``loader``: when it runs out, it starts again (a torch
    ``DataLoader`` with a ``DistributedSampler`` then draws the same order unless the script
    calls ``set_epoch``, as under DeepSpeed)."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


__all__ = ["RepeatingLoader"]
