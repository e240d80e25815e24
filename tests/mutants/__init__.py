"""The mutation gate's mutants, as data: the bugs the tests exist to catch.

A mutant is one exact text replacement in one file under src/zerostack: ``old`` must occur in
``file`` exactly once (so a refactor that moves it fails the gate loudly instead of testing
nothing), and with ``new`` planted in its place at least one of ``tests`` must fail.
``scripts/mutants.py`` plants them one at a time and runs their tests.

Each top-level package of src/zerostack with mutants has a registry here named after it
(``zero.py`` holds the mutants of ``zero/``), and ``root.py`` holds those of the modules at the
root of src/zerostack. ``MUTANTS`` is the registries one after another, in the order below.

To add a mutant, append a ``Mutant`` to the registry of its file's package (a new package gets a
new module here, imported and listed below): the text as it occurs in the source, its
replacement, and the pytest ids meant to catch it written out in full. Then
``python scripts/mutants.py --check -k NAME`` proves the text occurs once and the tests exist,
and ``python scripts/mutants.py -k NAME`` shows the tests kill it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # under src/zerostack
    old: str
    new: str
    tests: tuple[str, ...]


# The registries import Mutant from here, so they are imported after it.
from . import (  # noqa: E402
    activation_checkpointing,
    checkpoint,
    comm,
    compat,
    config,
    core,
    data,
    engine,
    estimate,
    integrations,
    launcher,
    models,
    moe,
    monitor,
    optim,
    pipeline,
    plan,
    profiling,
    root,
    sequence,
    tensor_parallel,
    watchdog,
    zero,
)

MUTANTS: list[Mutant] = [
    *activation_checkpointing.MUTANTS,
    *checkpoint.MUTANTS,
    *comm.MUTANTS,
    *compat.MUTANTS,
    *config.MUTANTS,
    *core.MUTANTS,
    *data.MUTANTS,
    *engine.MUTANTS,
    *estimate.MUTANTS,
    *integrations.MUTANTS,
    *launcher.MUTANTS,
    *models.MUTANTS,
    *moe.MUTANTS,
    *monitor.MUTANTS,
    *optim.MUTANTS,
    *pipeline.MUTANTS,
    *plan.MUTANTS,
    *profiling.MUTANTS,
    *root.MUTANTS,
    *sequence.MUTANTS,
    *tensor_parallel.MUTANTS,
    *watchdog.MUTANTS,
    *zero.MUTANTS,
]
