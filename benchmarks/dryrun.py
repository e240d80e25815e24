"""What a dry run and the planner's search cost as the world grows (issue 56, item 4).

For Llama-3 70B (tp 8, ZeRO-3 and ZeRO-1) and Llama-3 405B (tp 8, ZeRO-3), the real engine is
built and stepped as one rank of 64, 256, 1,024 and 4,096 ranks (``zerostack dryrun``: torch's
fake process group, the model on the meta device), each in a fresh process so its peak host
memory is its own; then ``zerostack plan``'s search over every layout of the 405B model on as
many H100s. Each row: seconds and peak RSS, the rank's model-state bytes, the activations its
forward keeps for backward (as a GPU's FlashAttention would) and one step's data-parallel
traffic, beside what ``zerostack estimate`` and the cost model say.

    python benchmarks/dryrun.py            # the table (about 2 minutes here)
    python benchmarks/dryrun.py --json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import sys
import time

WORLDS = (64, 256, 1024, 4096)
LLAMA_70B = dict(
    model_type="llama",
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
)
LLAMA_405B = dict(
    LLAMA_70B,
    hidden_size=16384,
    intermediate_size=53248,
    num_hidden_layers=126,
    num_attention_heads=128,
)
MODELS = {"llama3-70b": LLAMA_70B, "llama3-405b": LLAMA_405B}
CASES = [("llama3-70b", 3), ("llama3-70b", 1), ("llama3-405b", 3)]
TP, SEQ, GAS = 8, 8192, 1


def _one(name: str, stage: int, world: int) -> dict:
    """One dry run, in this (fresh) process, with the figures to compare."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerostack.dryrun import dry_run
    from zerostack.estimate import (
        Layout,
        Transformer,
        estimate,
        layer_activation_bytes,
        stage_activation_bytes,
    )
    from zerostack.plan.cost import Candidate, dp_traffic

    raw = MODELS[name]
    config = LlamaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    dp = world // TP
    ds = {
        "train_batch_size": dp * GAS,
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "tensor_parallel": {"autotp_size": TP},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    }
    run = dry_run(lambda: LlamaForCausalLM(config), ds, world=world, rank=world - 1, seq=SEQ)
    m = Transformer.from_hf_config(raw, SEQ)
    layout = Layout(dp=dp, tp=TP, stage=stage, precision="bf16")
    states = estimate(m.params, layout, model=m)["model_states"]
    kinds = ("params", "grads", "master", "optimizer")
    traffic = dp_traffic(m, Candidate(dp=dp, tp=TP, pp=1, stage=stage, micro_batch=1, gas=GAS))
    got = {k.split("/")[0]: v["bytes"] for k, v in run.as_dict()["collectives"].items()
           if k.endswith("/dp") and v["bytes"] > 4}  # fmt: skip
    return {
        "model": name,
        "stage": stage,
        "world": world,
        "seconds": run.seconds,
        "peak_rss_bytes": run.peak_rss_bytes,
        "model_state_bytes": sum(run.model_states[k] for k in kinds),
        "states_equal_estimate": all(run.model_states[k] == states[k] for k in kinds),
        "activation_bytes": run.activations["forward"],
        "activations_equal_estimate": run.activations
        == {
            "forward": stage_activation_bytes(m, 1, tp=TP, flash=True),
            "layer": layer_activation_bytes(m, 1, tp=TP, flash=True),
        },
        "dp_traffic_bytes": sum(got.values()),
        "traffic_equals_cost_model": got == traffic,
    }


def _child(args, queue) -> None:
    queue.put(_one(*args))


def dry_runs() -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    out = []
    for name, stage in CASES:
        for world in WORLDS:
            queue = ctx.Queue()
            p = ctx.Process(target=_child, args=((name, stage, world), queue))
            p.start()
            out.append(queue.get(timeout=600))
            p.join()
    return out


def searches() -> list[dict]:
    """The planner's search for Llama-3 405B at 8K tokens, 2,048 sequences, on H100s."""
    from zerostack.estimate import Transformer
    from zerostack.plan.hardware import PlanError, profile
    from zerostack.plan.search import search

    m = Transformer.from_hf_config(LLAMA_405B, SEQ)
    out = []
    for world in WORLDS:
        t0 = time.perf_counter()
        try:
            plan = search(m, profile("h100-80gb", gpus=world), 2048)
            found = {"considered": plan.considered, "feasible": len(plan.ranked)}
        except PlanError as exc:
            found = {"considered": None, "feasible": 0, "why": str(exc)}
        seconds = time.perf_counter() - t0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out.append({"world": world, "seconds": seconds, "peak_rss_bytes": rss, **found})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = {"dry_runs": dry_runs(), "searches": searches()}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{'model':12} {'stage':>5} {'world':>6} {'s':>6} {'RSS GB':>7} {'states GB':>10} "
          f"{'= estimate':>10} {'act GB':>7} {'= estimate':>10} {'dp GB/step':>11} "
          f"{'= cost model':>12}")  # fmt: skip
    for r in result["dry_runs"]:
        print(f"{r['model']:12} {r['stage']:>5} {r['world']:>6} {r['seconds']:6.1f} "
              f"{r['peak_rss_bytes'] / 1e9:7.2f} {r['model_state_bytes'] / 1e9:10.2f} "
              f"{str(r['states_equal_estimate']):>10} {r['activation_bytes'] / 1e9:7.2f} "
              f"{str(r['activations_equal_estimate']):>10} {r['dp_traffic_bytes'] / 1e9:11.1f} "
              f"{str(r['traffic_equals_cost_model']):>12}")  # fmt: skip
    print("the planner's search, Llama-3 405B, 8K tokens, 2,048 sequences, on H100s:")
    for r in result["searches"]:
        print(f"  {r['world']:>5} GPUs: {r['considered']} layouts, {r['feasible']} fit, "
              f"{r['seconds']:.1f} s, peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
