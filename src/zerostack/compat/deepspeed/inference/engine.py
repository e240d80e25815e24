"""``deepspeed.init_inference`` and its ``InferenceEngine``: a trained model run for inference,
in the dtype asked, split over tensor-parallel ranks by zerostack's AutoTP table.

DeepSpeed's tutorials (automatic tensor parallelism, inference, MoE inference) wrap a Hugging
Face model::

    pipe.model = deepspeed.init_inference(pipe.model, tensor_parallel={"tp_size": world_size},
                                          dtype=torch.float)

What each setting does here, read from DeepSpeed 0.19.8's ``DeepSpeedInferenceConfig``:

- ``dtype`` (default fp16, as DeepSpeed's): the module is cast to it; int8 is refused (no
  quantized kernels);
- ``tensor_parallel`` (``tp_size``, ``enabled``, ``tp_group``/``mpu`` refused: zerostack builds
  the group) and the deprecated ``mp_size``: the linear layers are split over ``tp_size`` ranks
  with :func:`zerostack.tensor_parallel.autotp.parallelize` (column then row, one all-reduce per
  attention and per MLP: DeepSpeed's AutoTP cut); every rank must hold the same weights, as
  ``from_pretrained`` gives them. An architecture outside the table is refused with the list;
- ``injection_policy`` (a block class and the names of its row-parallel linears): checked
  against the model's names, as DeepSpeed checks it; with ``tp_size`` > 1 the names must be the
  table's row-parallel layers of that architecture (zerostack's cut), else refused;
- ``replace_with_kernel_inject``, ``enable_cuda_graph``, ``use_triton``, ``triton_autotune``:
  DeepSpeed's fused inference kernels and CUDA graphs make it faster, not different; zerostack
  has none, and says so once in a warning: the model's own layers run;
- ``max_out_tokens`` (``max_tokens``): ``generate`` refuses a longer prompt, as DeepSpeed's;
  ``generate`` with ``num_beams`` > 1 is refused as DeepSpeed refuses it;
- ``keep_module_on_host``: the module stays where it is, else it moves to this rank's device;
- ``checkpoint``, ``quant``, ``moe`` and the rest: refused, naming the key (load the weights
  into the model first).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("zerostack")

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}
_SPEED_ONLY = ("replace_with_kernel_inject", "enable_cuda_graph", "use_triton", "triton_autotune")
_ALIASES = {
    "kernel_inject": "replace_with_kernel_inject",
    "tp": "tensor_parallel",
    "max_tokens": "max_out_tokens",
    "min_tokens": "min_out_tokens",
    "injection_dict": "injection_policy",
}
_KNOWN = {
    "dtype",
    "tensor_parallel",
    "mp_size",
    "injection_policy",
    "max_out_tokens",
    "min_out_tokens",
    "keep_module_on_host",
    "return_tuple",
    "triangular_masking",
    *_SPEED_ONLY,
}


def _dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if str(value).lower() in _DTYPES:
        return _DTYPES[str(value).lower()]
    raise ValueError(f"init_inference: dtype {value!r} is not one of {', '.join(_DTYPES)}")


def _settings(config: dict) -> dict:
    """DeepSpeed's inference settings, its aliases resolved and every key checked."""
    out = {"dtype": torch.float16, "tensor_parallel": {}, "mp_size": 1, "max_out_tokens": 1024}
    for key, value in config.items():
        key = _ALIASES.get(key, key)
        if key not in _KNOWN:
            raise ValueError(
                f"init_inference: {key!r} is not supported (zerostack serves dtype, "
                "tensor_parallel, injection_policy, max_out_tokens and keep_module_on_host; "
                "load a checkpoint into the model before init_inference)"
            )
        out[key] = value
    tp = dict(out["tensor_parallel"])
    for key in ("tp_group", "mpu"):
        if tp.get(key) is not None:
            raise ValueError(f"init_inference: tensor_parallel.{key}: zerostack builds the group")
    if out["mp_size"] > 1 and tp.get("tp_size", 1) == 1:
        tp["tp_size"] = out["mp_size"]  # deprecated spelling of tensor_parallel.tp_size
    out["tp_size"] = tp.get("tp_size", 1) if tp.get("enabled", True) else 1
    out["dtype"] = _dtype(out["dtype"])
    if out["dtype"] == torch.int8:
        raise ValueError("init_inference: dtype int8: zerostack has no quantized inference kernels")
    if out["max_out_tokens"] <= 0:
        raise ValueError("init_inference: max_out_tokens must be > 0")
    return out


class InferenceEngine(nn.Module):
    """The model for inference (see the module): ``engine(...)`` is ``engine.module(...)``;
    ``engine.generate(...)`` the module's ``generate`` with DeepSpeed's checks."""

    def __init__(self, model: nn.Module, config: dict) -> None:
        super().__init__()
        self.module = model
        self._config = cfg = _settings(config)
        self.topology = None
        asked = [k for k in _SPEED_ONLY if cfg.get(k)]
        if asked:
            log.warning(
                "init_inference: %s: zerostack has no fused inference kernels or CUDA graphs; "
                "the model's own layers run (the same results, not DeepSpeed's speed)",
                ", ".join(asked),
            )
        self.module.to(cfg["dtype"])
        if cfg["tp_size"] > 1 or cfg.get("injection_policy"):
            self._split(cfg)
        if not cfg.get("keep_module_on_host"):
            from ..accelerator import get_accelerator

            self.module.to(get_accelerator().current_device_name())
        self._is_compiled = False

    def _split(self, cfg: dict) -> None:
        from zerostack.tensor_parallel import autotp

        policy = cfg.get("injection_policy") or {}
        names = [n for n, _ in self.module.named_modules()]
        for block, rows in policy.items():
            if not (isinstance(block, type) and issubclass(block, nn.Module)):
                raise ValueError(f"init_inference: injection_policy key {block!r} is no module")
            for row in (rows,) if isinstance(rows, str) else rows:
                if not any(n.endswith(row) for n in names):
                    raise ValueError(f"Injection policy layer'{row}' not valid.")  # DeepSpeed's
                table = autotp.policy_for(self.module).row if cfg["tp_size"] > 1 else (row,)
                if not any(row.endswith(r) or r.endswith(row) for r in table):
                    raise ValueError(
                        f"init_inference: injection_policy names {row!r} row-parallel; "
                        f"zerostack's cut of {autotp.model_type(self.module)} all-reduces after "
                        f"{', '.join(table)}"
                    )
        if cfg["tp_size"] > 1:
            from zerostack.topology import Topology

            self.topology = Topology.build(tp=cfg["tp_size"])
            autotp.parallelize(self.module, self.topology)

    @property
    def mp_world_size(self) -> int:
        return self._config["tp_size"]

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def __getattr__(self, name: str):
        """What the engine lacks, its module's (a pipeline reads ``model.config``, ``.device``
        and ``.can_generate()`` of the model it was given)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
        return getattr(module, name)

    def generate(self, *inputs, **kwargs):
        """The module's ``generate``, after DeepSpeed's checks: no beam search, no prompt
        longer than ``max_out_tokens``."""
        config = kwargs.get("generation_config")
        if kwargs.get("num_beams", getattr(config, "num_beams", 1)) > 1:
            raise NotImplementedError("DeepSpeed does not support `num_beams` > 1")
        ids = kwargs.get("input_ids")
        if ids is not None and ids.dim() == 2 and ids.shape[-1] > self._config["max_out_tokens"]:
            raise RuntimeError(
                f"Input with size {ids.shape[-1]} exceeds maximum length of "
                f"{self._config['max_out_tokens']}. Please increase max_tokens in the DeepSpeed "
                "Inference Config."
            )
        return self.module.generate(*inputs, **kwargs)

    def compile(self, backend: str = "inductor", compile_kwargs: dict | None = None) -> None:
        """``torch.compile`` the module (once)."""
        if not self._is_compiled:
            self.module.compile(backend=backend, **(compile_kwargs or {}))
            self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._is_compiled


def init_inference(model: nn.Module, config=None, **kwargs) -> InferenceEngine:
    """DeepSpeed's: ``config`` (a dict or a JSON file's path) and keyword settings merged, a
    key in both with two values refused (see the module for each setting)."""
    if config is None:
        config = {}
    if isinstance(config, str):
        import json

        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"'config' argument expected string or dictionary, got {type(config)}")
    for key in set(config) & set(kwargs):
        if config[key] != kwargs[key]:
            raise ValueError(
                f"Conflicting argument '{key}' in 'config':{config[key]} and kwargs:{kwargs[key]}"
            )
    return InferenceEngine(model, {**config, **kwargs})
