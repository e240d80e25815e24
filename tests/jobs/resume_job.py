"""A short training job for tests/test_auto_resume.py and benchmarks/faults.py, run under
torchrun: a DeepSpeed-style script whose only resume code is the config's ``checkpoint`` block.

    PYTHONPATH=. torchrun --nproc_per_node 2 --max-restarts 1 tests/jobs/resume_job.py <out> [opts]

On the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0) rank ``--victim`` SIGKILLs itself at
``--kill`` (``<where>:<step>``: in the forward, backward or optimizer step of optimizer step
``<step>`` + 1, or inside the automatic save after step ``<step>``, while writing its file), or
SIGSTOPs itself in that forward (``freeze``);
torchrun restarts the job, which resumes from ``latest``. Each rank appends one JSON line per
optimizer step to ``<out>/rank<r>.jsonl`` (attempt, step, the sample ids it trained on, loss);
rank 0 writes the final weights to ``<out>/final.safetensors`` and ``<out>/times.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
from torch.utils.data import Dataset

import zerostack
from zerostack.demo.corpus import load_corpus
from zerostack.models import GPT, GPTConfig

from tests.support.models import TINY


class Windows(Dataset):
    """Corpus windows; remembers the ids asked for (the loader has no worker processes)."""

    def __init__(self, n: int, block: int) -> None:
        tokens = load_corpus()
        g = torch.Generator().manual_seed(7)
        self.starts = torch.randint(0, tokens.numel() - block - 1, (n,), generator=g).tolist()
        self.tokens, self.block, self.seen = tokens, block, []

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int):
        self.seen.append(i)
        s = self.starts[i]
        return self.tokens[s : s + self.block], self.tokens[s + 1 : s + self.block + 1]


def die(where: str) -> None:
    """SIGKILL this rank (``freeze``: SIGSTOP it, for the watchdog to notice; ``node``: SIGKILL
    its torchrun agent first, as when a whole node goes)."""
    print(f"KILLED {time.time():.3f} {where}", flush=True)
    if where == "node":
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGSTOP if where == "freeze" else signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument(
        "--kill", default="", help="forward|backward|step|save|freeze|node:<step> (first attempt)"
    )
    p.add_argument("--watchdog-timeout", type=float, default=20.0)
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--batch", type=int, default=8, help="train_batch_size (micro-batch 2)")
    p.add_argument("--interval", type=int, default=2)
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--d-model", type=int, default=TINY.d_model)
    p.add_argument("--n-layer", type=int, default=TINY.n_layer)
    p.add_argument("--n-head", type=int, default=TINY.n_head)
    p.add_argument("--vocab", type=int, default=TINY.vocab_size)
    args = p.parse_args()
    t_start = time.time()
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))
    where, _, at = args.kill.partition(":")
    kill_at = int(at) if where and attempt == 0 and rank == args.victim else -1
    cfg = GPTConfig(
        vocab_size=args.vocab,
        block_size=TINY.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        d_model=args.d_model,
        bias=False,
    )
    torch.manual_seed(0)
    model = GPT(cfg)
    data = Windows(args.samples, cfg.block_size)
    config = {
        "train_batch_size": args.batch,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0},
        "seed": 3,
        "steps_per_print": 1000,
        "watchdog": {"timeout": args.watchdog_timeout},
        "checkpoint": {
            "save_dir": os.path.join(args.out, "ckpt"),
            "auto_resume": True,
            "save_interval": args.interval,
            "keep_last": args.keep_last,
            "async_save": args.async_save,
        },
    }
    t0 = time.time()
    engine, *_ = zerostack.initialize(model=model, training_data=data, config=config)
    resumed_at, t_ready = engine.global_steps, time.time()
    step = {"n": -1}  # the optimizer step being computed (0-based)

    def armed(point: str) -> bool:
        return where == point and step["n"] == kill_at

    engine.module.blocks[-1].register_forward_pre_hook(
        lambda *_: die(where) if armed("forward") or armed("freeze") or armed("node") else None
    )
    engine.module.blocks[0].register_full_backward_hook(
        lambda *_: die("backward") if armed("backward") else None
    )
    if where == "step":
        apply = engine.apply_step
        engine.apply_step = lambda: die("step") if armed("step") else apply()
    if where == "save" and kill_at >= 0:
        from zerostack.checkpoint import shard

        write = shard._write  # the file writer of the synchronous and background saves

        def dying_write(path, entries, tensors):  # in the writer thread, with async_save
            if f".global_step{kill_at}.incomplete" in path:
                die("save")
            return write(path, entries, tensors)

        shard._write = dying_write
    with open(os.path.join(args.out, f"pid{attempt}_{rank}"), "w") as f:
        f.write(str(os.getpid()))
    log = open(os.path.join(args.out, f"rank{rank}.jsonl"), "a")
    while engine.global_steps < args.steps:
        step["n"] = engine.global_steps
        data.seen.clear()
        loss = engine.train_batch().item()
        row = {
            "attempt": attempt,
            "step": engine.global_steps,
            "ids": list(data.seen),
            "loss": loss,
        }
        log.write(json.dumps(row) + "\n")
        log.flush()
    engine.wait_for_checkpoint()
    weights = engine.full_state_dict()
    if rank == 0:
        from safetensors.torch import save_file

        save_file(weights, os.path.join(args.out, "final.safetensors"))
        times = {"start": t_start, "init": t0, "ready": t_ready, "resumed_at": resumed_at}
        with open(os.path.join(args.out, f"times{attempt}.json"), "w") as f:
            json.dump(times, f)
    engine.destroy()
    zerostack.shutdown()


if __name__ == "__main__":
    main()
