"""ZeRO-Infinity on this machine: a GPT with >= 1B parameters trains with stage 3 + NVMe offload.

    python benchmarks/infinity.py --nvme-path /tmp/zs-nvme          # ~1.0B parameters, 2 steps
    python benchmarks/infinity.py --nvme-path /tmp/zs-nvme --d-model 512 --n-layer 4   # a quick try

The model is built under ``zero.Init(remote_device="nvme")`` (each piece goes to a file as it is
made), the parameter shards, fp32 masters, Adam moments and fp32 gradients live in files under
``--nvme-path``, and only a few layers and ``buffer_count`` optimizer sub-groups are in memory at a
time. Prints JSON: model-state bytes (16 x parameters: fp32 weights, gradients and two Adam
moments), peak RSS of the job (all ranks together), their ratio (the goal is >= 3), seconds per
step and the bytes read and written per step.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

try:
    import zerostack
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    import zerostack
from _bench import emit  # benchmarks/_bench.py

from zerostack.models import GPT, GPTConfig


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme-path", required=True, help="a folder on a fast disk")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--n-layer", type=int, default=20)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--sub-group-size", type=int, default=20_000_000)
    p.add_argument("--buffer-count", type=int, default=3)
    p.add_argument("--out", help="also write the JSON object to this file")
    return p.parse_args(argv)


def _io(engine) -> tuple[int, int]:
    stores = [engine.zero.store.swapper.store, engine.zero.param_swapper.store]
    return sum(s.bytes_read for s in stores), sum(s.bytes_written for s in stores)


def main(args) -> dict:
    zerostack.init_distributed("gloo")
    cfg = GPTConfig(
        block_size=args.block_size,
        n_layer=args.n_layer,
        d_model=args.d_model,
        n_head=args.n_head,
        bias=False,
    )
    nvme = {"device": "nvme", "nvme_path": args.nvme_path, "buffer_count": args.buffer_count}
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": args.sub_group_size,
            "offload_param": nvme,
            "offload_optimizer": nvme,
        },
    }
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with zerostack.zero.Init(remote_device="nvme", config_dict_or_path=config):
        model = GPT(cfg)
    engine, *_ = zerostack.initialize(model=model, config=config)
    setup_s = time.perf_counter() - t0
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = []
    for i in range(args.steps):
        g = torch.Generator().manual_seed(100 * rank + i)
        t = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.block_size + 1), generator=g)
        read0, written0 = _io(engine)
        t0 = time.perf_counter()
        loss = engine(t[:, :-1], t[:, 1:])
        engine.backward(loss)
        engine.step()
        read1, written1 = _io(engine)
        steps.append(
            {
                "seconds": round(time.perf_counter() - t0, 2),
                "loss": round(loss.item(), 4),
                "bytes_read": read1 - read0,
                "bytes_written": written1 - written0,
            }
        )
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024])
    per_rank = [torch.zeros_like(rss) for _ in range(world)]
    dist.all_gather(per_rank, rss)
    host_peak = engine.zero.host_meter.peak
    engine.destroy()
    params = cfg.num_params
    out = {
        "benchmark": "infinity",
        "model": vars(cfg),
        "parameters": params,
        "world_size": world,
        "model_state_bytes": 16 * params,
        "peak_rss_bytes_per_rank": [int(r) for r in per_rank],
        "peak_rss_bytes_job": int(sum(per_rank)),
        "model_state_over_job_rss": round(16 * params / int(sum(per_rank)), 2),
        "offloaded_state_in_memory_peak_bytes": host_peak,
        "setup_seconds": round(setup_s, 1),
        "steps": steps,
        "torch": torch.__version__,
    }
    if rank == 0:
        emit(out, args.out)
    zerostack.shutdown()
    return out


if __name__ == "__main__":
    main(_args())
