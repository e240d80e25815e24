"""DeepSpeed 0.19.8's module tree as Hugging Face Transformers, Accelerate and Lightning import
it, served by zerostack.

Two ways in::

    import zerostack.compat.deepspeed as deepspeed      # this module, under a local name

    import zerostack.compat.deepspeed
    zerostack.compat.deepspeed.install()                # before transformers/accelerate/lightning
    import transformers                                 # finds "deepspeed" 0.19.8+zerostack.<v>

or, with no change to a script: ``python -m zerostack.as_deepspeed train.py [ARGS]`` (also under
``torchrun ... -m zerostack.as_deepspeed`` and ``accelerate launch -m zerostack.as_deepspeed``).

``deepspeed.zero``, ``deepspeed.comm``, ``deepspeed.checkpointing``, ``deepspeed.moe``,
``deepspeed.pipe``, ``deepspeed.profiling`` and ``deepspeed.sequence`` are zerostack's modules
of those names; the rest of the tree (``runtime``, ``ops``, ``accelerator``, ``checkpoint``,
``utils``) is DeepSpeed's paths over zerostack's parts, and holds only the names those
libraries use. Anything else under ``deepspeed.`` is a ``ModuleNotFoundError`` once installed.
"""

from __future__ import annotations

import argparse
import functools
import importlib

from zerostack import activation_checkpointing, checkpointing, comm, zero
from zerostack import compose as _compose
from zerostack.config import ConfigError as DeepSpeedConfigError
from zerostack.core.version import __version__ as _zerostack_version
from zerostack.world import init_distributed

from ..serve import ServedName, serve
from . import accelerator, checkpoint, launcher, monitor, ops, runtime, utils
from .accelerator import get_accelerator
from .inference import InferenceEngine, init_inference
from .ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer
from .runtime.config import DeepSpeedConfig
from .runtime.engine import DeepSpeedEngine
from .utils.logging import log_dist, logger

API_LEVEL = "0.19.8"
"""The DeepSpeed release whose API this tree implements."""
__version__ = f"{API_LEVEL}+zerostack.{_zerostack_version}"
version = __version__  # DeepSpeed's ``deepspeed.version`` (OpenRLHF compares it)
__version_major__, __version_minor__, __version_patch__ = (int(v) for v in API_LEVEL.split("."))

ALIASES = {
    f"deepspeed.{name}": f"zerostack.{name}"
    for name in (
        "zero",
        "comm",
        "checkpointing",
        "activation_checkpointing",
        "moe",
        "pipe",
        "profiling",
        "sequence",
    )
}
"""``deepspeed.<name>`` (and its submodules) served by zerostack's module of that name."""
ALIASES["deepspeed.runtime.activation_checkpointing.checkpointing"] = (
    "zerostack.activation_checkpointing"  # DeepSpeed's module path of the same thing
)

_LATER = {"moe", "pipe", "profiling", "sequence"}  # imported on first use, as attributes too
LIBRARIES = ("transformers", "accelerate", "lightning", "pytorch_lightning", "lightning_fabric")
"""Libraries that look DeepSpeed up when they are imported: install() must come before them."""


@functools.wraps(_compose.initialize)
def native_initialize(*args, **kwargs):
    """``zerostack.initialize``: DeepSpeed's call, its engine accessors, and every key nobody
    knows refused (see :func:`initialize` for ``deepspeed.initialize``)."""
    kwargs.setdefault("engine_type", DeepSpeedEngine)
    out = _compose.initialize(*args, **kwargs)
    from .utils import groups  # what ALST code asks for the sp group next

    groups._set_grid(out[0].topology)
    return out


@functools.wraps(_compose.initialize)
def initialize(*args, **kwargs):
    """``deepspeed.initialize`` served by zerostack: as ``zerostack.initialize``, but a config
    key neither knows, in a block where DeepSpeed 0.19.8 ignores such keys (the top level:
    TRL's ``"zero_optimization.reduce_bucket_size"``), is ignored with one warning naming it,
    as DeepSpeed ignores it; where DeepSpeed refuses one, it is refused."""
    kwargs.setdefault("unknown_keys", "as_deepspeed")
    return native_initialize(*args, **kwargs)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's: a "DeepSpeed" group of ``--deepspeed`` (a flag for the script's own use),
    ``--deepspeed_config PATH`` (which ``initialize(args=...)`` reads) and their deprecated
    ``--deepscale`` spellings. Returns ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (a flag for the script; no effect on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="deprecated: --deepspeed_config")
    return parser


def tp_model_init(model, tp_size: int, dtype=None, config=None, **kwargs):
    """DeepSpeed's AutoTP entry point. zerostack splits the model at ``initialize``, from the
    config's ``tensor_parallel.autotp_size``: this checks that the config says ``tp_size`` and
    returns the model unchanged (Transformers passes the same config to ``initialize`` next)."""
    size = ((config or {}).get("tensor_parallel") or {}).get("autotp_size")
    if size != tp_size:
        raise DeepSpeedConfigError(
            f"tp_model_init(tp_size={tp_size}): zerostack applies tensor parallelism at "
            f"initialize from the config's tensor_parallel.autotp_size, which is {size!r}; pass "
            f"config= with autotp_size {tp_size}"
        )
    return model


def install():
    """Make ``import deepspeed`` and the ``deepspeed`` distribution resolve to this module tree.

    Call it before Transformers, Accelerate or Lightning is imported (they look DeepSpeed up
    then; a later call raises, naming them). Refused when a real DeepSpeed is installed in the
    environment, which this would shadow. Calling it again does nothing."""
    return serve(
        ServedName(
            "deepspeed",
            __name__,
            ALIASES,
            __version__,
            "DeepSpeed's API served by zerostack",
        ),
        refuse_after=LIBRARIES,
        why_before="they decide whether DeepSpeed is installed when they are imported",
    )


def __getattr__(name: str):
    if name in _LATER:
        return importlib.import_module(f"zerostack.{name}")
    if name == "PipelineEngine":
        return importlib.import_module("zerostack.pipeline").PipelineEngine
    raise AttributeError(f"module 'deepspeed' (zerostack) has no attribute {name!r}")


__all__ = [
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "add_config_arguments",
    "DeepSpeedEngine",
    "DeepSpeedTransformerConfig",
    "DeepSpeedTransformerLayer",
    "accelerator",
    "activation_checkpointing",
    "checkpoint",
    "checkpointing",
    "comm",
    "get_accelerator",
    "init_distributed",
    "init_inference",
    "InferenceEngine",
    "initialize",
    "install",
    "launcher",
    "log_dist",
    "logger",
    "monitor",
    "ops",
    "runtime",
    "tp_model_init",
    "utils",
    "version",
    "zero",
]
