"""The DeepSpeed engine's data-efficiency methods: random-LTD's schedule and set-up
(:mod:`zerostack.data.token_drop`), and the loader's post-process function."""

from __future__ import annotations

from zerostack.data import token_drop


class DataEfficiency:
    """Mixed into :class:`~.engine.DeepSpeedEngine` (which advances the schedule at each
    training forward and strips the wrappers' names from ``module_state_dict``)."""

    def _set_up_random_ltd(self) -> None:
        ltd = self.config.data_efficiency.random_ltd()
        if ltd is not None:  # DeepSpeed hands the layers the batch sizes through this dict
            ltd["global_batch_size"] = self.train_batch_size()
            ltd["micro_batch_size"] = self.train_micro_batch_size_per_gpu()
            self.state.random_ltd = token_drop.RandomLTDScheduler(ltd)
        self._random_ltd = ltd

    @property
    def random_ltd_scheduler(self) -> token_drop.RandomLTDScheduler | None:
        """The token-dropping schedule (``data_efficiency.data_routing.random_ltd``), saved
        and loaded with checkpoints; None when random-LTD is off."""
        return self.state.random_ltd

    def random_ltd_enabled(self) -> bool:
        return self._random_ltd is not None

    def random_ltd_config(self) -> dict:
        """The ``random_ltd`` block with DeepSpeed's defaults and the batch sizes."""
        return self._random_ltd

    def random_ltd_initialize(self) -> None:
        """Set up the layers ``convert_to_random_ltd`` wrapped (those the config names)."""
        if not self.random_ltd_enabled():
            raise RuntimeError("random_ltd_initialize: data_routing.random_ltd is not enabled")
        token_drop.initialize_layers(self.module, self._random_ltd, self.random_ltd_scheduler)

    def set_data_post_process_func(self, post_process_func) -> None:
        """DeepSpeed's: the training loader keeps ``post_process_func``. DeepSpeed's loader
        applies it to each batch only under curriculum learning, which zerostack refuses; so,
        as DeepSpeed's loader without curriculum learning, it applies nothing."""
        if self.training_dataloader is not None:
            self.training_dataloader.post_process_func = post_process_func
