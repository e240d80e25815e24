"""zerostack's config defaults are DeepSpeed 0.19.8's, key by key, but for the differences
``zerostack.config.keys.DEFAULT_DIFFERENCES`` names with their reasons
(docs/reference/config-keys.md lists them).

DeepSpeed's defaults are recorded from its own objects in tests/golden/deepspeed_defaults.json
(``scripts/deepspeed_defaults.py``, run once where DeepSpeed is installed; the command is in the
file). zerostack's come from its typed config: every field of every block, walked through the
pydantic models (each optimizer's and scheduler's ``params`` class on its own). A config that
omits a key then trains the same under both (``gradient_clipping`` was 0 here and 1.0 there).
"""

from __future__ import annotations

import json
import os
import types
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from zerostack.config import ZeroStackConfig
from zerostack.config.keys import DEFAULT_DIFFERENCES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = json.load(open(os.path.join(ROOT, "tests", "golden", "deepspeed_defaults.json")))
REQUIRED = "required"

# DeepSpeed's scheduler classes differ from each other in one default (its WarmupDecayLR keeps
# warmup_max_lr=0.001 where WarmupLR takes the optimizer's lr); the recorded value is WarmupLR's.
# Its optimizers too: the recorded lr and eps are FusedAdam's, and the golden's source notes
# Adagrad's (torch's and DeepSpeedCPUAdagrad's), checked here against it. Muon's are
# MuonWithAuxAdam's group defaults, recorded in tests/golden/muon.json and held to MuonParams by
# tests/test_muon.py (its lr: none, each half's own unless the config gives one).
PER_CLASS = {
    ("scheduler.params.warmup_max_lr", "WarmupDecayLRParams"): 0.001,
    ("optimizer.params.lr", "AdagradParams"): 0.01,
    ("optimizer.params.eps", "AdagradParams"): 1e-10,
    ("optimizer.params.lr", "MuonParams"): None,
    ("optimizer.params.betas", "MuonParams"): [0.9, 0.95],
    ("optimizer.params.eps", "MuonParams"): 1e-10,
    ("optimizer.params.momentum", "MuonParams"): 0.95,
}


def test_adagrads_own_defaults_are_the_ones_deepspeed_notes():
    for (key, cls), value in PER_CLASS.items():
        if cls == "AdagradParams":
            source = GOLDEN["defaults"][key]["source"]
            assert f"(Adagrad: {value!r}; DeepSpeedCPUAdagrad: {value!r})" in source, source


def _models(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation names (through Optional, unions and Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) is typing.Annotated:
        return _models(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models(arg)]
    return []


def _default(field):
    if field.default_factory is not None:
        return field.default_factory()
    return REQUIRED if field.default is PydanticUndefined else field.default


def zerostack_defaults(model=ZeroStackConfig, prefix="") -> dict[str, dict[str, object]]:
    """Dotted key (DeepSpeed's names) -> {model class name: default} for every leaf field."""
    out: dict[str, dict[str, object]] = {}
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        key = prefix + (field.alias or name)
        inner = _models(field.annotation)
        if not inner:
            out.setdefault(key, {})[model.__name__] = _default(field)
        for sub in inner:
            for k, by_class in zerostack_defaults(sub, key + ".").items():
                out.setdefault(k, {}).update(by_class)
    return out


def _same(ours, theirs) -> bool:
    if ours == REQUIRED:
        return theirs is None  # DeepSpeed's "required, no default" is recorded as null
    if isinstance(ours, tuple):
        ours = list(ours)
    if theirs == "inf":
        theirs = float("inf")
    return ours == theirs


def differences() -> dict[str, tuple[object, object]]:
    """Keys whose zerostack default is not DeepSpeed's: key -> (zerostack's, DeepSpeed's)."""
    ours = zerostack_defaults()
    out = {}
    for key, rec in GOLDEN["defaults"].items():
        if rec.get("deepspeed") == "absent":
            continue
        for cls, value in ours[key].items():
            want = PER_CLASS.get((key, cls), rec["value"])
            if not _same(value, want):
                out[key] = (value, rec["value"])
    return out


def test_the_golden_defaults_are_deepspeeds_and_cover_every_key():
    assert GOLDEN["deepspeed_version"] == "0.19.8"
    assert GOLDEN["command"].startswith("DS_ACCELERATOR=cpu .peers/bin/python scripts/")
    assert set(GOLDEN["defaults"]) == set(zerostack_defaults())
    assert GOLDEN["defaults"]["gradient_clipping"]["value"] == 1.0


def test_defaults_equal_deepspeeds_but_the_named_differences():
    found = differences()
    assert set(found) == set(DEFAULT_DIFFERENCES), found
    for key, (ours, theirs) in found.items():
        assert DEFAULT_DIFFERENCES[key].startswith(f"{ours!r} (DeepSpeed {theirs!r})"), key


def test_a_config_that_omits_gradient_clipping_clips_at_one():
    assert ZeroStackConfig().gradient_clipping == 1.0
