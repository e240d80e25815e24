"""One rank's process for tests/test_watchdog.py: a watchdog beating every 0.1 ms (so its
thread is nearly always inside a store call), then an exception that ends the process without
``destroy``. The process must end by the exception (exit code 1, its traceback), not abort.

    PYTHONPATH=. python tests/jobs/watchdog_exit_job.py
"""

from __future__ import annotations

import time

import torch.distributed as dist

from zerostack.comm import CommLog
from zerostack.watchdog import Watchdog

store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
Watchdog(CommLog(), store, rank=0, world=2, timeout=100, interval=1e-4).start()
time.sleep(0.05)
raise RuntimeError("rank 0 ran out of data")
