"""The same DeepSpeed-style script under zerostack and under DeepSpeed: do the loss curves agree?

    python benchmarks/deepspeed_curve.py --peer-python .peers/bin/python   # see shared/PEERS.md

One script, ``import zerostack as deepspeed`` or ``import deepspeed``, nothing else changed: a
byte-level MLP language model (pure torch, the same code under both), the engine's own data loader
from ``initialize(training_data=...)``, ZeRO stage 0, dp 2, AdamW, 30 steps. Each rank prints the
mean loss over dp every step and the final next-byte accuracy on held-out windows. Runs:
zerostack with the default seed, zerostack with ``"seed": 42`` (the old default), DeepSpeed; each
with the optimizer from the config block and with one torch AdamW passed by the script; and, as
the yardstick for both, the same training as a hand-written torch DDP loop.
Output: one JSON line with the curves, the largest per-step relative difference of each
zerostack run from DeepSpeed's, and the accuracies.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
CORPUS = os.path.join(ROOT, "src", "zerostack", "demo", "genesis.txt")
CONTEXT, STEPS = 16, 30


def _worker(backend: str, seed: int | None, client_optimizer: bool, bucket: int | None) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    if backend == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    elif backend == "zerostack":
        import zerostack as deepspeed
    else:
        dist.init_process_group("gloo")

    data = torch.tensor(list(open(CORPUS, "rb").read()), dtype=torch.long)
    windows = data[: (len(data) // (CONTEXT + 1)) * (CONTEXT + 1)].view(-1, CONTEXT + 1)
    train, held_out = windows[:4000], windows[4000:4512]
    dataset = torch.utils.data.TensorDataset(train[:, :-1], train[:, -1])

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(256, 16),
        nn.Flatten(),
        nn.Linear(16 * CONTEXT, 128),
        nn.GELU(),
        nn.Linear(128, 256),
    )
    config = {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True},
        },
        "zero_optimization": {"stage": 0},
    }
    if seed is not None:
        config["seed"] = seed
    if bucket is not None:
        config["zero_optimization"]["reduce_bucket_size"] = bucket
    optimizer = None
    if client_optimizer:  # the same torch kernel under both (each library's own otherwise)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        del config["optimizer"]
    if backend == "ddp":  # the hand-written torch loop those engines stand for
        _ddp_loop(model, dataset, held_out)
        return
    engine, _, loader, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        model_parameters=model.parameters(),
        training_data=dataset,
        config=config,
    )

    def train_step(x, y):
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss

    _loop(loader, train_step, engine, held_out)


def _ddp_loop(model, dataset, held_out) -> None:
    import torch
    from torch import nn

    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=16, sampler=sampler)
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    def train_step(x, y):
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    _loop(loader, train_step, model, held_out)


def _loop(loader, train_step, predict, held_out) -> None:
    """STEPS steps of ``train_step(x, y) -> loss`` over ``loader``; rank 0 prints the losses
    (mean over dp) and the held-out next-byte accuracy of ``predict``."""
    import torch
    import torch.distributed as dist

    losses = []
    for x, y in loader:
        mean = train_step(x, y).detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
        if len(losses) == STEPS:
            break
    with torch.no_grad():
        accuracy = float((predict(held_out[:, :-1]).argmax(-1) == held_out[:, -1]).float().mean())
    if dist.get_rank() == 0:
        print(json.dumps({"losses": losses, "accuracy": accuracy}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _run(
    python: str, backend: str, seed: int | None, client: bool, timeout: float, bucket=None
) -> dict:
    argv = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
    argv += ["--worker", backend] + ([] if seed is None else ["--seed", str(seed)])
    argv += ["--client-optimizer"] if client else []
    argv += [] if bucket is None else ["--bucket", str(bucket)]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    with tempfile.TemporaryDirectory() as cwd:  # DeepSpeed may write files where it runs
        p = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        return {"error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--worker", choices=["zerostack", "deepspeed", "ddp"], help=argparse.SUPPRESS
    )
    parser.add_argument("--seed", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--client-optimizer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bucket", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--peer-python", default=os.path.join(ROOT, ".peers", "bin", "python"))
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.seed, args.client_optimizer, args.bucket)
        return
    from _bench import emit

    peer, me, t = args.peer_python, sys.executable, args.timeout
    out: dict = {"steps": STEPS}
    # config: the optimizer from the config block (each library's own AdamW kernel; zerostack's
    # is torch's fused one); client: the script passes one torch.optim.AdamW to both.
    for mode, client in (("config_optimizer", False), ("client_optimizer", True)):
        runs = {
            "deepspeed": _run(peer, "deepspeed", None, client, t),
            "zerostack": _run(me, "zerostack", None, client, t),
            "zerostack_seed42": _run(me, "zerostack", 42, client, t),
            # the control: zerostack against itself with its gradients and masters cut into
            # other buckets, which changes nothing but where vectorised kernels round
            "zerostack_small_buckets": _run(me, "zerostack", None, client, t, bucket=3000),
            "torch_ddp": _run(me, "ddp", None, client, t),
        }
        summary = {f"{k}_accuracy": v.get("accuracy", v.get("error")) for k, v in runs.items()}
        pairs = [("zerostack", "deepspeed"), ("zerostack_seed42", "deepspeed")]
        pairs += [("zerostack_small_buckets", "zerostack"), ("zerostack", "torch_ddp")]
        pairs += [("deepspeed", "torch_ddp")]
        for name, base in pairs:
            got, ref = runs[name].get("losses"), runs[base].get("losses")
            if ref and got:
                diffs = [abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True)]
                summary[f"{name}_vs_{base}_max_rel_diff"] = max(diffs)
                summary[f"{name}_vs_{base}_first_differing_step"] = next(
                    (i for i, d in enumerate(diffs) if d > 0), None
                )
        out[mode] = {"summary": summary, "runs": runs}
    emit(out, args.out)


if __name__ == "__main__":
    main()
