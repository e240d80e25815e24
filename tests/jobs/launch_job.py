"""A short ZeRO-2 training job for tests/test_launch.py, started by ``zerostack launch`` (one node
or two) or with Open MPI's variables alone; it writes what it saw and what it learnt.

    PYTHONPATH=. python tests/jobs/launch_job.py [--local_rank=N] OUT_DIR

Each rank writes ``OUT_DIR/rank{R}.json`` (rank, world, local rank from the environment and from
``--local_rank``, torchrun's node index, its losses); rank 0 writes the final parameters to
``OUT_DIR/params.safetensors``. Rank r of a world of w trains on rows r::w of each global batch,
so any layout of the same world sees the same data on the same ranks.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import zerostack

from tests.support.models import batch, tiny_gpt

STEPS, PER_RANK = 3, 2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=None)  # DeepSpeed's launcher passes it
    p.add_argument("out")
    args = p.parse_args()
    torch.set_num_threads(1)
    zerostack.init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": PER_RANK,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 1000,
    }
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=config)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, PER_RANK * world)
        loss = engine(x[rank::world], y[rank::world])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    seen = {
        "rank": rank,
        "world": world,
        "local_rank_env": int(os.environ["LOCAL_RANK"]),
        "local_rank_arg": args.local_rank,
        "node": os.environ.get("GROUP_RANK"),  # torchrun's index of this rank's node
        "losses": losses,
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    params = {k: p.detach().clone().contiguous() for k, p in engine.module.named_parameters()}
    if rank == 0:
        save_file(params, os.path.join(args.out, "params.safetensors"))
    engine.destroy()
    zerostack.shutdown()


if __name__ == "__main__":
    main()
