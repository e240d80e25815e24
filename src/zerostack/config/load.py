"""Reading a config: a dict, a JSON file or JSON text, with duplicate keys refused."""

import json
import os
from typing import Any

from pydantic import (
    ValidationError,
)

from .base import (
    ConfigError,
    _config_error,
)
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


def load_config(config: Any) -> ZeroStackConfig:
    """Validate ``config``: a dict, a ZeroStackConfig (returned as is), a path to a JSON file
    (str or os.PathLike) or JSON text (a str starting with "{"). Raises only ConfigError."""
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
    try:
        return ZeroStackConfig.model_validate(config)
    except ValidationError as exc:
        raise _config_error(exc) from None


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
