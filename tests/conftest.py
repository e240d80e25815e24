import os
import subprocess

import pytest

from tests.support import ranks

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The downstream scripts' ranks (scripts/hf_trainer_runs.py's _torchrun) are forked from a server
# that imported their libraries once (tests/support/script_server.py); ZEROSTACK_TEST_TORCHRUN=1
# starts each under torchrun instead.
if os.environ.get("ZEROSTACK_TEST_TORCHRUN") != "1":
    os.environ["ZEROSTACK_TEST_SCRIPT_SERVER"] = "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test that starts ranks is marked ``distributed``: for any other, from its first fixture
    (module-scoped ones included) to its teardown, ``run_distributed`` and any command that
    starts ranks (:func:`tests.support.ranks.starts_ranks`) fail it."""
    if item.get_closest_marker("distributed") is not None:
        yield
        return
    popen = subprocess.Popen.__init__

    def guarded(self, args, *rest, **kwargs):
        if ranks.starts_ranks(args, kwargs.get("env")):
            ranks.refuse(" ".join(ranks.argv(args)))
        popen(self, args, *rest, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ranks.UNMARKED, item.nodeid)
        mp.setattr(subprocess.Popen, "__init__", guarded)
        yield
