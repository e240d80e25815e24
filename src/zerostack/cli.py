"""``zerostack train``: the demo, and a thin caller of the same ``initialize`` a user script calls.

    zerostack train                       # 2 ranks on CPU, the bundled corpus, a few minutes
    zerostack train --nproc 4 --steps 100 --zero-stage 0 --bf16
    zerostack train --nproc 4 --tp 2 --sequence-parallel --zero-stage 2
    zerostack train --nproc 4 --pp 2 --tp 2 --schedule interleaved --grad-accum 4
    zerostack train --config ds_config.json

Without a launcher it re-executes itself under torchrun with ``--nproc`` ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
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
    if args.fp16:
        cfg["fp16"] = {"enabled": True}
    if args.bf16:
        cfg["bf16"] = {"enabled": True}
    if args.offload is not None:
        zero = cfg.setdefault("zero_optimization", {})
        zero.setdefault("stage", 2)  # offload needs stage >= 1
        place = {"device": args.offload}
        if args.nvme_path:
            place["nvme_path"] = args.nvme_path
        zero["offload_optimizer"] = dict(place)
        if zero["stage"] == 3:
            zero["offload_param"] = dict(place)
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


def train(args) -> dict:
    import torch

    import zerostack
    from zerostack.data import corpus_datasets
    from zerostack.models import GPT, GPTConfig
    from zerostack.monitor import RunMonitor

    zerostack.init_distributed()
    topo = zerostack.Topology.build(pp=args.pp, tp=args.tp)
    torch.manual_seed(args.seed)
    model_cfg = GPTConfig(
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        d_model=args.d_model,
        checkpoint_every=1 if args.activation_checkpointing else 0,
    )
    config = _build_config(args)
    if args.pp > 1:
        model = _pipeline_model(model_cfg, topo, args, config)
    else:
        model = GPT(model_cfg)
        if args.tp > 1:
            model.parallelize(topo, sequence_parallel=args.sequence_parallel)
    train_set, val_set = corpus_datasets(args.block_size)
    engine, *_ = zerostack.initialize(
        model=model, training_data=train_set, config=config, topology=topo
    )
    rank0 = engine.global_rank == 0
    monitor = RunMonitor(args.out, total=args.steps, enabled=rank0, progress=not args.no_progress)
    tokens_per_step = engine.train_batch_size() * args.block_size
    if args.resume and os.path.exists(os.path.join(args.save_dir, "latest")):
        engine.load_checkpoint(args.save_dir)  # the loader continues after the last batch saved
    checkpoint, first_step = None, engine.global_steps
    t_start = time.perf_counter()
    for _ in range(args.steps - engine.global_steps):
        t0 = time.perf_counter()
        # one global batch from the engine's loader, pipelined or not; its mean loss over dp
        mean_loss = engine.train_batch().item()
        monitor.log(
            step=engine.global_steps,
            loss=mean_loss,
            lr=engine.get_lr()[0],
            loss_scale=engine.loss_scale,
            grad_norm=engine.get_global_grad_norm(),
            tokens_per_s=tokens_per_step / (time.perf_counter() - t0),
        )
        due = args.save_every and engine.global_steps % args.save_every == 0
        if args.save_dir and (due or engine.global_steps == args.steps):
            checkpoint = engine.save_checkpoint(args.save_dir)
    elapsed = time.perf_counter() - t_start
    val_loss = _evaluate(engine, val_set, args.block_size)
    summary = {
        "world_size": engine.world_size,
        "tp": engine.topology.tp,
        "pp": engine.topology.pp,
        "dp": engine.dp_world_size,
        "sequence_parallel": args.sequence_parallel,
        "zero_stage": engine.config.zero_optimization.stage,
        "offload": args.offload,
        "activation_checkpointing": args.activation_checkpointing,
        "precision": engine.precision.name,
        "parameters": model_cfg.num_params,
        "parameters_per_rank": sum(p.numel() for p in model.parameters()),
        "schedule": engine.config.pipeline.schedule if args.pp > 1 else None,
        "steps": args.steps,
        "first_loss": monitor.rows[0]["loss"] if monitor.rows else None,
        "final_loss": monitor.recent_loss(),
        "val_loss": val_loss,
        "tokens_per_s": tokens_per_step * (args.steps - first_step) / max(elapsed, 1e-9),
        "bytes_per_rank": engine.memory_breakdown(),
        "comm_bytes_per_step": engine.comm.log.total_bytes(step=engine.global_steps - 1),
        "checkpoint": checkpoint,
    }
    monitor.finish(summary)
    engine.destroy()  # NVMe offload files go now, not at interpreter exit
    return summary


def _pipeline_model(model_cfg, topo, args, config: dict):
    from zerostack.models.gpt_pipe import GPTLoss, gpt_layers
    from zerostack.pipeline import PipelineModule

    pipe = config.get("pipeline", {})
    layers = gpt_layers(model_cfg, topology=topo, sequence_parallel=args.sequence_parallel)
    interval = 1 if args.activation_checkpointing else 0
    return PipelineModule(
        layers,
        topology=topo,
        loss_fn=GPTLoss(topo),
        partition_method=pipe.get("partition", "type:Block"),
        activation_checkpoint_interval=pipe.get("activation_checkpoint_interval", interval),
        seed_layers=pipe.get("seed_layers", False),
        virtual_stages=pipe.get("virtual_stages", 1),
    )


def _evaluate(engine, dataset, block_size: int, batches: int = 8) -> float:
    import torch

    from zerostack.pipeline import PipelineEngine

    engine.eval()
    micro = engine.train_micro_batch_size_per_gpu()
    n = min(len(dataset), batches * micro * engine.dp_world_size)
    idx = list(range(engine.topology.dp_rank, n, engine.dp_world_size))
    if isinstance(engine, PipelineEngine):
        gas = engine.gradient_accumulation_steps()
        rounds = max(1, len(idx) // (micro * gas))
        it = (
            (
                torch.stack([dataset[j][0] for j in idx[i : i + micro]]),
                torch.stack([dataset[j][1] for j in idx[i : i + micro]]),
            )
            for i in range(0, rounds * micro * gas, micro)
        )
        loss = sum(engine.eval_batch(it).item() for _ in range(rounds)) / rounds
        engine.train()
        return loss
    total = torch.zeros(2)
    with torch.no_grad():
        for i in range(0, len(idx), micro):
            pairs = [dataset[j] for j in idx[i : i + micro]]
            x = torch.stack([p[0] for p in pairs]).to(engine.device)
            y = torch.stack([p[1] for p in pairs]).to(engine.device)
            xs = pairs
            total += torch.tensor([engine(x, y).float().item() * len(xs), len(xs)])
    engine.comm.all_reduce(total, axis="dp")
    engine.train()
    return float(total[0] / total[1])


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
    if (args.save_every or args.resume) and not args.save_dir:
        raise ValueError("--save-every and --resume need --save-dir")
    if args.schedule is not None and args.pp == 1:
        raise ValueError("--schedule needs --pp > 1")
    if args.sequence_parallel and args.block_size % args.tp:
        raise ValueError(f"--block-size {args.block_size} does not split into --tp {args.tp}")


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
                load_config(_build_config(args)).resolve_batch(args.nproc // (args.tp * args.pp))
            except (ConfigError, OSError, json.JSONDecodeError, ValueError) as exc:
                print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
                return 2
            if args.nproc > 1:
                return _relaunch(argv, args.nproc)
        train(args)
        from zerostack.topology import shutdown

        shutdown()
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
