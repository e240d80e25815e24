"""The engine's data-loader sampler: DistributedSampler's order, and a position checkpoints keep.

``initialize(training_data=...)`` shards the dataset over the data-parallel ranks with
:class:`ResumableSampler`. For the same seed and epoch it yields exactly what torch's
``DistributedSampler`` yields, and it counts the samples it has handed out in the current epoch.
``engine.save_checkpoint`` records that position and ``engine.load_checkpoint`` restores it, so a
DeepSpeed-style loop that calls ``iter(loader)`` again after loading continues with the first
micro-batch the saved run had not seen::

    engine.load_checkpoint("ckpt")
    for epoch in range(loader.sampler.epoch, epochs):
        loader.sampler.set_epoch(epoch)      # the restored epoch keeps the restored position
        for x, y in loader:                  # the rest of that epoch, then whole epochs
            ...
"""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import DistributedSampler


class ResumableSampler(DistributedSampler):
    """torch's ``DistributedSampler`` with a position: ``state_dict()`` is the epoch and the
    samples handed out in it (over all replicas); after ``load_state_dict`` the next pass skips
    them. ``set_epoch`` to another epoch starts that epoch at its beginning.

    The position counts what the sampler has yielded, which is what was trained on when no worker
    processes read ahead (the engine's loader has none). Loaded with another number of replicas,
    the position rounds down to a whole number of samples per replica (a few are seen again).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.position = 0  # samples this replica has yielded in this epoch
        self._resume = False  # the next pass starts at ``position`` (after load_state_dict)

    def __iter__(self) -> Iterator[int]:
        order = list(super().__iter__())
        start = self.position if self._resume else 0
        self.position, self._resume = start, False
        return self._counted(order[start:])

    def _counted(self, indices: list[int]) -> Iterator[int]:
        for i in indices:
            self.position += 1
            yield i

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.position, self._resume = 0, False
        super().set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        """The epoch, the samples handed out in it over all replicas, and the shuffle's seed."""
        return {
            "epoch": self.epoch,
            "consumed_samples": self.position * self.num_replicas,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state``'s position (the next pass skips what it counts); the seed must
        be the one the order was drawn with, or the skipped samples would be other ones."""
        if "seed" in state and int(state["seed"]) != self.seed:
            raise ValueError(
                f"seed: the saved data order was shuffled with seed {state['seed']}, this "
                f"loader's is {self.seed}; set the config's seed to {state['seed']} to resume it"
            )
        self.epoch = int(state["epoch"])
        self.position = min(int(state["consumed_samples"]) // self.num_replicas, self.num_samples)
        self._resume = True
