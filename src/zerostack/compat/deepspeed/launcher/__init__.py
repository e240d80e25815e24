"""``deepspeed.launcher``: the constants scripts read from DeepSpeed's launcher (Accelerate reads
the environment file's name). Launch with ``zerostack launch`` (DeepSpeed's flags), torchrun,
``mpirun`` or ``srun``."""

from . import runner

__all__ = ["runner"]
