"""Shared pieces of the parity tests: a tiny GPT, deterministic batches, the fp32 reference."""

from __future__ import annotations

import torch

from zerostack.demo.corpus import load_corpus
from zerostack.models import GPT, GPTConfig

# bias=False: the attention key bias has a gradient that is zero in exact arithmetic (softmax is
# invariant to adding the same number to every score of a query), so Adam turns its round-off into
# full +-lr steps that no two summation orders agree on. Every other parameter is well conditioned.
TINY = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, d_model=32, bias=False)


def tiny_gpt(seed: int = 0, cfg: GPTConfig = TINY) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def batch(step: int, size: int, block: int = TINY.block_size) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch number ``step``: ``size`` corpus windows, the same in every process."""
    tokens = load_corpus()
    g = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, tokens.numel() - block - 1, (size,), generator=g)
    x = torch.stack([tokens[s : s + block] for s in starts.tolist()])
    y = torch.stack([tokens[s + 1 : s + block + 1] for s in starts.tolist()])
    return x, y


def micro_batches(step: int, micro: int, gas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batch ``step`` (``micro * gas`` windows) cut into ``gas`` micro-batches: what a
    pipeline's ``train_batch`` reads on one dp rank."""
    x, y = batch(step, micro * gas)
    return [(x[m * micro : (m + 1) * micro], y[m * micro : (m + 1) * micro]) for m in range(gas)]


def reference_train(
    steps: int,
    global_batch: int,
    *,
    lr: float = 1e-3,
    weight_decay: float = 0.01,
    clip: float = 0.0,
    optimizer: str = "adamw",
    cfg: GPTConfig = TINY,
) -> dict[str, torch.Tensor]:
    """Single-process fp32 training on the whole batch with plain torch.optim: the golden run."""
    model = tiny_gpt(cfg=cfg)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)
    for step in range(steps):
        x, y = batch(step, global_batch)
        loss = model(x, y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest per-tensor ||a - b|| / ||b|| and the name of that tensor."""
    if a.keys() != b.keys():
        raise AssertionError(f"different keys: {sorted(a.keys() ^ b.keys())}")
    worst, name = 0.0, ""
    for k in b:
        d = float((a[k].float() - b[k].float()).norm() / b[k].float().norm().clamp_min(1e-12))
        if d > worst:
            worst, name = d, k
    return worst, name


def run_cli(*argv) -> tuple[int, str, str]:
    """``zerostack <argv>`` in this process: (exit code, stdout, stderr)."""
    import contextlib
    import io

    from zerostack import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def tiny_transformer():
    """TINY as :class:`zerostack.estimate.Transformer` describes it."""
    from zerostack.estimate import Transformer

    return Transformer.from_gpt_config(TINY)


def resume_pair(rank: int, world: int, config: dict, root: str) -> tuple:
    """On ``world`` ranks (this one ``rank``), the tiny GPT with ``config`` (2 sequences a rank):
    six steps in one run, and three, a save under ``root``, a load into other weights and three
    more. Returns the two runs' last three losses and their states at the end: the full weights
    (``param/<name>``) and each master's value and optimizer state (``master<i>/<kind>``, its
    step count too where it keeps one) as the checkpoint reads them."""
    import zerostack

    def steps(engine, first):
        out = []
        for step in range(first, first + 3):
            x, y = batch(step, 2 * world)
            loss = engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    def state(engine):
        out = {f"param/{k}": v.clone() for k, v in engine.full_state_dict().items()}
        for i, m in enumerate(engine.zero.masters()):
            for k, v in engine.zero.read_master(m, engine.optimizer).items():
                out[f"master{i}/{k}"] = v.clone()
            if "step" in engine.optimizer.state[m]:  # e.g. Adagrad's (its lr_decay reads it)
                out[f"master{i}/step"] = engine.optimizer.state[m]["step"].clone()
        return out

    whole, *_ = zerostack.initialize(model=tiny_gpt(), config=config)
    steps(whole, 0)
    uninterrupted = steps(whole, 3)
    first, *_ = zerostack.initialize(model=tiny_gpt(), config=config)
    steps(first, 0)
    first.save_checkpoint(root)
    second, *_ = zerostack.initialize(model=tiny_gpt(seed=7), config=config)
    second.load_checkpoint(root)
    resumed = steps(second, 3)
    out = uninterrupted, resumed, state(whole), state(second)
    for engine in (whole, first, second):
        engine.destroy()
    return out
