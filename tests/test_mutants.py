"""The mutation gate's own checks, in the suite: every mutant still names text that occurs exactly
once in its file, and every test it names exists, so a refactor that moves either fails here, in
seconds, rather than at the end of the gate. ``scripts/mutants.py --check`` runs the same two
functions; the planted cases below show they fail when they should."""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import mutants  # noqa: E402


def test_every_mutant_names_text_that_occurs_once():
    assert mutants.stale(mutants.MUTANTS) == []


@pytest.mark.slow
def test_every_mutant_names_tests_that_exist():
    assert mutants.missing_tests(mutants.MUTANTS) == []


def test_a_mutant_whose_text_was_edited_away_is_named(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "src"), src)
    m = mutants.MUTANTS[0]
    other = next(o for o in mutants.MUTANTS if o.file != m.file)  # its text still there
    path = src / "zerostack" / m.file
    half = len(m.old) // 2
    path.write_text(path.read_text().replace(m.old, m.old[:half] + "#" + m.old[half:]))
    twice = dataclasses.replace(m, name="twice", old="\n")
    same = dataclasses.replace(other, name="same", new=other.old)
    broken = dataclasses.replace(other, name="broken", new=other.old + "\n  (")
    *found, unparsable = mutants.stale([m, twice, same, broken], str(src))
    assert found == [
        f"mutant {m.name!r}: {m.file} holds its text 0 times, not once",
        f"mutant 'twice': {m.file} holds its text {path.read_text().count(chr(10))} times, "
        "not once",
        "mutant 'same': its replacement is its text",
    ]
    assert unparsable.startswith(f"mutant 'broken': leaves {other.file} unparsable ("), unparsable


def test_a_test_id_that_does_not_exist_is_named():
    real = mutants.MUTANTS[0]
    gone = f"{real.tests[0].split('::')[0]}::test_that_was_renamed"
    planted = dataclasses.replace(real, tests=(real.tests[0], gone))
    assert mutants.missing_tests([planted]) == [f"test {gone}: not collected"]


def test_consecutive_commits_start_the_budgeted_gate_at_different_mutants():
    # with 2 or 3 mutants half the hashes would collide: the rotation moves those on
    for count in (2, 3, len(mutants.MUTANTS)):
        starts = [mutants.rotation(count, f"HEAD~{k}") for k in range(6)]
        assert all(0 <= r < count for r in starts), starts
        assert all(a != b for a, b in itertools.pairwise(starts)), (count, starts)


def test_a_spent_budget_starts_nothing_and_says_where_it_began():
    cmd = [sys.executable, "scripts/mutants.py", "--budget", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = mutants.rotation(len(mutants.MUTANTS))
    lines = proc.stdout.splitlines()
    assert lines[0] == f"rotation {r}: starting at {mutants.MUTANTS[r].name!r}, 0 s"
    assert lines[-1] == f"0 killed, 0 survived (0 of {len(mutants.MUTANTS)} run, rotation {r})"


def test_a_changed_helper_selects_the_tests_that_use_it():
    """``--changed``: a helper under tests/support/ or tests/jobs/ counts as a change to every
    test that imports it (by its full name, from its package, or beside it) or runs it, and
    through another helper."""
    census = mutants._importers({"tests/support/census.py"})
    assert {"tests/test_memory.py", "tests/test_moe.py"} <= census
    assert "tests/test_parity.py" not in census
    jobs = mutants._importers({"tests/jobs/resume_job.py"})
    assert "tests/test_auto_resume.py" in jobs
    models = mutants._importers({"tests/support/models.py"})
    assert {"tests/support/parity.py", "tests/test_parity.py"} <= models  # through parity.py


def test_only_a_failing_test_or_a_killed_pytest_counts_as_a_kill():
    """A mutant is killed when one of its tests fails (or pytest dies of a signal); tests that
    never ran (no interpreter, a broken environment, a usage error) kill nothing, but a test
    module that the mutant keeps from importing does."""
    failed = "FAILED tests/test_x.py::test_y - AssertionError\n1 failed in 2.0s"
    assert mutants._killer(1, failed) == "tests/test_x.py::test_y"
    assert mutants._killer(2, "ERROR tests/test_x.py - ImportError\n") == "tests/test_x.py"
    assert mutants._killer(-9, "") == "signal 9"
    assert mutants._killer(1, "Fatal Python error: init_fs_encoding\n") is None
    assert mutants._killer(4, "ERROR: file or directory not found: tests/x.py\n") is None
    broken = "ERROR tests/test_x.py - AttributeError: no name\nERROR: found no collectors for x"
    assert mutants._killer(4, broken) == "tests/test_x.py"  # the mutant broke its import
    assert mutants._killer(4, "ERROR tests/test_x.py::test_y - x\nfound no collectors") is None
    assert mutants._killer(3, "INTERNALERROR> OSError\nFAILED x\n") is None
