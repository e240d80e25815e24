"""Where the suite's CPU goes: a pytest plugin that charges each test the CPU seconds its process
tree spent while it ran (the test's process, and every rank, server and subprocess below it,
live or already reaped), and prints them per file at the end.

    python -m pytest -n 2 --dist loadfile -p tests.support.suite_cpu

The suite is CPU-bound on this machine (``vmstat`` shows the two cores about 98% busy through a
run), so a file's CPU seconds, not its wall time, are what it costs the whole run: the wall time
of a test depends on what the other worker runs beside it. Read from ``/proc`` (Linux only):
each live process's own and reaped children's user and system time. A process that outlives
its test, or is orphaned, is charged to no test. The rows go to ``$ZEROSTACK_SUITE_CPU``
(default ``suite_cpu.jsonl`` in the temporary folder) as JSON lines.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import Counter

import pytest

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _path() -> str:
    return os.environ.get("ZEROSTACK_SUITE_CPU") or os.path.join(
        tempfile.gettempdir(), "suite_cpu.jsonl"
    )


def tree_cpu(root: int | None = None) -> float:
    """CPU seconds of process ``root`` (this one) and every live process below it, each with
    its reaped children's."""
    children: dict[int, list[int]] = {}
    own: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:  # ended while we looked
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        pid, ppid = int(name), int(fields[1])
        own[pid] = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root if root is not None else os.getpid()]
    while todo:
        pid = todo.pop()
        total += own.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total / _TICK


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = tree_cpu(), time.monotonic()
    yield
    row = {
        "test": item.nodeid,
        "cpu": round(tree_cpu() - cpu, 2),
        "wall": round(time.monotonic() - wall, 2),
    }
    with open(_path(), "a") as f:  # one short line per write: the workers' lines do not mix
        f.write(json.dumps(row) + "\n")


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist)
        open(_path(), "w").close()


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput"):
        return
    cpu: Counter = Counter()
    wall: Counter = Counter()
    with open(_path()) as f:
        for line in f:
            row = json.loads(line)
            path = row["test"].split("::")[0]
            cpu[path] += row["cpu"]
            wall[path] += row["wall"]
    write = terminalreporter.write_line
    write(f"CPU seconds per test file ({_path()}): {sum(cpu.values()):.0f} in all")
    for path, seconds in cpu.most_common(25):
        write(f"{seconds:8.1f} cpu {wall[path]:8.1f} wall  {path}")
