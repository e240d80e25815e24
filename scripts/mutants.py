"""The mutation gate: plant each known bug in a copy of src/ and check that the tests catch it.

    python scripts/mutants.py                # every mutant; ends with "N killed, 0 survived"
    python scripts/mutants.py --check        # seconds: every mutant's text and tests still exist
    python scripts/mutants.py --budget 1500  # as many as 1500 s allow, from a rotation set by
                                             # the commit, so successive commits cover others
    python scripts/mutants.py --changed REV  # every mutant whose file or tests changed since REV
    python scripts/mutants.py --list         # the mutants and the tests meant to catch each
    python scripts/mutants.py -k norm        # only mutants whose name contains "norm"
    python scripts/mutants.py --baseline     # first check those tests pass on the real source

A mutant is one exact text replacement in one file under src/zerostack (the text must occur
exactly once, so a refactor that moves it makes the gate fail loudly instead of testing nothing).
The copy is put first on PYTHONPATH, so the test processes (forkserver ranks, torchrun workers)
import the mutated package. A mutant is killed when its tests fail; it survives when they pass.
Exit status: 0 when every mutant run is killed, 1 otherwise (a survivor fails every mode).

This file is the runner; the mutants are data, in tests/mutants/: a registry per top-level
package of src/zerostack (tests/mutants/zero.py for zero/, root.py for the modules at its root),
each test written out as its full pytest id. To add one, append a Mutant to the registry of its
file's package, then `--check -k NAME` (its text occurs once, its tests exist) and `-k NAME`
(its tests kill it). Every new feature adds the bugs its tests exist to catch there, and the
gate stays at 0 survivors.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # tests.mutants, wherever this is run from

from tests.mutants import MUTANTS, Mutant  # noqa: E402


def stale(mutants: list[Mutant], src: str = os.path.join(ROOT, "src")) -> list[str]:
    """Mutants whose text does not occur exactly once in their file, that change nothing, or
    that leave the file no longer Python (any import fails then: killed, but it tests nothing)."""
    problems = []
    for m in mutants:
        path = os.path.join(src, "zerostack", m.file)
        text = open(path).read() if os.path.exists(path) else ""
        count = text.count(m.old)
        if count != 1:
            problems.append(f"mutant {m.name!r}: {m.file} holds its text {count} times, not once")
        if m.new == m.old:
            problems.append(f"mutant {m.name!r}: its replacement is its text")
        if count == 1:
            try:
                compile(text.replace(m.old, m.new), path, "exec")
            except SyntaxError as exc:
                problems.append(f"mutant {m.name!r}: leaves {m.file} unparsable ({exc.msg})")
    return problems


def missing_tests(mutants: list[Mutant]) -> list[str]:
    """Test ids named by the mutants that pytest does not collect (one collection of them all)."""
    targets = sorted({t for m in mutants for t in m.tests})
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd + targets, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        return []
    out = proc.stdout + proc.stderr
    named = [  # pytest names them by absolute path
        os.path.relpath(t.split("::")[0], ROOT) + t[len(t.split("::")[0]) :]
        for t in re.findall(r"^ERROR: not found: (\S+)", out, re.M)
    ]
    return [f"test {t}: not collected" for t in named] or [out[-2000:]]


def _read(src: str, m: Mutant) -> str:
    problems = stale([m], src)
    if problems:
        raise SystemExit(problems[0])
    return open(os.path.join(src, "zerostack", m.file)).read()


def _apply(src: str, m: Mutant) -> None:
    text = _read(src, m)
    with open(os.path.join(src, "zerostack", m.file), "w") as f:
        f.write(text.replace(m.old, m.new))


def _git(*args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def rotation(count: int, commit: str = "HEAD") -> int:
    """Where a budgeted run starts: the commit's hash modulo the number of mutants, moved half
    way round where that is where the commit's first parent started, so two commits in a row
    never start at the same mutant (the chain is followed from the first commit)."""
    r = None
    for sha in _git("rev-list", "--first-parent", "--reverse", commit).split():
        raw = int(sha, 16) % count
        r = (raw + count // 2) % count if raw == r else raw
    return r if r is not None else 0


def _uses(text: str, path: str, helper: str) -> bool:
    """Whether the file at ``path`` (its ``text``) imports the helper module at ``helper``
    (``tests/support/census.py``: ``tests.support.census``, ``from tests.support import census``
    or, beside it, ``from .census import``) or runs it as a script (``resume_job.py``)."""
    dotted = helper[:-3].replace("/", ".")
    parent, name = dotted.rsplit(".", 1)
    patterns = [
        rf"\b{re.escape(dotted)}\b",
        rf"^\s*from {re.escape(parent)} import [^\n]*\b{name}\b",
        rf"\b{name}\.py\b",
    ]
    if os.path.dirname(path) == os.path.dirname(helper):
        patterns.append(rf"^\s*from \.(?:{name}\b| import [^\n]*\b{name}\b)")
    return any(re.search(p, text, re.M) for p in patterns)


def _importers(helpers: set[str]) -> set[str]:
    """Test files that import any of the helper modules under tests/ (``tests/support/``,
    ``tests/jobs/``) or run one as a script, directly or through another helper."""
    texts = {}
    for folder, dirs, files in os.walk(os.path.join(ROOT, "tests")):
        dirs[:] = [d for d in dirs if d not in ("mutants", "__pycache__", "golden", "fixtures")]
        for f in files:
            if f.endswith(".py"):
                path = os.path.relpath(os.path.join(folder, f), ROOT).replace(os.sep, "/")
                texts[path] = open(os.path.join(folder, f)).read()
    found, todo = set(), set(helpers)
    while todo:
        new = {
            f
            for f, text in texts.items()
            if f not in found and any(_uses(text, f, h) for h in todo)
        }
        found |= new
        todo = {f for f in new if not os.path.basename(f).startswith("test_")}
    return found


def changed_since(rev: str, mutants: list[Mutant]) -> list[Mutant]:
    """Mutants whose source file or whose tests differ between ``rev`` and the working tree
    (committed or not): a test edited, or a helper it imports (``tests/support/census.py``),
    can let a mutant through as surely as the source can."""
    files = set(_git("diff", "--name-only", rev, "--", "src/zerostack", "tests").splitlines())
    files |= set(_git("ls-files", "--others", "--exclude-standard", "src", "tests").splitlines())
    # a helper is a module the tests import; the registries (tests/mutants/) are not one
    helpers = {
        f
        for f in files
        if f.startswith("tests/")
        and f.endswith(".py")
        and not os.path.basename(f).startswith(("test_", "conftest"))
        and not f.startswith("tests/mutants/")
    }
    files |= _importers(helpers)
    return [
        m
        for m in mutants
        if f"src/zerostack/{m.file}" in files or any(t.split("::")[0] in files for t in m.tests)
    ]


def _pytest(tests: tuple[str, ...], pythonpath: str | None, timeout: int) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
    cmd += [f"--timeout={timeout}", *tests]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def _killer(code: int, output: str) -> str | None:
    """The test that failed (pytest's FAILED or ERROR line), ``signal N`` where pytest itself was
    killed, or None: the tests did not run (no interpreter, a broken environment), which is no
    kill."""
    found = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    if found and code in (1, 2):
        return found.group(1)
    # a test named inside a module the mutant broke: the module's import fails (its ERROR
    # line), and pytest then finds no test by that name (a usage error, 4)
    if found and code == 4 and "::" not in found.group(1) and "found no collectors" in output:
        return found.group(1)
    return f"signal {-code}" if code < 0 else None


def run(mutants: list[Mutant], timeout: int, verbose: bool, budget: float | None) -> tuple:
    """Plant and test each mutant in turn; with a ``budget`` (seconds), start none after it is
    spent. Returns (killed, survived names, how many ran)."""
    killed, survived, ran = 0, [], 0
    width = max((len(m.name) for m in mutants), default=0)
    began = time.monotonic()
    for m in mutants:
        if budget is not None and time.monotonic() - began >= budget:
            break
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="zs-mutant-") as tmp:
            src = os.path.join(tmp, "src")
            shutil.copytree(os.path.join(ROOT, "src"), src)
            _apply(src, m)
            code, out = _pytest(m.tests, src, timeout)
        took = time.monotonic() - t0
        ran += 1
        if code == 5 or "no tests ran" in out:
            raise SystemExit(f"mutant {m.name!r}: its tests {m.tests} select nothing")
        if code == 0:
            survived.append(m.name)
            print(f"SURVIVED  {m.name:<{width}}  ({took:.0f}s)", flush=True)
            continue
        by = _killer(code, out)
        if by is None:  # counted with the survivors: the gate fails
            survived.append(m.name)
            tail = "\n".join(out.splitlines()[-5:])
            print(f"NOT RUN   {m.name:<{width}}  pytest exit {code}:\n{tail}", flush=True)
        else:
            killed += 1
            print(f"killed    {m.name:<{width}}  by {by}  ({took:.0f}s)", flush=True)
            if verbose:
                lines = [ln for ln in out.splitlines() if re.match(r"^E\s", ln)]
                print("\n".join("          " + ln for ln in lines[-6:]), flush=True)
    return killed, survived, ran


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-k", default="", help="only mutants whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument("--check", action="store_true", help="check texts and test ids, run none")
    parser.add_argument("--budget", type=float, help="seconds; start no mutant after they pass")
    parser.add_argument("--rotation", type=int, help="with --budget: start here, not at the "
                        "commit's rotation (to repeat a CI run)")  # fmt: skip
    parser.add_argument("--changed", metavar="REV", help="only mutants whose file or tests "
                        "changed since REV")  # fmt: skip
    parser.add_argument("--baseline", action="store_true", help="run the tests unmutated first")
    parser.add_argument("--timeout", type=int, default=300, help="per test, seconds")
    parser.add_argument("-v", "--verbose", action="store_true", help="show how each test failed")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if args.k in m.name]
    if args.changed:
        chosen = changed_since(args.changed, chosen)
    if args.list:
        for m in chosen:
            print(f"{m.name}\n    {m.file}: {m.old!r} -> {m.new!r}\n    " + " ".join(m.tests))
        return 0
    problems = stale(chosen)  # fail fast on a stale mutant, before any test runs
    if args.check:
        problems += missing_tests(chosen)
        for line in problems:
            print(line)
        tests = len({t for m in chosen for t in m.tests})
        verdict = f"{len(problems)} problems" if problems else "all present"
        print(f"check: {len(chosen)} mutants, {tests} test targets: {verdict}")
        return 1 if problems else 0
    if problems:
        raise SystemExit("\n".join(problems))
    if args.baseline:
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        code, out = _pytest(tests, None, args.timeout)
        if code != 0:
            print(out[-3000:])
            print("baseline: the tests fail on the unmutated source; fix that first")
            return 1
        print(f"baseline: {len(tests)} test targets pass on the unmutated source")
    tail = ""
    if args.budget is not None:
        r = args.rotation if args.rotation is not None else rotation(len(chosen))
        r %= max(len(chosen), 1)
        chosen = chosen[r:] + chosen[:r]
        print(f"rotation {r}: starting at {chosen[0].name!r}, {args.budget:.0f} s", flush=True)
    elif args.changed:
        print(f"{len(chosen)} mutants whose file or tests changed since {args.changed}")
    killed, survived, ran = run(chosen, args.timeout, args.verbose, args.budget)
    if args.budget is not None:
        tail = f" ({ran} of {len(chosen)} run, rotation {r})"
    print(f"{killed} killed, {len(survived)} survived{tail}")
    return 0 if not survived else 1


if __name__ == "__main__":
    sys.exit(main())
