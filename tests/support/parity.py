"""Scale-sensitive parity: an engine on some layout against single-process training, step by step.

Nothing here clips gradients: clipping divides the gradient by its own norm and so cancels every
constant factor (1/dp, 1/gas, the fp16 unscale) that a parity test exists to check. Each run
records, after every optimizer step, the full parameters and ``engine.get_global_grad_norm()``;
the reference records the same from one process training on the whole global batch.

Plain SGD (no momentum, no weight decay) makes the update proportional to the gradient, so a
wrong factor in the gradient moves the parameters by that factor times the update;
``SGD_LR`` is chosen so that a x2 error moves them by far more than the 1e-5 tolerance
(``test_parity.test_tolerance_rejects_a_x2_gradient``). AdamW divides the gradient by its own
running scale and hides such factors in the parameters: there the per-step gradient norm catches
them.

A case is a dict: ``stage``, ``optimizer`` ("sgd" | "adamw" | "lion" | "adagrad" | "muon" |
"lamb"),
``gas``,
and optionally ``tp``, ``pp``, ``offload`` ("cpu" | "nvme"), ``precision`` ("fp16" | "bf16"),
``loss_scale``.
"""

from __future__ import annotations

import functools
import os

import torch

import zerostack
from zerostack import Topology
from zerostack.config.optim import MuonParams
from zerostack.models import GPT, GPTConfig
from zerostack.optim import Lamb, Lion, Muon
from zerostack.optim.muon import muon_groups

from tests.support.models import batch

# 4 heads so that tp = 2 splits them; 2 blocks so that pp = 2 puts one on each stage; no biases
# (see common.TINY).
CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, d_model=32, bias=False)
STEPS = 3
B = 8  # sequences per micro-step window, over all dp ranks; a step is B * gas sequences
SGD_LR = 0.5
ADAMW = {"lr": 1e-3, "weight_decay": 0.01}
LION = {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}
ADAGRAD = {"lr": 0.05, "lr_decay": 0.01, "weight_decay": 0.01, "initial_accumulator_value": 0.1}
MUON = {"muon_lr": 0.02, "adam_lr": 1e-3, "momentum": 0.9, "weight_decay": 0.01}
LAMB = {"lr": 0.02, "betas": (0.9, 0.99), "weight_decay": 0.01, "max_coeff": 2.0}


def _model(topology: Topology | None = None) -> GPT:
    torch.manual_seed(0)
    return GPT(CFG, topology=topology)


def _opt_config(name: str) -> dict:
    if name == "sgd":
        return {"type": "SGD", "params": {"lr": SGD_LR, "momentum": 0.0}}
    if name == "lion":
        return {"type": "Lion", "params": {**LION, "betas": list(LION["betas"])}}
    if name == "adagrad":
        return {"type": "Adagrad", "params": dict(ADAGRAD)}
    if name == "muon":
        return {"type": "Muon", "params": dict(MUON)}
    if name == "lamb":
        return {"type": "Lamb", "params": {**LAMB, "betas": list(LAMB["betas"])}}
    return {"type": "AdamW", "params": dict(ADAMW)}


class _PipelineNames:
    """A plain GPT seen under its pipeline module's parameter names (Muon's rule reads names:
    the tied embedding is ``tied_modules.embed.wte.weight`` there, an "embed", so Adam's)."""

    def __init__(self, model: GPT) -> None:
        self.model = model

    def named_parameters(self):
        from zerostack.models.gpt_pipe import pipeline_name

        return ((pipeline_name(n, CFG), p) for n, p in self.model.named_parameters())


def _torch_optimizer(name: str, params, model=None, pipeline=False) -> torch.optim.Optimizer:
    """The single process's optimizer. Lion and Muon are zerostack's (torch has neither): their
    updates are held to DeepSpeed's in tests/test_ds_optimizers.py and tests/test_muon.py; here
    the sharding is on trial (Muon's whole matrices, put together from pieces; its parameters
    tagged by the names they have in the pipeline module when ``pipeline``)."""
    if name == "muon":
        named = _PipelineNames(model) if pipeline else model
        groups = muon_groups(named, [{"params": list(params)}], MuonParams(**MUON))
        return Muon(groups)
    if name == "lamb":
        return Lamb(params, **LAMB)
    if name == "sgd":
        return torch.optim.SGD(params, lr=SGD_LR, momentum=0.0)
    if name == "lion":
        return Lion(params, **LION)
    if name == "adagrad":
        return torch.optim.Adagrad(params, **ADAGRAD)
    return torch.optim.AdamW(params, **ADAMW)


def global_norm(grads) -> float:
    return float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads])))


@functools.cache
def reference(optimizer: str, gas: int, grad_factor: float = 1.0, pipeline: bool = False):
    """Single-process fp32 training: per step, (parameters after it, gradient norm).

    ``grad_factor`` multiplies the gradient before the step (to show what a scale bug does);
    ``pipeline``: Muon's parameters tagged by their pipeline names."""
    model = _model()
    opt = _torch_optimizer(optimizer, model.parameters(), model, pipeline)
    out = []
    for step in range(STEPS):
        x, y = batch(step, B * gas)
        model(x, y).backward()
        norm = global_norm([p.grad for p in model.parameters()])
        for p in model.parameters():
            p.grad.mul_(grad_factor)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(({k: v.detach().clone() for k, v in model.named_parameters()}, norm))
    return out


@functools.cache
def mixed_reference(optimizer: str, gas: int, dtype: torch.dtype, loss_scale: float):
    """Single-process mixed precision, written here and not taken from the library: the model
    computes in ``dtype``; the loss is multiplied by ``loss_scale / gas`` per micro-batch (the
    same B-sequence micro-batches the engine runs, summed over its dp ranks) and its gradients
    accumulate in ``dtype``; they are unscaled in fp32 and step fp32 master weights, which are
    cast back into the model. Per step: (fp32 masters after it, gradient norm)."""
    model = _model()
    masters = [p.detach().clone() for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    model.to(dtype)
    opt = _torch_optimizer(optimizer, [torch.nn.Parameter(m) for m in masters])
    shadow = opt.param_groups[0]["params"]
    out = []
    for step in range(STEPS):
        x, y = batch(step, B * gas)
        for m in range(gas):
            lo = m * B
            loss = model(x[lo : lo + B], y[lo : lo + B])
            (loss.float() * (loss_scale / gas)).backward()
        grads = [p.grad.float() / loss_scale for p in model.parameters()]
        out.append(step_masters(model, shadow, names, opt, grads))
    return out


def step_masters(model, shadow: list, names: list[str], opt, grads: list) -> tuple[dict, float]:
    """The fp32 masters ``shadow`` (``opt``'s) take ``grads``, step, and are cast back into the
    16-bit ``model``: (the masters after the step by name, the gradient norm)."""
    norm = global_norm(grads)
    for s, g in zip(shadow, grads, strict=True):
        s.grad = g
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p, s in zip(model.parameters(), shadow, strict=True):
            p.copy_(s)
    return {n: s.detach().clone() for n, s in zip(names, shadow, strict=True)}, norm


def _config(case: dict, micro: int, nvme_root: str | None) -> dict:
    zero = {
        "stage": case["stage"],
        "reduce_bucket_size": 5000,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 3000,
    }
    if "reduce_scatter" in case:
        zero["reduce_scatter"] = case["reduce_scatter"]
    if case.get("offload"):
        offload = {"device": case["offload"]}
        if case["offload"] == "nvme":
            offload.update(nvme_path=nvme_root, buffer_count=2)
        zero.update(offload_optimizer=offload, sub_group_size=5000)
        if case["stage"] == 3:
            zero["offload_param"] = dict(offload)
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": case["gas"],
        "gradient_clipping": 0.0,
        "optimizer": _opt_config(case["optimizer"]),
        "zero_optimization": zero,
    }
    if case.get("precision") == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": case.get("loss_scale", 1024.0)}
    elif case.get("precision") == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _run_plain(case: dict, nvme_root: str | None):
    topo = Topology.build(tp=case.get("tp", 1))
    model = _model(topology=topo if topo.tp > 1 else None)
    gas, dp = case["gas"], topo.dp
    per = B // dp
    engine, *_ = zerostack.initialize(
        model=model, topology=topo, config=_config(case, per, nvme_root)
    )
    out = []
    for step in range(STEPS):
        x, y = batch(step, B * gas)
        for m in range(gas):
            lo = m * B + topo.dp_rank * per
            engine.backward(engine(x[lo : lo + per], y[lo : lo + per]))
            engine.step()
        out.append((engine.full_state_dict(), engine.get_global_grad_norm()))
    engine.destroy()
    return out


def _run_pipeline(case: dict, nvme_root: str | None):
    from zerostack.models.gpt_pipe import GPTLoss, gpt_layers, load_plain_state, plain_name
    from zerostack.pipeline import PipelineModule

    topo = Topology.build(pp=case["pp"], tp=case.get("tp", 1))
    model = PipelineModule(
        gpt_layers(CFG, topology=topo),
        topology=topo,
        loss_fn=GPTLoss(topo),
        partition_method="type:Block",
    )
    load_plain_state(model, _model().state_dict(), CFG)
    gas, dp = case["gas"], topo.dp
    per = B // dp
    engine, *_ = zerostack.initialize(model=model, config=_config(case, per, nvme_root))

    def micro_batches(step):
        x, y = batch(step, B * gas)
        for m in range(gas):
            lo = m * B + topo.dp_rank * per
            yield x[lo : lo + per], y[lo : lo + per]

    out = []
    for step in range(STEPS):
        engine.train_batch(micro_batches(step))
        state = {plain_name(k, CFG): v for k, v in engine.full_state_dict().items()}
        out.append((state, engine.get_global_grad_norm()))
    return out


def run_cases(rank: int, world: int, cases: list[dict], nvme_root: str | None = None):
    """Every case on this rank's engine (a fresh one each); per case, per step (state, norm).
    Under a pipeline each stage returns its own parameters; the caller merges them."""
    results = []
    for i, case in enumerate(cases):
        root = None
        if nvme_root is not None:
            root = os.path.join(nvme_root, f"case{i}")
            os.makedirs(root, exist_ok=True)
        run = _run_pipeline if case.get("pp", 1) > 1 else _run_plain
        results.append(run(case, root))
    return results


def merge_stages(per_rank: list) -> list:
    """Per case, per step: one state with every rank's parameters (first writer wins: the tied
    embedding is equal on every stage) and the norm of rank 0."""
    merged = []
    for c in range(len(per_rank[0])):
        steps = []
        for s in range(len(per_rank[0][c])):
            state: dict = {}
            for rank_result in per_rank:
                for k, v in rank_result[c][s][0].items():
                    state.setdefault(k, v)
            steps.append((state, per_rank[0][c][s][1]))
        merged.append(steps)
    return merged


def describe(case: dict) -> str:
    parts = [f"stage {case['stage']}", case["optimizer"], f"gas {case['gas']}"]
    for key in ("tp", "pp"):
        if case.get(key, 1) > 1:
            parts.append(f"{key} {case[key]}")
    for key in ("offload", "precision"):
        if case.get(key):
            parts.append(str(case[key]))
    if "reduce_scatter" in case:
        parts.append(f"reduce_scatter {case['reduce_scatter']}")
    return ", ".join(parts)
