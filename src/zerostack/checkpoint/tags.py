"""The tags of a ``save_dir``: which are complete, and removing all but the newest
(``checkpoint.keep_last``), for the engine's saves and the background ones alike."""

from __future__ import annotations

import os
import re
import shutil

from .state import LATEST, MANIFEST

_STEP_TAG = re.compile(r"global_step(\d+)")


def prune(save_dir: str, keep_last: int) -> list[str]:
    """Remove all but the newest ``keep_last`` complete ``global_step<N>`` tags of ``save_dir``,
    never the tag ``latest`` names; returns the tags removed (call it on one rank)."""
    latest_path = os.path.join(save_dir, LATEST)
    latest = open(latest_path).read().strip() if os.path.isfile(latest_path) else None
    tags = []
    for name in os.listdir(save_dir):
        m = _STEP_TAG.fullmatch(name)
        if m and os.path.isfile(os.path.join(save_dir, name, MANIFEST)):
            tags.append((int(m.group(1)), name))
    tags.sort()
    removed = []
    for _, tag in tags[: max(0, len(tags) - keep_last)]:
        if tag == latest:
            continue
        doomed = os.path.join(save_dir, f".{tag}.deleting")
        os.replace(os.path.join(save_dir, tag), doomed)  # no longer a checkpoint, at once
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(tag)
    return removed
