"""The longest sequence a Hugging Face Llama trains on within a fixed memory budget per rank:
one rank plain, Ulysses, ring attention and Ulysses x ring at sp 2 and 4, with and without the
tiled MLP and logits loss and CPU activation checkpoints, and DeepSpeed 0.19.8's ALST (Ulysses,
tiled) on the same model and budget when its peer venv is there (../shared/PEERS.md, at .peers);
then tokens/s of each at one common length.

    python benchmarks/long_context.py                          # every side, budget 128 MiB
    python benchmarks/long_context.py --sides plain,ulysses4_alst,ring4_alst --budget-mib 96

Each side is its own torchrun launch; zerostack's and DeepSpeed's run the same script, the ALST
tutorial's code with the import changed (``register_with_transformers``, the data loader
adapter, ``initialize(mpu=...)``, the loss weighted by labelled tokens over the sp ranks; tiled:
``TiledMLP`` patched into the Llama MLP as ArcticTraining's ``enable_tiled_mlp_compute`` does and
``TiledFusedLogitsLoss`` over the base model's hidden states; checkpoints:
``gradient_checkpointing_enable()``, and to keep them in host memory ``"cpu_checkpointing":
true``, zerostack only: DeepSpeed's key does not reach a Hugging Face model's checkpoints).

The memory of a length: the peak, over one forward and backward, of the bytes of tensor storage
made during them and still alive, on the rank where it is largest: activations saved for
backward, the logits, attention's transients, and what any length takes (gathered ZeRO-3
weights, gradients, buffers made in the step; ``base_mib``, the peak at the shortest length).
Memory held before the step (the weights' shards, optimizer state) is not in it. It is counted
where torch hands out storage (a ``TorchDispatchMode`` sees every op's outputs; a storage's bytes
are freed when torch frees it), not by the library measured. What CPU
checkpointing puts in host memory (``zerostack.checkpointing.host_empty``) is not counted: on a
GPU it is not the device's. Lengths double from ``--first-len`` while the peak stays within the
budget, then a bisection finds the longest to 1/8 of the last doubling.

On this machine the ranks share 2 cores, so the tokens/s compare the sides' arithmetic and
exchanges here, not separate devices; memory is per rank and exact.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import deepspeed_api, emit, run_side  # noqa: E402  benchmarks/_bench.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.path.join(ROOT, ".peers", "bin", "python")
# name: (ranks, sp, ring, tiled MLP and loss, activation checkpoints, implementation); the
# checkpoints: "" none, "device" the layers' (Hugging Face's gradient checkpointing, torch's
# checkpoint), "host" the same kept in host memory (zerostack's cpu_checkpointing)
SIDES = {
    "plain": (1, 1, 1, False, "", "zerostack"),
    "plain_alst": (1, 1, 1, True, "host", "zerostack"),
    "ulysses2": (2, 2, 1, False, "", "zerostack"),
    "ring2": (2, 2, 2, False, "", "zerostack"),
    "ulysses4": (4, 4, 1, False, "", "zerostack"),
    "ring4": (4, 4, 4, False, "", "zerostack"),
    "ulysses2_ring2": (4, 4, 2, False, "", "zerostack"),
    "ulysses4_tiled": (4, 4, 1, True, "", "zerostack"),
    "ulysses4_tiled_ckpt": (4, 4, 1, True, "device", "zerostack"),
    "ulysses4_alst": (4, 4, 1, True, "host", "zerostack"),
    "ring4_alst": (4, 4, 4, True, "host", "zerostack"),
    "ulysses2_ring2_alst": (4, 4, 2, True, "host", "zerostack"),
    "deepspeed_ulysses4": (4, 4, 1, False, "", "deepspeed"),
    "deepspeed_ulysses4_tiled": (4, 4, 1, True, "", "deepspeed"),
    "deepspeed_ulysses4_tiled_ckpt": (4, 4, 1, True, "device", "deepspeed"),
}
LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 2, 256, 1024, 8, 4, 8192  # vocab / hidden: 32


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops make while the mode is on and torch has not yet freed, and
    their peak; storages in ``skip`` (host memory) and those of an op's own arguments (views,
    in-place and out= results: made before) are left out."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__()
        self.skip, self.live, self.peak, self.seen = skip, 0, 0, set()

    def _free(self, key: int, n: int) -> None:
        self.seen.discard(key)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # an output on an argument's storage (a view, an in-place or out= op) is not new memory
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                 if isinstance(t, torch.Tensor) and t.device.type != "meta"}  # fmt: skip
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if not key or key in self.seen or key in self.skip or key in given:
                continue
            self.seen.add(key)
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(st, self._free, key, st.nbytes())
        return out


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sides", default=",".join(SIDES), help="comma-separated: " + ", ".join(SIDES))
    p.add_argument("--budget-mib", type=float, default=128.0)
    p.add_argument("--first-len", type=int, default=256, help="first length tried (global tokens)")
    p.add_argument("--max-len", type=int, default=65536)
    p.add_argument("--common", type=int, default=2048, help="length of the tokens/s runs")
    p.add_argument("--steps", type=int, default=3, help="timed steps at --common")
    p.add_argument("--out", help="also write the JSON object to this file")
    p.add_argument("--side-timeout", type=float, default=3600)
    p.add_argument("--side", help=argparse.SUPPRESS)  # set by the parent for one child launch
    return p.parse_args(argv)


def _tile_mlps(ulysses_sp) -> None:
    """ArcticTraining's enable_tiled_mlp_compute: the Llama MLP as a TiledMLP, one tile per
    ``hidden`` positions of the rank's shard."""
    from transformers.models.llama import modeling_llama

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def tiled(self, x):
        shards = max(1, math.ceil(x.shape[-2] / x.shape[-1]))
        params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
        return ulysses_sp.TiledMLP.apply(mlp_forward, self, x, shards, params)

    modeling_llama.LlamaMLP.forward = tiled


def _logits_loss(model, x, y):
    return torch.nn.functional.cross_entropy(
        model.lm_head(x).float().flatten(0, -2), y.flatten(), reduction="sum"
    )


def _child(args) -> None:
    ranks, sp, ring, tiled, cpu, impl = SIDES[args.side]
    deepspeed, ulysses_sp = deepspeed_api(impl, ROOT)
    from transformers import AutoModelForCausalLM, LlamaConfig

    if tiled:
        _tile_mlps(ulysses_sp)
    host: set[int] = set()
    if cpu == "host":  # what cpu_checkpointing keeps in host memory is not the device's
        from zerostack import activation_checkpointing

        real = activation_checkpointing.host_empty

        def tagged(numel, dtype):
            with _disable_current_modes():  # made out of the census's sight
                t = real(numel, dtype)
            host.add(t.untyped_storage().data_ptr())  # and its copies into it too
            return t

        activation_checkpointing.host_empty = tagged
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=FFN,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         vocab_size=VOCAB, max_position_embeddings=args.max_len)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3}}  # fmt: skip
    if impl == "deepspeed":  # its ZeRO refuses torch's SGD without this
        cfg["zero_allow_untested_optimizer"] = True
    if cpu:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cpu == "host":
        cfg["activation_checkpointing"] = {"cpu_checkpointing": True}
    mpu = None
    if sp > 1:
        cfg["sequence_parallel_size"] = sp
        extra = {"ring_parallel_size": ring} if ring > 1 else {}
        mpu = ulysses_sp.UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa",
            sequence_parallel_size=sp, micro_batch_size=1, seq_length_is_variable=True, **extra
        )  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, config=cfg, mpu=mpu,
                                      model_parameters=model.parameters())  # fmt: skip
    group = mpu.get_sequence_parallel_group() if mpu is not None else dist.group.WORLD
    rank = dist.get_rank()

    def step(length: int, mode: TorchDispatchMode | None) -> None:
        g = torch.Generator().manual_seed(length + rank)
        ids = torch.randint(0, VOCAB, (1, length), generator=g)
        batch = {"input_ids": ids, "position_ids": torch.arange(length)[None], "labels": ids}
        if sp > 1:
            batch = next(iter(ulysses_sp.UlyssesSPDataLoaderAdapter(
                [batch], rank, group, sp, engine.device)))  # fmt: skip
            labels = batch.pop("shift_labels")
        else:
            labels = torch.nn.functional.pad(batch.pop("labels"), (0, 1), value=-100)[:, 1:]
        with mode if mode is not None else _nothing():
            if tiled:
                hidden = engine.module.model(**batch).last_hidden_state
                shards = max(1, math.ceil(hidden.shape[1] / HIDDEN))
                total = ulysses_sp.TiledFusedLogitsLoss.apply(
                    _logits_loss, engine.module, hidden, labels, None, shards,
                    [engine.module.lm_head.weight], "sum")  # fmt: skip
            else:
                logits = engine(**batch).logits
                total = torch.nn.functional.cross_entropy(
                    logits.float().flatten(0, -2), labels.flatten(), reduction="sum")  # fmt: skip
            good = (labels != -100).sum()
            totals = torch.distributed.nn.functional.all_gather(total, group=group)
            goods = torch.distributed.nn.functional.all_gather(good, group=group)
            engine.backward(sum(totals) / sum(goods))
        engine.step()

    def peak(length: int) -> int:
        mode = LiveBytes(host)
        step(length, mode)
        top = torch.tensor([mode.peak], dtype=torch.float64)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        return int(top.item())

    unit = 64 * sp  # lengths stay divisible by 2 * ring and by sp
    budget = args.budget_mib * 2**20
    step(unit, None)  # first-step allocations (optimizer state, buffers) are not a length's
    base = peak(unit)  # what any length takes: gathered ZeRO-3 weights, their gradients, buffers
    seen: dict[int, int] = {}
    good, bad, length = None, None, max(unit, args.first_len // unit * unit)
    while length <= args.max_len:
        seen[length] = peak(length)
        if seen[length] > budget:
            bad = length
            break
        good, longer = length, min(length * 2, args.max_len // unit * unit)  # at most --max-len
        if longer <= length:
            break
        length = longer
    if good is not None and bad is not None:
        for _ in range(3):
            mid = (good + bad) // 2 // unit * unit
            if mid in (good, bad):
                break
            seen[mid] = peak(mid)
            good, bad = (mid, bad) if seen[mid] <= budget else (good, mid)
    common = args.common // unit * unit
    step(common, None)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step(common, None)
    dist.barrier()
    seconds = (time.perf_counter() - t0) / args.steps
    if rank == 0:
        print(json.dumps({
            "ranks": ranks, "sp": sp, "ring": ring, "tiled": tiled, "checkpoints": cpu,
            "impl": impl, "base_mib": _mib(base), "longest": good,
            "longest_peak_mib": _mib(seen.get(good)),
            "first_over": bad, "peaks_mib": {str(k): _mib(v) for k, v in sorted(seen.items())},
            "common_length": common, "tokens_per_s": round(common / seconds, 1),
        }), flush=True)  # fmt: skip
    if impl == "deepspeed":  # a gloo thread can abort DeepSpeed's interpreter exit (PEERS.md)
        sys.stdout.flush()
        os._exit(0)
    engine.destroy()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _mib(n: int | None) -> float | None:
    return None if n is None else round(n / 2**20, 2)


def main(argv=None) -> dict:
    args = _args(argv)
    if args.side:
        _child(args)
        return {}
    results = {}
    for side in args.sides.split(","):
        ranks, *_, impl = SIDES[side]
        results[side] = run_side(__file__, ranks, sys.argv[1:], side, impl, PEERS,
                                 args.side_timeout)  # fmt: skip
        print(f"{side}: {json.dumps(results[side])}", file=sys.stderr, flush=True)
    base = results.get("plain", {}).get("longest")
    ratios = {s: round(r["longest"] / base, 2) for s, r in results.items()
              if base and r.get("longest")}  # fmt: skip
    ds = results.get("deepspeed_ulysses4_tiled_ckpt", {}).get("longest")
    out = {"budget_mib": args.budget_mib, "model": {"layers": LAYERS, "hidden": HIDDEN,
           "ffn": FFN, "heads": HEADS, "kv_heads": KV_HEADS, "vocab": VOCAB},
           "sides": results, "longest_over_plain": ratios,
           "over_deepspeed_tiled_ckpt": {s: round(r["longest"] / ds, 2) for s, r in results.items()
                                    if ds and r.get("longest")}}  # fmt: skip
    return emit(out, args.out)


if __name__ == "__main__":
    main()
