"""Source files over 400 lines and classes over 250: a signal for review, not a gate.

    python scripts/sizes.py        # one line each, longest first; exit status 0 whatever it finds

A size past its bound asks the reviewer whether the file or class holds more than one concept
(split where the responsibilities part), never to pack lines until it fits. ``.ci/run`` prints
this report at its end.
"""

from __future__ import annotations

import argparse
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILE_LINES, CLASS_LINES = 400, 250


def sizes(package: str = os.path.join(ROOT, "src", "zerostack")) -> dict[str, int]:
    """Lines of every source file of ``package`` over FILE_LINES and of every class over
    CLASS_LINES (``path`` or ``path:Class``, relative to the package's parent)."""
    out = {}
    base = os.path.dirname(package)
    for folder, _, files in os.walk(package):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(folder, f)
            name = os.path.relpath(path, base).replace(os.sep, "/")
            text = open(path).read()
            if len(text.splitlines()) > FILE_LINES:
                out[name] = len(text.splitlines())
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ClassDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > CLASS_LINES:
                        out[f"{name}:{node.name}"] = lines
    return out


def report(found: dict[str, int]) -> str:
    bounds = f"{FILE_LINES} a file, {CLASS_LINES} a class"
    head = f"sizes: {len(found)} over the review bounds ({bounds})"
    rows = [f"  {n:5d}  {name}" for name, n in sorted(found.items(), key=lambda kv: -kv[1])]
    return "\n".join([head, *rows])


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print(report(sizes()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
