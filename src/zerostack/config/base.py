"""The config's building blocks: ConfigError and its one-line messages, the value types,
and the strict model every block derives from."""

import difflib
import math
from typing import Annotated, Any, ClassVar, Literal, NoReturn

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

DEFAULT_BUCKET_NUMEL = 4_000_000
"""Gradient bucket size when ``reduce_bucket_size`` is not given (torch DDP uses 25 MB)."""
SUPPORTED_ZERO_STAGES: frozenset[int] = frozenset({0, 1, 2, 3})
"""ZeRO stages this version implements; widen as stages land (checked in `_check_implemented`)."""

_SUPPORTED_OFFLOAD_DEVICES = frozenset({"none", "cpu", "nvme"})


class ConfigError(ValueError):
    """A bad config. The message is one line: ``"<dotted.key.path>: <what is wrong>"``."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).splitlines()))


# --- error plumbing -------------------------------------------------------------------------


def _fail(msg: str, *paths: str) -> NoReturn:
    """Fail validation; ``paths`` name the keys at fault, relative to the model being validated."""
    raise PydanticCustomError("zerostack", "{msg}", {"msg": msg, "paths": paths})


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _dotted(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _describe(err: Any) -> str:
    where, kind, ctx = _dotted(err["loc"]), err["type"], err.get("ctx") or {}
    if kind == "zerostack":
        paths = ctx.get("paths") or ("",)
        where = ", ".join(".".join(p for p in (where, rel) if p) for rel in paths)
        msg = ctx["msg"]
    elif kind == "missing":
        msg = "required key is missing"
    elif kind == "extra_forbidden":
        msg = "unknown key"
    elif kind in ("model_type", "model_attributes_type", "dict_type"):
        msg = f"must be a JSON object (got {_show(err['input'])})"
    else:
        msg = err["msg"].removeprefix("Value error, ").replace("Input should be", "must be", 1)
        msg = f"{msg} (got {_show(err['input'])})"
    return f"{where or 'config'}: {msg}"


def _config_error(exc: ValidationError) -> ConfigError:
    return ConfigError("; ".join(_describe(e) for e in exc.errors()))


# --- value types ----------------------------------------------------------------------------


def _integral(v: Any) -> Any:
    # DeepSpeed configs write sizes as 5e8: accept integral floats, reject 2.5.
    if isinstance(v, float):
        if not v.is_integer():
            _fail(f"must be an integer (got {v!r})")
        return int(v)
    return v


def _auto_is_none(v: Any) -> Any:
    # HF Trainer writes "auto" for values it fills in itself; here it means "not given".
    return None if v == "auto" else v


def _list_to_tuple(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


Int = Annotated[int, BeforeValidator(_integral)]


def _stage_or_auto(v: Any) -> Any:
    # "auto" passes as itself; anything else must be a whole number (one clean error, not a
    # union's two).
    if v == "auto":
        return v
    v = _integral(v)
    if isinstance(v, bool) or not isinstance(v, int):
        _fail(f"must be a valid integer or 'auto' (got {v!r})")
    return v


StageOrAuto = Annotated[int | str, BeforeValidator(_stage_or_auto)]


def _every_or_never(v: Any) -> Any:
    # Accelerate always sets steps_per_print to float("inf"): never, None here (one clean
    # error for anything else, not a union's two)
    if isinstance(v, float) and v == math.inf:
        return None
    v = _integral(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        _fail(f"must be a positive integer or inf (got {v!r})")
    return v


EveryOrNever = Annotated[int | None, BeforeValidator(_every_or_never)]
PositiveInt = Annotated[Int, Field(gt=0)]
NonNegInt = Annotated[Int, Field(ge=0)]
BatchSize = Annotated[PositiveInt | None, BeforeValidator(_auto_is_none)]
NonNegFloat = Annotated[float, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Ratio = Annotated[float, Field(ge=0, le=1)]
Beta = Annotated[float, Field(ge=0, lt=1)]
WarmupType = Literal["log", "linear"]


def _aliases(default: Any, *names: str) -> Any:
    return Field(default, validation_alias=AliasChoices(*names))


class _Model(BaseModel):
    _ALSO_KNOWN: ClassVar[tuple[str, ...]] = ()
    """Keys without a field that a misspelling may be suggested as."""

    # Strict: JSON is typed, so "16" for an int or 1 for a bool is a mistake, not a value.
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        populate_by_name=True,
        use_attribute_docstrings=True,
        allow_inf_nan=False,
    )

    @model_validator(mode="before")
    @classmethod
    def _canonical_keys(cls, data: Any) -> Any:
        """Rename alias keys to the canonical name; report unknown keys with a suggestion."""
        if not isinstance(data, dict):
            return data
        canonical: dict[str, str] = {}
        for name, field in cls.model_fields.items():
            canonical[name] = name
            if isinstance(field.validation_alias, AliasChoices):
                canonical.update(
                    (a, name) for a in field.validation_alias.choices if isinstance(a, str)
                )
        out: dict[str, Any] = {}
        seen_as: dict[str, str] = {}
        errors: list[InitErrorDetails] = []
        for key, value in data.items():
            name = canonical.get(key) if isinstance(key, str) else None
            if name is None:
                close = difflib.get_close_matches(str(key), [*canonical, *cls._ALSO_KNOWN], n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                msg = f"unknown key{hint}"
                loc = (str(key),)
            elif name in out:
                msg, loc = f"given twice (as {seen_as[name]!r} and {key!r})", (name,)
            else:
                out[name], seen_as[name] = value, key
                continue
            err = PydanticCustomError("zerostack", "{msg}", {"msg": msg, "paths": ()})
            errors.append(InitErrorDetails(type=err, loc=loc, input=value))
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return out
