"""The mutation gate's own check, in the suite: every mutant still names text that occurs exactly
once in its file, and every test it names exists, so a refactor that moves either fails here, in
seconds, rather than at the end of the gate."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import mutants  # noqa: E402


def test_every_mutant_names_text_that_occurs_once():
    src = os.path.join(ROOT, "src")
    for m in mutants.MUTANTS:
        text = open(os.path.join(src, "zerostack", m.file)).read()
        assert text.count(m.old) == 1, f"{m.name}: {m.file} holds its text {text.count(m.old)}x"
        assert m.new != m.old, m.name


def test_every_mutant_names_tests_that_exist():
    targets = sorted({t for m in mutants.MUTANTS for t in m.tests})
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd + targets, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
