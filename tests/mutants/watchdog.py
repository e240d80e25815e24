"""The mutants of src/zerostack/watchdog/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "watchdog: a rank ended by an exception finalises with the thread inside a store call",
        "watchdog/__init__.py",
        "        atexit.register(self.stop)\n",
        "",
        ("tests/test_watchdog.py::test_a_rank_ended_by_an_exception_exits_with_it_not_an_abort",),
    ),
    Mutant(
        "the watchdog's stop leaves its wake sockets open (two descriptors an engine)",
        "watchdog/__init__.py",
        "            self._selector.close()\n            self._wake_r.close()\n",
        "            self._selector.close()\n",
        (
            "tests/test_watchdog.py::"
            "test_sigusr1_is_heard_above_descriptor_1023_and_stop_closes_what_it_opened",
        ),
    ),
    Mutant(
        "watchdog: a silent peer is given ten times the bound",
        "watchdog/heartbeats.py",
        "if quiet_for > self.timeout]",
        "if quiet_for > 10 * self.timeout]",
        (
            "tests/test_watchdog.py::test_a_silent_peer_is_named_with_its_last_position",
            "tests/test_watchdog.py::test_a_frozen_rank_ends_the_job_within_the_bound",
        ),
    ),
    Mutant(
        "watchdog: a peer that missed its beats does not hold back the rival verdict",
        "watchdog/heartbeats.py",
        "now - pending.started > self.timeout and not quiet:",
        "now - pending.started > self.timeout:",
        (
            "tests/test_watchdog.py::"
            "test_a_peer_that_froze_as_this_rank_began_waiting_is_named_stopped",
        ),
    ),
    Mutant(
        "watchdog: its exit skips the removal of the rank's swap files",
        "watchdog/__init__.py",
        "exit: Callable[[int], None] = hard_exit,",
        "exit: Callable[[int], None] = os._exit,",
        ("tests/test_disk_faults.py::test_the_watchdogs_exit_removes_the_ranks_swap_files",),
    ),
    Mutant(
        "watchdog: an error raised as the job ends prints its traceback as if it were the cause",
        "watchdog/__init__.py",
        "        if self._ending.is_set():\n            # raised",
        "        if False:\n            # raised",
        (
            "tests/test_watchdog.py::"
            "test_an_error_raised_as_the_job_ends_is_not_printed_as_its_cause",
        ),
    ),
    Mutant(
        "watchdog: a posted verdict is not read by the other ranks",
        "watchdog/heartbeats.py",
        "        if self.store.check([key]):\n            return self.store.get(key).decode()\n",
        "",
        (
            "tests/test_watchdog.py::test_a_posted_verdict_ends_every_rank",
            "tests/test_watchdog.py::test_a_frozen_rank_ends_the_job_within_the_bound",
        ),
    ),
    Mutant(
        "watchdog: stop waits out the interval",
        "watchdog/__init__.py",
        '            self._wake_w.send(b"\\0")',
        "            pass",
        ("tests/test_watchdog.py::test_stop_returns_at_once",),
    ),
    Mutant(
        "watchdog: an exception is not posted as the verdict",
        "watchdog/__init__.py",
        "        sys.excepthook = self._excepthook\n",
        "",
        ("tests/test_watchdog.py::test_a_rank_that_raises_is_named_by_every_rank",),
    ),
    Mutant(
        "watchdog: the verdict printed into whatever sys.stderr is at the time",
        "watchdog/__init__.py",
        "        print(text, file=self._out, flush=True)",
        "        print(text, file=sys.stderr, flush=True)",
        (
            "tests/test_watchdog.py::"
            "test_the_verdict_and_the_traceback_reach_the_log_when_a_rank_raises",
        ),
    ),
    Mutant(
        "watchdog: the rank ends while its traceback is being printed",
        "watchdog/__init__.py",
        "            if self._tracing.is_set():",
        "            if False:",
        (
            "tests/test_watchdog.py::"
            "test_the_verdict_and_the_traceback_reach_the_log_when_a_rank_raises",
        ),
    ),
    Mutant(
        "the watchdog leaves a stopped peer on its host to the launcher",
        "watchdog/__init__.py",
        "            self._end_stopped_peers()\n",
        "",
        (
            "tests/test_watchdog.py::test_a_frozen_rank_ends_the_job_within_the_bound"
            "[step-2-all_reduce]",
        ),
    ),
]
