"""``zerostack train``: the demo, and a thin caller of the same ``initialize`` a user script calls.

    zerostack train                       # 2 ranks on CPU, the bundled corpus, a few minutes
    zerostack train --nproc 4 --steps 100 --zero-stage 0 --bf16
    zerostack train --nproc 4 --tp 2 --sequence-parallel --zero-stage 2
    zerostack train --nproc 4 --pp 2 --tp 2 --schedule interleaved --grad-accum 4
    zerostack train --config ds_config.json
    zerostack launch -H hostfile train.py --deepspeed_config ds.json   # DeepSpeed's launcher

Without a launcher it re-executes itself under torchrun with ``--nproc`` ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

DEFAULTS = dict(
    steps=800,
    micro_batch=8,
    lr=3e-3,
    n_layer=4,
    d_model=128,
    n_head=4,
    block_size=128,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerostack", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser(
        "train",
        help="train the reference GPT on the bundled corpus",
        description="Train the reference GPT (byte-level) on the bundled public-domain corpus "
        "(Genesis, KJV) with data parallelism, and report loss, speed and bytes per rank.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    t.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="ranks to launch under torchrun (default: one per GPU, or 2 on a CPU machine)",
    )
    t.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="optimizer steps to run")
    t.add_argument(
        "--config",
        type=str,
        default=None,
        help="a DeepSpeed-style config JSON; options given on this command line override it",
    )
    t.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help=f"sequences per rank per micro-step (default: {DEFAULTS['micro_batch']}, unless "
        "--config sets the batch)",
    )
    t.add_argument("--grad-accum", type=int, default=None, help="micro-steps per optimizer step")
    t.add_argument("--lr", type=float, default=None, help="peak learning rate (AdamW)")
    t.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="each rank's peak TFLOP/s for the MFU figure (default: measured with a matmul)",
    )
    t.add_argument(
        "--zero-stage", type=int, default=None, help="ZeRO stage (0 = plain data parallel)"
    )
    t.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks per model replica (Megatron-style split of heads and MLP); "
        "data parallelism gets nproc / tp",
    )
    t.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: layer norms and dropout on sequence shards (all-gather + reduce-scatter "
        "instead of all-reduce)",
    )
    t.add_argument(
        "--sp",
        type=int,
        default=1,
        help="Ulysses sequence-parallel ranks per batch (sequence_parallel_size): each holds a "
        "shard of the sequence, attention exchanges it for a shard of the heads",
    )
    t.add_argument(
        "--moe-every",
        type=int,
        default=0,
        help="mixture of experts: every N-th block's MLP becomes --num-experts experts (0: none)",
    )
    t.add_argument("--num-experts", type=int, default=4, help="experts per MoE block")
    t.add_argument("--moe-k", type=int, default=1, choices=[1, 2], help="experts per token")
    t.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks: each holds num_experts / ep of every MoE block's experts",
    )
    t.add_argument(
        "--pp", type=int, default=1, help="pipeline stages (the GPT as a PipelineModule)"
    )
    t.add_argument(
        "--schedule",
        choices=["1f1b", "gpipe", "interleaved"],
        default=None,
        help="pipeline schedule with --pp (default 1f1b; interleaved runs 2 chunks per stage)",
    )
    t.add_argument(
        "--offload",
        choices=["cpu", "nvme"],
        default=None,
        help="ZeRO-Offload: fp32 masters and optimizer state in host memory (cpu) or in files "
        "(nvme, with --nvme-path); with --zero-stage 3 the parameter shards too",
    )
    t.add_argument("--nvme-path", default=None, help="folder for --offload nvme files")
    t.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each transformer block in backward instead of keeping its activations",
    )
    prec = t.add_mutually_exclusive_group()
    prec.add_argument("--fp16", action="store_true", help="fp16 with dynamic loss scaling")
    prec.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    t.add_argument(
        "--clip", type=float, default=1.0, help="gradient clipping by global norm (0: off)"
    )
    t.add_argument("--n-layer", type=int, default=DEFAULTS["n_layer"], help="transformer blocks")
    t.add_argument("--d-model", type=int, default=DEFAULTS["d_model"], help="model width")
    t.add_argument("--n-head", type=int, default=DEFAULTS["n_head"], help="attention heads")
    t.add_argument("--block-size", type=int, default=DEFAULTS["block_size"], help="sequence length")
    t.add_argument("--seed", type=int, default=0, help="seed for weights and data order")
    t.add_argument("--out", type=str, default="runs/demo", help="folder for the CSV log and plot")
    t.add_argument("--save-dir", default=None, help="write checkpoints here")
    t.add_argument(
        "--save-every", type=int, default=0, help="checkpoint every K steps (and at the end)"
    )
    t.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in --save-dir"
    )
    t.add_argument(
        "--auto-resume",
        action="store_true",
        help="the config's checkpoint block (for torchrun --max-restarts): initialize resumes "
        "from --save-dir's latest, and the engine saves there every --save-every steps",
    )
    t.add_argument(
        "--keep-last", type=int, default=0, help="keep only the newest M checkpoints (0: all)"
    )
    t.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    t.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    c = sub.add_parser(
        "consolidate",
        help="one safetensors state dict from a sharded checkpoint",
        description="Write the full weights of a zerostack checkpoint as one safetensors file "
        "that plain model.load_state_dict reads (no distributed set-up needed).",
    )
    c.add_argument("ckpt_dir", help="the folder given to save_checkpoint (holds 'latest')")
    c.add_argument("out", help="the .safetensors file to write")
    c.add_argument("--tag", default=None, help="a tag other than the latest")
    c.add_argument("--bf16", action="store_true", help="write bf16 instead of fp32")
    from zerostack.checkpoint.convert import add_parser as add_convert
    from zerostack.dryrun import add_parser as add_dryrun
    from zerostack.estimate.command import add_parser as add_estimate
    from zerostack.launcher.runner import add_parser as add_launch
    from zerostack.plan.command import add_parser as add_plan

    add_convert(sub)
    add_estimate(sub)
    add_plan(sub)
    add_dryrun(sub)
    add_launch(sub)
    return p


def _build_config(args) -> dict:
    cfg: dict = {}
    if args.config:
        from zerostack.config import load_config

        load_config(args.config)  # a bad file is a ConfigError naming the key, before anything
        cfg = json.loads(Path(args.config).read_text())  # as written: unset keys stay unset
    if args.micro_batch or args.grad_accum:
        cfg.pop("train_batch_size", None)  # the command line fixes the batch; drop the file's
    if args.micro_batch:
        cfg["train_micro_batch_size_per_gpu"] = args.micro_batch
    elif "train_batch_size" not in cfg:  # e.g. --grad-accum alone: the default micro-batch
        cfg.setdefault("train_micro_batch_size_per_gpu", DEFAULTS["micro_batch"])
    if args.grad_accum:
        cfg["gradient_accumulation_steps"] = args.grad_accum
    lr = args.lr or DEFAULTS["lr"]
    if "optimizer" not in cfg or args.lr:
        params = {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.1}
        cfg["optimizer"] = {"type": "AdamW", "params": params}
    if "scheduler" not in cfg:
        warm = max(2, args.steps // 10)
        cfg["scheduler"] = {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": args.steps,
                "warmup_num_steps": warm,
                "warmup_type": "linear",
            },
        }
    cfg.setdefault("gradient_clipping", args.clip)
    cfg.setdefault("steps_per_print", max(1, args.steps // 10))
    cfg.setdefault("seed", args.seed)
    if args.zero_stage is not None:
        cfg.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    if args.sp > 1:
        cfg["sequence_parallel_size"] = args.sp
    if args.fp16:  # the file's other keys of the block stay (its 16-bit masters, say)
        cfg.setdefault("fp16", {})["enabled"] = True
    if args.bf16:
        cfg.setdefault("bf16", {})["enabled"] = True
    if args.offload is not None:
        zero = cfg.setdefault("zero_optimization", {})
        zero.setdefault("stage", 2)  # offload needs stage >= 1
        place = {"device": args.offload}
        if args.nvme_path:
            place["nvme_path"] = args.nvme_path
        zero["offload_optimizer"] = dict(place)
        if zero["stage"] == 3:
            zero["offload_param"] = dict(place)
    if args.auto_resume or args.keep_last or args.async_save:
        ckpt = cfg.setdefault("checkpoint", {})
        if args.save_dir:
            ckpt.setdefault("save_dir", args.save_dir)
        if args.auto_resume:
            ckpt["auto_resume"] = True
            ckpt["save_interval"] = args.save_every
        if args.keep_last:
            ckpt["keep_last"] = args.keep_last
        if args.async_save:
            ckpt["async_save"] = True
    if args.schedule is not None:
        pipe = cfg.setdefault("pipeline", {})
        pipe["schedule"] = args.schedule
        pipe["virtual_stages"] = 2 if args.schedule == "interleaved" else 1
    return cfg


ARGV_ENV = "ZEROSTACK_CLI_ARGV"


def _relaunch(argv: list[str], nproc: int) -> int:
    """Run this command again under torchrun, one process per rank."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # The arguments travel in the environment: torchrun's own parser would otherwise take
    # abbreviations of its options (--nproc, --config) out of our command line.
    env[ARGV_ENV] = json.dumps(argv)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", "-m", "zerostack.cli"]
    return subprocess.call(cmd, env=env)


def _check_grid(args) -> None:
    if args.tp < 1 or args.nproc % args.tp:
        raise ValueError(f"--tp {args.tp} does not divide --nproc {args.nproc}")
    if args.n_head % args.tp:
        raise ValueError(f"--n-head {args.n_head} does not split into --tp {args.tp}")
    if args.sequence_parallel and args.tp == 1:
        raise ValueError("--sequence-parallel needs --tp > 1")
    if args.pp < 1 or args.nproc % (args.pp * args.tp):
        raise ValueError(f"--pp {args.pp} x --tp {args.tp} does not divide --nproc {args.nproc}")
    if args.offload == "nvme" and not args.nvme_path:
        raise ValueError("--offload nvme needs --nvme-path")
    if (args.save_every or args.resume or args.auto_resume) and not args.save_dir:
        raise ValueError("--save-every, --resume and --auto-resume need --save-dir")
    if args.schedule is not None and args.pp == 1:
        raise ValueError("--schedule needs --pp > 1")
    if args.sequence_parallel and args.block_size % args.tp:
        raise ValueError(f"--block-size {args.block_size} does not split into --tp {args.tp}")
    if args.sp < 1 or args.nproc % (args.pp * args.tp * args.sp):
        raise ValueError(
            f"--pp {args.pp} x --tp {args.tp} x --sp {args.sp} does not divide --nproc {args.nproc}"
        )
    if args.ep > 1:
        if not args.moe_every:
            raise ValueError("--ep needs --moe-every > 0 (experts to split)")
        if args.num_experts % args.ep or args.nproc % (args.tp * args.pp * args.ep):
            raise ValueError(
                f"--ep {args.ep} does not divide --num-experts {args.num_experts} or "
                f"--nproc {args.nproc} / (--tp x --pp)"
            )
        if args.tp > 1 or args.pp > 1 or args.sp > 1 or args.zero_stage == 3:
            raise ValueError("--ep does not combine with --tp, --pp, --sp or --zero-stage 3")
    if args.moe_every and (args.activation_checkpointing or args.tp > 1 or args.pp > 1):
        raise ValueError(
            "--moe-every does not combine with --activation-checkpointing, --tp or --pp yet"
        )
    if args.sp > 1:
        if args.n_head % (args.tp * args.sp):
            raise ValueError(f"--n-head {args.n_head} does not split into --tp x --sp heads")
        if args.block_size % args.sp:
            raise ValueError(f"--block-size {args.block_size} does not split into --sp {args.sp}")
        if args.pp > 1 or args.sequence_parallel:
            raise ValueError("--sp does not combine with --pp or --sequence-parallel")


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = json.loads(os.environ[ARGV_ENV]) if ARGV_ENV in os.environ else sys.argv[1:]
    args = _parser().parse_args(argv)
    if args.command == "train":
        from zerostack.config import ConfigError, load_config

        if args.nproc is None:
            import torch

            args.nproc = torch.cuda.device_count() if torch.cuda.is_available() else 2

        launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        if not launched:
            try:  # refuse a bad config once, here, rather than once per rank under torchrun
                _check_grid(args)
                load_config(_build_config(args)).resolve_batch(
                    args.nproc // (args.tp * args.pp * args.sp)
                )
            except (ConfigError, OSError, json.JSONDecodeError, ValueError) as exc:
                print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
                return 2
            if args.nproc > 1:
                return _relaunch(argv, args.nproc)
        from zerostack.demo.train import train
        from zerostack.world import shutdown

        train(args, _build_config(args))

        shutdown()
    elif args.command == "estimate":
        from zerostack.estimate.command import run

        return run(args)
    elif args.command == "plan":
        from zerostack.plan.command import run

        return run(args)
    elif args.command == "dryrun":
        from zerostack.dryrun import run

        return run(args)
    elif args.command == "launch":
        from zerostack.launcher.runner import run

        return run(args)
    elif args.command == "consolidate":
        import torch

        from zerostack.checkpoint import CheckpointError, consolidate

        try:
            dtype = torch.bfloat16 if args.bf16 else torch.float32
            path = consolidate(args.ckpt_dir, args.out, tag=args.tag, dtype=dtype)
        except (CheckpointError, OSError, ValueError) as exc:
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {path}")
    elif args.command == "convert":
        from zerostack.checkpoint import CheckpointError
        from zerostack.checkpoint.convert import run_command

        try:
            return run_command(args)
        except (CheckpointError, OSError, ValueError) as exc:
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
