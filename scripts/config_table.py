"""Print the README's table of DeepSpeed's config keys, from zerostack.config_keys.

    python scripts/config_table.py

The README holds this output between its ``config-table`` markers; tests/test_config_keys.py
fails when the two differ, so the table is regenerated, never edited by hand.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

from zerostack.config_keys import (  # noqa: E402
    DEEPSPEED_KEYS,
    DEFAULT_DIFFERENCES,
    NESTED_NO_EFFECT,
)


def table() -> str:
    """The markdown: DeepSpeed's top-level keys, then the keys inside blocks with no effect."""
    lines = [
        "| DeepSpeed key | in zerostack | what it does, or why not |",
        "|---|---|---|",
    ]
    for key in sorted(DEEPSPEED_KEYS):
        entry = DEEPSPEED_KEYS[key]
        lines.append(f"| `{key}` | {entry.status} | {entry.note} |")
    lines += [
        "",
        "Keys inside the blocks above that are accepted with no effect:",
        "",
        "| key | why it has no effect |",
        "|---|---|",
    ]
    lines += [f"| `{path}` | {why} |" for path, why in NESTED_NO_EFFECT.items()]
    lines += [
        "",
        "Defaults are DeepSpeed 0.19.8's (`gradient_clipping` is 1.0), but for these:",
        "",
        "| key | zerostack's default, and why |",
        "|---|---|",
    ]
    lines += [f"| `{key}` | {why} |" for key, why in DEFAULT_DIFFERENCES.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(table())
