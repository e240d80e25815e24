"""DeepSpeed's public Python API against zerostack (zerostack.compat.deepspeed._api): every name
the table says works, or has under another name, resolves in zerostack; every name it says is not
supported does not; the reference page's table is the generated one. That every DeepSpeed name
in the table exists in DeepSpeed 0.19.8 is checked where DeepSpeed is installed (not in CI):
``python scripts/api_table.py --deepspeed`` in DeepSpeed's environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import zerostack
from zerostack.compat.deepspeed._api import (
    DEEPSPEED_API,
    DIFFERENT,
    ENGINE,
    PIPE_ENGINE,
    UNSUPPORTED,
    WORKS,
    entries,
    zerostack_name,
)
from zerostack.compat.deepspeed.runtime.engine import DeepSpeedEngine
from zerostack.engine import Engine
from zerostack.pipeline import PipelineEngine

from tests.support.models import tiny_gpt
from tests.support.ranks import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import api_table  # noqa: E402
from _pages import between  # noqa: E402

ENTRIES = entries()
MODULE_NAMES = {n: e for n, e in ENTRIES.items() if n.startswith("deepspeed")}
ENGINE_NAMES = {n: e for n, e in ENTRIES.items() if n.startswith(f"{ENGINE}.")}
PIPE_NAMES = {n: e for n, e in ENTRIES.items() if n.startswith(f"{PIPE_ENGINE}.")}


resolve = api_table.resolve


def _attr(name: str) -> str:
    return name.split(".", 1)[1]


def test_the_inventory_is_well_formed():
    assert len(ENTRIES) == sum(len(s) for s in DEEPSPEED_API.values())  # no name twice
    assert set(ENTRIES) == set(MODULE_NAMES) | set(ENGINE_NAMES) | set(PIPE_NAMES)
    assert {e.status for e in ENTRIES.values()} == {WORKS, DIFFERENT, UNSUPPORTED}
    for name, e in ENTRIES.items():
        assert "\n" not in e.note and "|" not in e.note, name
        if e.status != WORKS:
            assert e.note, f"{name}: {e.status} needs a why"
        else:
            assert e.ours is None, f"{name}: works under another name is 'different'"


def test_names_that_work_or_differ_resolve_and_unsupported_ones_do_not():
    present = [n for n, e in MODULE_NAMES.items() if e.status != UNSUPPORTED]
    absent = [n for n, e in MODULE_NAMES.items() if e.status == UNSUPPORTED]
    assert [n for n in present if not resolve(zerostack_name(n, ENTRIES[n]))] == []
    assert [n for n in absent if resolve(zerostack_name(n, ENTRIES[n]))] == []
    # a pipeline engine is the engine initialize returns (PipelineEngine names it for isinstance)
    assert issubclass(PipelineEngine, Engine)
    assert [n for n, e in PIPE_NAMES.items() if e.status != UNSUPPORTED
            and not hasattr(DeepSpeedEngine, _attr(zerostack_name(n, e)))] == []  # fmt: skip
    assert [n for n, e in PIPE_NAMES.items() if e.status == UNSUPPORTED
            and hasattr(DeepSpeedEngine, _attr(zerostack_name(n, e)))] == []  # fmt: skip


_ATTRIBUTES = """
import json, sys
import zerostack
out = {}
for name in json.loads(sys.argv[1]):
    obj = zerostack
    for attr in name.split(".")[1:]:
        obj = getattr(obj, attr, None)
    out[name] = obj is not None
print(json.dumps(out))
"""


@pytest.mark.slow
def test_names_that_work_are_reached_from_the_package_after_import_zerostack_alone():
    """``import zerostack as deepspeed; deepspeed.zero.Init``: attributes only, in a fresh
    interpreter (other tests import submodules, which makes them attributes here)."""
    names = {n: zerostack_name(n, e) for n, e in MODULE_NAMES.items() if e.status != UNSUPPORTED}
    ran = subprocess.run(
        [sys.executable, "-c", _ATTRIBUTES, json.dumps(sorted(names.values()))],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    reached = json.loads(ran.stdout.splitlines()[-1])
    works = [n for n in names if ENTRIES[n].status == WORKS]
    assert [n for n in works if not reached[names[n]]] == []
    # the table says the pipe names need their own import: true today
    needs_import = [n for n in names if "import zerostack.pipe" in ENTRIES[n].note]
    assert needs_import and [n for n in needs_import if reached[names[n]]] == []


def _engine_attributes(rank, world, names):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=config)
    found = {name: hasattr(engine, name) for name in names}
    engine.destroy()
    return found


@pytest.mark.distributed
def test_engine_methods_and_attributes_on_a_real_engine():
    """Instance attributes (``global_steps``, ``module``, ...) exist only on a built engine."""
    attrs = {n: _attr(zerostack_name(n, e)) for n, e in ENGINE_NAMES.items()}
    (found,) = run_distributed(_engine_attributes, 1, args=(sorted(set(attrs.values())),))
    present = [n for n, e in ENGINE_NAMES.items() if e.status != UNSUPPORTED]
    assert [n for n in present if not found[attrs[n]]] == []
    assert [n for n in ENGINE_NAMES if n not in present and found[attrs[n]]] == []


def test_the_reference_table_is_the_generated_one():
    shown = between(api_table.PAGE, api_table.BEGIN, api_table.END)
    assert shown == api_table.table(), "run: python scripts/api_table.py --write"
