"""Whether an ALST (Ulysses sequence parallel) step applies the true gradient: the DeepSpeed ALST
tutorial's training script at sp 2 under zerostack and under DeepSpeed 0.19.8 (when its peer venv
is there, ../shared/PEERS.md, at .peers), at ZeRO stages 0, 1, 2, 3 and 3 with
``"reduce_scatter": false``, against one process of plain PyTorch on the whole sequences.

    python benchmarks/alst_gradients.py --out alst_gradients.json
    python benchmarks/alst_gradients.py --sides zerostack_z1,deepspeed_z1

The script (each side its own torchrun launch, two ranks, sp 2, dp 1; only the import differs):
``register_with_transformers``, ``initialize(mpu=...)``, ``UlyssesSPDataLoaderAdapter``, the
tutorial's loss weighted by labelled tokens over the sp ranks with
``torch.distributed.nn.functional.all_gather``, ``engine.backward``, ``engine.step``; torch's SGD
at lr 0.5, no clipping, micro batch 1, a 2-layer Llama (hidden 64, 4 heads, 2 kv heads, vocab 64,
``torch.manual_seed(0)`` before it is built). Every rank's loader yields the same 3 batches of 64
tokens; the adapter gathers one batch from each sp rank and serves them in rank order, so the
steps see B0 B0 B1 B1 B2 B2, and the reference trains on that sequence.

Per side and step: the loss; ``engine.get_global_grad_norm()`` over the reference's gradient norm;
the applied update's norm over lr (full fp32 weights before and after the step: zerostack's
``engine.full_state_dict()``, DeepSpeed's ``safe_get_full_fp32_param``) over the reference's.
A side's verdict is "exact" when every ratio is within 1e-5 of 1. Otherwise its weights leave the
reference's after step 0, so its ratios are also taken against the reference replayed applying m
times its gradient, m the side's step-0 applied ratio (``scaled_reference``; ``every_step``: each
ratio within 1e-5 of m), and the verdict is the median of those ratios.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import deepspeed_api, emit, run_side  # noqa: E402  benchmarks/_bench.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.path.join(ROOT, ".peers", "bin", "python")
ZERO = {"z0": {"stage": 0}, "z1": {"stage": 1}, "z2": {"stage": 2}, "z3": {"stage": 3},
        "z3_nors": {"stage": 3, "reduce_scatter": False}}  # fmt: skip
SIDES = {f"{impl}_{z}": (impl, z) for impl in ("zerostack", "deepspeed") for z in ZERO}
SP, LR, SEQ, BATCHES, TOL = 2, 0.5, 64, 3, 1e-5


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sides", default=",".join(SIDES), help="comma-separated: " + ", ".join(SIDES))
    p.add_argument("--out", help="also write the JSON object to this file")
    p.add_argument("--side-timeout", type=float, default=1800)
    p.add_argument("--side", help=argparse.SUPPRESS)  # set by the parent for one child launch
    return p.parse_args(argv)


def _batches() -> list[dict]:
    out = []
    for i in range(BATCHES):
        ids = torch.randint(0, 64, (SEQ,), generator=torch.Generator().manual_seed(1000 + i))
        out.append({"input_ids": ids, "position_ids": torch.arange(SEQ), "labels": ids.clone()})
    return out


def _model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                         max_position_embeddings=SEQ)  # fmt: skip
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _norm(tensors) -> float:
    return math.sqrt(sum(t.double().pow(2).sum().item() for t in tensors))


def _child(args) -> None:
    import torch.distributed.nn  # differentiable all_gather

    impl, zero = SIDES[args.side]
    deepspeed, ulysses_sp = deepspeed_api(impl, ROOT)
    utils = importlib.import_module(deepspeed.__name__ + ".utils")
    groups = utils.groups
    model = _model()
    mpu = ulysses_sp.UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=SP,
        micro_batch_size=1, seq_length=SEQ, seq_length_is_variable=True)  # fmt: skip
    # zero_allow_untested_optimizer: DeepSpeed's ZeRO refuses torch's SGD without it
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
              "sequence_parallel_size": SP, "zero_optimization": ZERO[zero],
              "optimizer": {"type": "SGD", "params": {"lr": LR}},
              "zero_allow_untested_optimizer": True}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, config=config, mpu=mpu,
                                      model_parameters=model.parameters())  # fmt: skip
    sp_group = groups._get_sequence_parallel_group()
    sp_world_size = groups._get_sequence_parallel_world_size()
    sp_rank = groups._get_sequence_parallel_rank()
    dl = torch.utils.data.DataLoader(_batches(), batch_size=1, shuffle=False)
    dl = ulysses_sp.UlyssesSPDataLoaderAdapter(
        dl, sp_rank=sp_rank, sp_group=sp_group, sp_world_size=sp_world_size, device=engine.device
    )
    named = dict(model.named_parameters())

    def weights() -> dict[str, torch.Tensor]:  # a collective under ZeRO-3
        if impl == "zerostack":
            full = engine.full_state_dict()
        else:  # None where no ZeRO optimizer holds the parameter (stage 0): it is fp32 itself
            full = {n: utils.safe_get_full_fp32_param(p) for n, p in named.items()}
            full = {n: named[n] if t is None else t for n, t in full.items()}
        return {n: t.detach().cpu().to(torch.float64, copy=True) for n, t in full.items()}

    engine.train()
    steps = []
    for batch in dl:
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        before = weights()
        shift_labels = batch.pop("shift_labels")
        outputs = engine(**batch, use_cache=False)
        loss = engine.module.loss_function(logits=outputs.logits, labels=None,
                                           shift_labels=shift_labels,
                                           vocab_size=engine.module.config.vocab_size)  # fmt: skip
        # the tutorial's aggregation: each rank's mean weighted by its labelled tokens
        losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
        good_tokens = (shift_labels != -100).view(-1).sum()
        good_tokens_per_rank = torch.distributed.nn.functional.all_gather(
            good_tokens, group=sp_group
        )
        total_loss = sum(losses_per_rank[r] * good_tokens_per_rank[r]
                         for r in range(sp_world_size))  # fmt: skip
        loss = total_loss / max(sum(good_tokens_per_rank), 1)
        engine.backward(loss)
        engine.step()
        norm = engine.get_global_grad_norm()
        after = weights()
        steps.append({"loss": loss.item(), "grad_norm": None if norm is None else float(norm),
                      "applied": _norm(after[n] - before[n] for n in before) / LR})  # fmt: skip
    if torch.distributed.get_rank() == 0:
        print(json.dumps({"steps": steps}), flush=True)
    if impl == "deepspeed":  # a gloo thread can abort DeepSpeed's interpreter exit (PEERS.md)
        torch.distributed.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    engine.destroy()


def _reference(scale: float = 1.0) -> list[dict]:
    """Plain PyTorch, one process, the whole sequences in the adapter's order; each step applies
    ``scale`` times the gradient (``grad_norm`` and ``applied`` are still the true gradient's)."""
    model = _model()
    model.train()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR)
    steps = []
    for b in [b for b in _batches() for _ in range(SP)]:
        before = [p.detach().to(torch.float64, copy=True) for p in params]
        loss = model(**{k: v[None] for k, v in b.items()}, use_cache=False).loss
        loss.backward()
        grad = _norm(p.grad for p in params)
        for p in params:
            p.grad.mul_(scale)
        opt.step()
        opt.zero_grad(set_to_none=True)
        moved = _norm(p.detach().double() - w for p, w in zip(params, before, strict=True))
        steps.append({"loss": loss.item(), "grad_norm": grad, "applied": moved / LR / scale})
    return steps


def _ratios(steps: list[dict], ref: list[dict]) -> tuple[list, list]:
    """Per step (grad-norm ratio, None without a norm; applied ratio) against ``ref``."""
    pairs = list(zip(steps, ref, strict=False))  # a short side: noted by _compare
    grad = [None if s["grad_norm"] is None else s["grad_norm"] / r["grad_norm"] for s, r in pairs]
    return grad, [s["applied"] / r["applied"] for s, r in pairs]


def _compare(side: dict, refs) -> dict:
    """The side's ratios against the reference (``refs(1.0)``) and its verdict. A side off at
    step 0 trains other weights from then on, so its ratios are also taken against
    ``refs(m)``, the reference applying m times its gradient, m the side's step-0 applied ratio:
    if the side applies m times the true gradient at every step, each of those ratios is m."""
    if "steps" not in side:  # an error, skipped, not run
        return side
    ref, steps = refs(1.0), side["steps"]
    grad, applied = _ratios(steps, ref)
    out = {"losses": [s["loss"] for s in steps], "grad_norms": [s["grad_norm"] for s in steps],
           "applied_norms": [s["applied"] for s in steps], "grad_ratios": grad,
           "applied_ratios": applied}  # fmt: skip
    ratios = [x for x in grad + applied if x is not None]
    m = round(applied[0], 6) if applied else 0.0
    if len(steps) == len(ref) and all(abs(x - 1) <= TOL for x in ratios):
        out["verdict"] = "exact"
    elif m > 0:
        grad, applied = _ratios(steps, refs(m))
        ratios = [x for x in grad + applied if x is not None]
        every = all(abs(x - m) <= TOL * m for x in ratios)
        out["scaled_reference"] = {"multiplier": m, "grad_ratios": grad,
                                   "applied_ratios": applied, "every_step": every}  # fmt: skip
        out["verdict"] = round(statistics.median(ratios), 6)
    else:
        out["verdict"] = round(statistics.median(ratios), 6) if ratios else None
    if len(steps) != len(ref):
        out["note"] = f"{len(steps)} steps, the reference {len(ref)}"
    elif None in out["grad_norms"]:
        out["note"] = "get_global_grad_norm() is None: the verdict is on the applied ratios"
    return out


def main(argv=None) -> dict:
    args = _args(argv)
    if args.side:
        _child(args)
        return {}
    refs: dict[float, list[dict]] = {}

    def ref(scale: float) -> list[dict]:
        if scale not in refs:
            refs[scale] = _reference(scale)
        return refs[scale]

    results = {}
    for side in args.sides.split(","):
        impl, zero = SIDES[side]
        got = run_side(__file__, SP, sys.argv[1:], side, impl, PEERS, args.side_timeout)
        if "skipped" in got:
            results[side] = got
            continue
        if impl == "deepspeed" and zero == "z0" and "error" in got:
            got = {"not_run": f"DeepSpeed refuses stage 0 here: {got['error']}"}
        results[side] = _compare(got, ref)
        print(f"{side}: {json.dumps(results[side])}", file=sys.stderr, flush=True)
    verdicts = {s: r.get("verdict", next(iter(r.values()))) for s, r in results.items()}
    out = {"sp": SP, "lr": LR, "seq": SEQ, "tolerance": TOL, "reference": ref(1.0),
           "sides": results, "verdicts": verdicts}  # fmt: skip
    return emit(out, args.out)


if __name__ == "__main__":
    main()
