"""What the golden scripts share: their JSON written to ``--write``'s path, else printed."""

from __future__ import annotations

import json


def emit(out: dict, path: str | None) -> int:
    """Write ``out`` as indented JSON to ``path`` (print it when None); the exit status."""
    text = json.dumps(out, indent=1)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0
