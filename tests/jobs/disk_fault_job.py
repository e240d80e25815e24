"""A short offloaded training job for tests/test_disk_faults.py: at step 2, rank 1's disk fills up
for real (``RLIMIT_FSIZE``: the kernel refuses writes past a size, EFBIG; Python ignores the
SIGXFSZ that comes with it, so ``write`` raises) just before ``engine.step()``, whose NVMe swap
writes then fail. Nothing catches the error: the job must end on every rank, naming it.

    # from the checkout's root, with RANK, WORLD_SIZE, MASTER_* set:
    PYTHONPATH=. python tests/jobs/disk_fault_job.py <stage> <nvme_path>
"""

from __future__ import annotations

import resource
import sys
import time

import torch
import torch.distributed as dist

import zerostack

from tests.support.models import batch, tiny_gpt

VICTIM, AT_STEP = 1, 2


def main(stage: int, nvme_path: str) -> None:
    torch.set_num_threads(1)
    zerostack.init_distributed("gloo")
    rank = dist.get_rank()
    nvme = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2}
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, "sub_group_size": 3000}
    zero["offload_optimizer"] = nvme
    if stage == 3:
        zero["offload_param"] = nvme
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
        # long: the job must end through the error itself, not a hang the watchdog finds
        "watchdog": {"timeout": 60, "interval": 0.25},
        "steps_per_print": 1000,
    }
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=config)
    x, y = batch(0, 2)
    for step in range(5):
        engine.backward(engine(x[rank : rank + 1], y[rank : rank + 1]))
        if rank == VICTIM and step == AT_STEP:
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
            print(f"FAULT {time.time():.3f}", flush=True)
        engine.step()
    engine.destroy()
    print("FINISHED", flush=True)
    zerostack.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
