"""The demo's training run: ``zerostack train`` parses the command line (``zerostack.cli``) and
calls :func:`train` on every rank, the same ``initialize`` / ``train_batch`` a user script calls."""

from __future__ import annotations

import os
import time

import torch

import zerostack
from zerostack.demo.corpus import corpus_datasets
from zerostack.demo.monitor import RunMonitor
from zerostack.models import GPT, GPTConfig
from zerostack.models.gpt_pipe import GPTLoss, gpt_layers
from zerostack.pipeline import PipelineModule
from zerostack.plan.hardware import matmul_flops
from zerostack.profiling.flops import transformer_flops
from zerostack.sequence import shard_sequence


def train(args, config: dict) -> dict:
    """Train the reference GPT as ``args`` (the parsed command line) and ``config`` (the
    DeepSpeed config it built) say; rank 0 writes the run's files and returns its summary."""
    zerostack.init_distributed()
    topo = zerostack.Topology.build(pp=args.pp, tp=args.tp, sp=args.sp, ep=args.ep)
    torch.manual_seed(args.seed)
    model_cfg = GPTConfig(
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        d_model=args.d_model,
        checkpoint_every=1 if args.activation_checkpointing else 0,
        moe_every=args.moe_every,
        num_experts=args.num_experts if args.moe_every else 1,
        moe_k=args.moe_k,
        moe_ep_size=args.ep,
    )
    if args.pp > 1:
        model = _pipeline_model(model_cfg, topo, args, config)
    else:
        model = GPT(model_cfg)
        if args.tp > 1 or args.sp > 1:
            model.parallelize(topo, sequence_parallel=args.sequence_parallel)
    train_set, val_set = corpus_datasets(args.block_size)
    engine, *_ = zerostack.initialize(
        model=model, training_data=train_set, config=config, topology=topo
    )
    rank0 = engine.global_rank == 0
    flops_per_step, peak, peak_source = _flops_and_peak(engine, model_cfg, args)
    monitor = RunMonitor(args.out, total=args.steps, enabled=rank0, progress=not args.no_progress)
    tokens_per_step = engine.train_batch_size() * args.block_size
    auto = engine.config.checkpoint  # auto_resume: initialize has loaded latest already
    if (
        args.resume
        and not auto.auto_resume
        and os.path.exists(os.path.join(args.save_dir, "latest"))
    ):
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
        last = engine.global_steps == args.steps
        if args.save_dir and not auto.save_interval and (due or last):
            checkpoint = engine.save_checkpoint(args.save_dir)
    if auto.save_interval:  # the engine saved every save_interval steps; the last one too
        if engine.global_steps % auto.save_interval:
            engine.save_checkpoint(auto.save_dir)
        checkpoint = os.path.join(auto.save_dir, f"global_step{engine.global_steps}")
    engine.wait_for_checkpoint()  # a background save is complete before the summary names it
    elapsed = time.perf_counter() - t_start
    val_loss = _evaluate(engine, val_set, args.block_size)
    summary = {
        "world_size": engine.world_size,
        "tp": engine.topology.tp,
        "pp": engine.topology.pp,
        "dp": engine.dp_world_size,
        "sp": engine.topology.sp,
        "ep": engine.topology.ep,
        "moe": {"every": args.moe_every, "experts": args.num_experts, "k": args.moe_k}
        if args.moe_every
        else None,
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
        "model_flops_per_step": flops_per_step,
        "peak_flops_per_rank": peak,
        "peak_source": peak_source,
        "mfu": flops_per_step
        * (args.steps - first_step)
        / max(elapsed, 1e-9)
        / (peak * engine.world_size),
        "bytes_per_rank": engine.memory_breakdown(),
        "cuda_memory_rank0": engine.device_memory(),
        "comm_bytes_per_step": engine.comm.log.total_bytes(step=engine.global_steps - 1),
        "checkpoint": checkpoint,
    }
    monitor.finish(summary)
    engine.destroy()  # NVMe offload files go now, not at interpreter exit
    return summary


def _pipeline_model(model_cfg, topo, args, config: dict):
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


def _flops_and_peak(engine, cfg: GPTConfig, args) -> tuple[int, float, str]:
    """A step's model flops (Narayanan et al.'s count over the global batch, the recomputed
    forward included with activation checkpointing) and each rank's peak: given, or the
    measured fp32 matmul rate. Every rank measures at once (after a barrier, so no rank still
    sets up beside one that measures), best of 10 products, and the fastest rank's rate is the
    peak of all: one quick product taken while a neighbour was busy read a quarter of this
    machine's rate and the demo printed an MFU near 200%."""
    flops = transformer_flops(
        cfg.n_layer,
        cfg.d_model,
        cfg.n_head,
        cfg.vocab_size,
        cfg.block_size,
        engine.train_batch_size(),
        recompute=cfg.checkpoint_every > 0,
    )
    if args.peak_tflops:
        return flops, args.peak_tflops * 1e12, "given"
    # outside the engine's comm log: not part of training
    many = torch.distributed.is_initialized() and engine.world_size > 1
    if many:
        torch.distributed.barrier()
    rate = torch.tensor(matmul_flops(512, repeats=10), dtype=torch.float64, device=engine.device)
    if many:
        torch.distributed.all_reduce(rate, op=torch.distributed.ReduceOp.MAX)
    return flops, float(rate), "measured"


def _evaluate(engine, dataset, block_size: int, batches: int = 8) -> float:
    """The mean validation loss over up to ``batches`` micro-batches per rank, through
    ``eval_batch`` (pipelined or not): whole global batches of ``gradient_accumulation_steps``
    micro-batches, averaged over dp (each sp rank its shard of the sequences)."""
    micro = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    n = min(len(dataset), batches * micro * engine.dp_world_size)
    idx = list(range(engine.topology.data_parallel_rank, n, engine.dp_world_size))
    rounds = max(1, len(idx) // (micro * gas))
    it = (
        shard_sequence(
            (
                torch.stack([dataset[j][0] for j in idx[i : i + micro]]),
                torch.stack([dataset[j][1] for j in idx[i : i + micro]]),
            ),
            engine.topology,
        )
        for i in range(0, rounds * micro * gas, micro)
    )
    with torch.no_grad():
        return sum(engine.eval_batch(it).item() for _ in range(rounds)) / rounds
