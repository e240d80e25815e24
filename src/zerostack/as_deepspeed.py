"""Run an unmodified DeepSpeed script on zerostack.

    python -m zerostack.as_deepspeed train.py [ARGS]
    python -m zerostack.as_deepspeed -m package.module [ARGS]
    torchrun --nproc_per_node 2 -m zerostack.as_deepspeed train.py --deepspeed ds.json
    accelerate launch -m zerostack.as_deepspeed train.py

installs the ``deepspeed`` name (:func:`zerostack.compat.deepspeed.install`), then runs the script
as ``__main__`` with its own arguments, as ``python train.py [ARGS]`` would. When the script
returns, the process groups it left open are torn down together (``zerostack.shutdown``):
DeepSpeed-style scripts end without ``destroy``, and a gloo group destroyed at interpreter exit
while a peer still runs can abort the process.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m zerostack.as_deepspeed (SCRIPT | -m MODULE) [ARGS...]"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__ if argv else USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    module = None
    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        module, args = argv[1], argv[2:]
    else:
        script, args = argv[0], argv[1:]
        if not os.path.isfile(script):
            print(f"zerostack.as_deepspeed: {script}: no such file\n{USAGE}", file=sys.stderr)
            return 2
    from zerostack.compat.deepspeed import install

    install()
    try:
        if module is not None:
            sys.argv = [module, *args]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(script))  # as python script.py does
            runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            raise  # a failure: its peers are not waiting at a barrier
        _tear_down()
        raise
    _tear_down()
    return 0


def _tear_down() -> None:
    from zerostack.world import shutdown

    shutdown()


if __name__ == "__main__":
    sys.exit(main())
