"""``deepspeed.runtime.base_optimizer.DeepSpeedOptimizer``: Lightning asks whether a state
value is one. zerostack's optimizers are plain torch optimizers, so nothing is."""


class DeepSpeedOptimizer:
    """DeepSpeed's base class of its ZeRO optimizer wrappers; zerostack makes no instances."""


__all__ = ["DeepSpeedOptimizer"]
