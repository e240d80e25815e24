"""Run the user's program with DeepSpeed's ``--local_rank=N`` argument, then get out of the way.

torchrun gives each worker its local rank only as ``LOCAL_RANK``; DeepSpeed's launcher also
passes ``--local_rank=N`` right after the script, and many DeepSpeed scripts parse it. torchrun
starts this file (plain Python, no imports beyond the standard library, so it costs a blink),
which replaces itself with the user's program: same process, so torchrun watches the real one.

    python local_rank.py [--module | --no_python] SCRIPT [ARGS...]
"""

import os
import sys


def main(argv: list[str]) -> None:
    mode = argv.pop(0) if argv and argv[0] in ("--module", "--no_python") else ""
    if not argv:
        sys.exit("local_rank.py: no program to run")
    script, args = argv[0], argv[1:]
    local_rank = f"--local_rank={os.environ.get('LOCAL_RANK', '0')}"
    if mode == "--no_python":
        cmd = [script, local_rank, *args]
    else:
        cmd = [sys.executable, "-u", *(["-m"] if mode == "--module" else []), script]
        cmd += [local_rank, *args]
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
