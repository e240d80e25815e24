"""Reading a config: a dict, a JSON file or JSON text, with duplicate keys refused."""

import copy
import json
import os
from typing import Any, Literal

from pydantic import (
    ValidationError,
)

from .base import (
    ConfigError,
    _config_error,
)
from .keys import DEEPSPEED_IGNORES_UNKNOWN
from .top import ZeroStackConfig

# --- loading --------------------------------------------------------------------------------


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of duplicated keys silently; DeepSpeed rejects them too.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"config: duplicate key {key!r} in JSON")
        out[key] = value
    return out


def _parse_json(text: str, source: str = "") -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config: not valid JSON{source}: {exc}") from None


def load_config(
    config: Any, *, unknown_keys: Literal["refuse", "as_deepspeed"] = "refuse"
) -> ZeroStackConfig:
    """Validate ``config``: a dict, a ZeroStackConfig (returned as is), a path to a JSON file
    (str or os.PathLike) or JSON text (a str starting with "{"). Raises only ConfigError.

    ``unknown_keys="as_deepspeed"`` (``deepspeed.initialize`` served by zerostack): a key no one
    knows, in a block where DeepSpeed 0.19.8 ignores such keys (the top level, ``optimizer``,
    ``activation_checkpointing``, ...: :data:`~zerostack.config.keys.DEEPSPEED_IGNORES_UNKNOWN`),
    is left out and named in :attr:`ZeroStackConfig.ignored_keys`, for ``initialize`` to warn
    about; where DeepSpeed refuses one (``zero_optimization``, ``fp16``, ...), it is refused
    here too. The default refuses every unknown key."""
    if isinstance(config, ZeroStackConfig):
        return config
    typed = getattr(config, "typed", None)  # engine.config (a ConfigView) is its typed config
    if isinstance(typed, ZeroStackConfig):
        return typed
    if config is None:
        raise ConfigError(
            "config: no config given; pass config=dict, a JSON file path or a JSON string"
        )
    config = read_config(config)
    given = copy.deepcopy(config)
    ignored: list[str] = []
    while True:
        try:
            cfg = ZeroStackConfig.model_validate(config)
            break
        except ValidationError as exc:
            drop = [e["loc"] for e in exc.errors() if unknown_keys != "refuse" and _ignorable(e)]
            if not drop:
                raise _config_error(exc) from None
            config = copy.deepcopy(config) if not ignored else config
            for loc in drop:
                block = config
                for part in loc[:-1]:
                    block = block[part]
                del block[loc[-1]]
                ignored.append(".".join(str(part) for part in loc))
    cfg._ignored = tuple(ignored)
    cfg._source = (given, unknown_keys == "as_deepspeed")
    return cfg


def given_config(cfg: ZeroStackConfig) -> dict:
    """The config as the user gave it (what DeepSpeed keeps as ``ds_config`` in its checkpoint
    files): the dict :func:`load_config` read, else the keys set."""
    if cfg._source[0] is not None:
        return copy.deepcopy(cfg._source[0])
    return cfg.model_dump(mode="json", by_alias=True, exclude_unset=True)


def served_as_deepspeed(cfg: ZeroStackConfig) -> bool:
    """Whether ``deepspeed.initialize`` (zerostack's facade) read this config."""
    return cfg._source[1]


def _ignorable(err: Any) -> bool:
    """Whether a validation error is an unknown key in a block DeepSpeed reads without
    refusing unknown keys."""
    ctx = err.get("ctx") or {}
    unknown = err["type"] == "extra_forbidden" or (
        err["type"] == "zerostack" and str(ctx.get("msg", "")).startswith("unknown key")
    )
    loc = err["loc"]  # an entry of a list (layer_specs[0]) is read as the list's block
    block = ".".join(str(part) for part in loc[:-1] if not isinstance(part, int))
    return unknown and isinstance(loc[-1], str) and block in DEEPSPEED_IGNORES_UNKNOWN


def read_config(config: Any) -> dict:
    """The dict a config stands for, not yet validated: a dict as is, a JSON file's path or JSON
    text parsed (duplicate keys refused). Raises only ConfigError."""
    if isinstance(config, str) and config.lstrip().startswith(("{", "[")):
        config = _parse_json(config)
    elif isinstance(config, str | os.PathLike):
        path = os.fsdecode(config)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise ConfigError(f"config: file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config: cannot read {path}: {exc}") from None
        config = _parse_json(text, f" in {path}")
    if not isinstance(config, dict):
        raise ConfigError(f"config: must be a JSON object (a dict), got {type(config).__name__}")
    return config
