"""Scripts run as ranks, each as a file (by torchrun, the zerostack launcher, or a test that
gives it a rank's variables); ``tests.support.ranks.job_env`` puts the checkout's root on their
``PYTHONPATH``, so they import ``tests.support``."""
