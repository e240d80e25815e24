"""One rank's process for tests/test_watchdog.py: a watchdog beating every 0.1 ms (so its
thread is nearly always inside a store call), then an exception that ends the process without
``destroy``. The process must end by the exception (exit code 1, its traceback), not abort.
With ``exit`` it ends by ``sys.exit(3)`` instead (no verdict is posted, so the exit handlers
always run), and a handler registered before the watchdog's, so run after it (they run last
first), prints whether the watchdog's thread is still alive there: the abort is a race, that
the thread outlives the exit handlers is not.

    PYTHONPATH=. python tests/jobs/watchdog_exit_job.py [exit]
"""

from __future__ import annotations

import atexit
import sys
import threading
import time

import torch.distributed as dist

from zerostack.comm import CommLog
from zerostack.watchdog import Watchdog


def _report() -> None:
    alive = any(t.name == "zerostack-watchdog" and t.is_alive() for t in threading.enumerate())
    print(f"watchdog thread alive at exit: {alive}", flush=True)


atexit.register(_report)
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
Watchdog(CommLog(), store, rank=0, world=2, timeout=100, interval=1e-4).start()
time.sleep(0.05)
if sys.argv[1:] == ["exit"]:
    sys.exit(3)
raise RuntimeError("rank 0 ran out of data")
