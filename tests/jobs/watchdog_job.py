"""A short training job for tests/test_watchdog.py: one rank freezes itself (``SIGSTOP``) or
skips a forward at a chosen point, and the others must end with the watchdog's report.

    # from the checkout's root, with RANK, WORLD_SIZE, MASTER_ADDR/PORT set:
    PYTHONPATH=. python tests/jobs/watchdog_job.py <phase>

Phases: forward, backward, step (stage 3), checkpoint (stage 1, in save_checkpoint), pipeline
(pp 2 x dp 2, inside a stage's forward), skip (stage 3: rank 1 skips a forward), raise (stage 3:
rank 1 raises), none.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import zerostack

from tests.support.models import TINY, batch, tiny_gpt

VICTIM, AT_STEP = 1, 2


def freeze(where: str) -> None:
    print(f"FROZE {time.time():.3f} {where}", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)


def main(phase: str) -> None:
    torch.set_num_threads(1)
    zerostack.init_distributed("gloo")
    rank = dist.get_rank()
    victim = rank == VICTIM
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 1 if phase == "checkpoint" else 3,
            "stage3_param_persistence_threshold": 0,
        },
        "watchdog": {"timeout": 2, "interval": 0.25},
        "steps_per_print": 1000,
    }
    if phase == "pipeline":
        from zerostack.models.gpt_pipe import GPTLoss, gpt_layers
        from zerostack.pipeline import PipelineModule

        config["zero_optimization"]["stage"] = 1
        config["gradient_accumulation_steps"] = 2
        topo = zerostack.Topology.build(pp=2)
        model = PipelineModule(
            gpt_layers(TINY, topology=topo),
            topology=topo,
            loss_fn=GPTLoss(topo),
            partition_method="type:Block",
        )
    else:
        model = tiny_gpt()
    engine, *_ = zerostack.initialize(model=model, config=config)
    state = {"step": 0}

    def at_victim_step() -> bool:
        return victim and state["step"] == AT_STEP

    if phase == "forward":
        engine.module.blocks[1].register_forward_pre_hook(
            lambda *_: freeze("forward") if at_victim_step() else None
        )
    elif phase == "backward":
        engine.module.blocks[0].register_full_backward_hook(
            lambda *_: freeze("backward") if at_victim_step() else None
        )
    elif phase == "pipeline":
        for layer in engine.module.modules():
            if type(layer).__name__ == "PipeBlock":
                layer.register_forward_pre_hook(
                    lambda *_: freeze("pipeline") if at_victim_step() else None
                )
    x, y = batch(0, 2)
    save_dir = tempfile.mkdtemp(prefix="zs-watchdog-")
    for step in range(6):
        state["step"] = step
        if phase == "pipeline":
            engine.train_batch(iter([(x[:1], y[:1]), (x[1:], y[1:])]))
            continue
        if phase == "raise" and at_victim_step():
            raise RuntimeError("rank 1 ran out of data")
        if phase == "skip" and at_victim_step():
            engine.step()  # rank 1 skipped its forward and backward
            continue
        engine.backward(engine(x[:1], y[:1]))
        if phase == "step" and at_victim_step():
            freeze("step")
        engine.step()
        if phase == "checkpoint" and step == AT_STEP:
            if victim:
                freeze("checkpoint")
            engine.save_checkpoint(save_dir)
    engine.destroy()
    print("FINISHED", flush=True)
    zerostack.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
