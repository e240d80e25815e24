"""Checkpoint folders written by real DeepSpeed 0.19.8, committed as test data
(tests/fixtures/deepspeed/<case>/), and the losses DeepSpeed trains on after it saved them
(tests/fixtures/deepspeed/expected.json): so CI, with no DeepSpeed, checks that zerostack
resumes DeepSpeed's folders with DeepSpeed's next losses.

    # in the peer environment (../shared/PEERS.md), every case:
    DS_ACCELERATOR=cpu .peers/bin/python scripts/deepspeed_fixtures.py --engine deepspeed

Each case runs the same script on 2 gloo ranks (``torchrun``): a tiny Hugging Face GPT-2
(seeded), AdamW and WarmupLR from the config, micro-batch 2 per rank, seeded token batches;
3 steps, ``save_checkpoint(dir, client_state={"epoch": 7})``, 2 more steps. It records every
step's loss on each rank. ``--engine zerostack`` runs the same script under zerostack (the
losses before the save must equal DeepSpeed's: the folders hold the same run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "deepspeed")
SAVE_AT, STEPS, MICRO, WORLD = 3, 5, 2, 2

CASES = {
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero2_bf16": {"stage": 2, "bf16": True},
    "zero3_bf16": {"stage": 3, "bf16": True},
    "zero2_frozen": {"stage": 2, "frozen": True},
    "zero3_sgd": {"stage": 3, "sgd": True},
    "zero2_odd": {"stage": 2, "odd": True},
    "zero0": {"stage": 0, "clip": 0.0},
    "zero0_bf16": {"stage": 0, "bf16": True},
    "zero0_fp16": {"stage": 0, "fp16": True},
    "zero2_fp16": {"stage": 2, "fp16": True},
    "zero3_fp16": {"stage": 3, "fp16": True, "clip": 0.0},
    "zero3_frozen": {"stage": 3, "frozen": True, "sgd": True, "clip": 0.0},
    "pipe_zero1": {"stage": 1, "pipe": True, "clip": 0.0},
    "moe_zero2": {"stage": 2, "moe": True, "clip": 0.0},
    "tp2_zero1": {"stage": 1, "tp": 2, "clip": 0.0},
    "zero2_universal": {"stage": 2, "universal": True},
    "zero3_universal": {"stage": 3, "universal": True, "clip": 0.0},
}
"""``universal``: the saved folder turned into a universal checkpoint by DeepSpeed's
``ds_to_universal`` (``<tag>_universal``, named by ``latest_universal``); the losses after the
save are DeepSpeed's resumed from it (``checkpoint.load_universal``)."""


def ds_config(
    stage: int,
    bf16: bool = False,
    frozen: bool = False,
    sgd: bool = False,
    odd: bool = False,
    fp16: bool = False,
    clip: float | None = None,
    universal: bool = False,
    pipe: bool = False,
    moe: bool = False,
    tp: int = 1,
) -> dict:
    """The case's DeepSpeed config (``sgd``: torch's SGD with momentum, where both engines'
    arithmetic is torch's, in place of AdamW; ``fp16``: dynamic loss scaling from 2^18, where
    the first steps overflow (skipped, the scale halved), so the scaler's state moves;
    ``clip``: ``gradient_clipping``, None for DeepSpeed's default, 1.0)."""
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4},
        },
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if fp16:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 18, "hysteresis": 1}
    if clip is not None:
        cfg["gradient_clipping"] = clip
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    if tp > 1:  # DeepSpeed's AutoTP: each tp group reads one batch
        cfg["tensor_parallel"] = {"autotp_size": tp}
    if pipe:  # the global batch as the other cases': 2 micro-batches of 2 on one dp rank
        cfg.update(train_micro_batch_size_per_gpu=MICRO * WORLD // 2, gradient_accumulation_steps=2)
    if sgd:
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
        cfg["zero_allow_untested_optimizer"] = True
    return cfg


def llama():
    """``tp`` cases: a tiny Hugging Face Llama (seeded; DeepSpeed's AutoTP cuts Llama, not
    GPT-2, whose kernel-injection policy it insists on)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                      max_position_embeddings=32, tie_word_embeddings=False)  # fmt: skip
    return LlamaForCausalLM(cfg)


def model(frozen: bool = False, odd: bool = False):
    """The tiny GPT-2 every case trains (seeded); ``frozen``: its position embedding and first
    block's MLP kept frozen (``requires_grad=False``), as a partly frozen fine-tune; ``odd``:
    width 30 and 63 tokens, so its 24,930 parameters are no multiple of 2 x dp and DeepSpeed pads
    the flat group (``group_paddings``)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    width, vocab = (30, 63) if odd else (32, 64)
    cfg = GPT2Config(n_layer=2, n_embd=width, n_head=2, vocab_size=vocab, n_positions=16)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    out = GPT2LMHeadModel(cfg)
    if frozen:
        out.transformer.wpe.requires_grad_(False)
        out.transformer.h[0].mlp.requires_grad_(False)
    return out


def tokens(step: int, rank: int, world: int = WORLD, odd: bool = False):
    """This rank's micro-batch of global batch ``step`` (the same global batch at any world)."""
    import torch

    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 63 if odd else 64, (MICRO * WORLD, 12), generator=g)
    per = MICRO * WORLD // world
    return x[rank * per : (rank + 1) * per]


def pipe_model(pipeline_module, layer_spec, stages: int = 2):
    """``pipe`` cases: a tiny residual MLP as DeepSpeed's ``PipelineModule`` over ``stages``
    stages (6 layers; seeded), MSE loss."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm, self.lin = nn.LayerNorm(width), nn.Linear(width, width)

        def forward(self, x):
            return x + torch.tanh(self.lin(self.norm(x)))

    torch.manual_seed(0)
    layers = [layer_spec(nn.Linear, 8, 16), *[layer_spec(Block, 16) for _ in range(4)],
              layer_spec(nn.Linear, 16, 4)]  # fmt: skip
    return pipeline_module(layers=layers, num_stages=stages, loss_fn=nn.MSELoss(),
                           partition_method="uniform")  # fmt: skip


def pipe_batches(step: int):
    """``pipe`` cases: global batch ``step``'s 2 micro-batches (inputs, targets) of 2."""
    import torch

    g = torch.Generator().manual_seed(200 + step)
    return iter([(torch.randn(MICRO * WORLD // 2, 8, generator=g),
                  torch.randn(MICRO * WORLD // 2, 4, generator=g)) for _ in range(2)])  # fmt: skip


def pipe_classes():
    """``deepspeed.pipe``'s PipelineModule and LayerSpec: DeepSpeed's, or zerostack's where the
    ``deepspeed`` name is not installed (a test calling zerostack's facade module directly)."""
    try:
        from deepspeed.pipe import LayerSpec, PipelineModule
    except ImportError:
        from zerostack.pipe import LayerSpec, PipelineModule
    return PipelineModule, LayerSpec


def moe_model():
    """``moe`` cases: an MLP around DeepSpeed's ``MoE`` layer (4 experts over ep 2, top-1, no
    dropped tokens; seeded); returns (model, its parameter groups as DeepSpeed's MoE tutorial
    makes them: experts apart)."""
    import torch
    from torch import nn

    try:
        from deepspeed.moe.layer import MoE
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    except ImportError:  # a test calling zerostack's facade module directly
        from zerostack.moe.layer import MoE
        from zerostack.moe.utils import split_params_into_different_moe_groups_for_optimizer

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 4)
            expert = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
            self.moe = MoE(hidden_size=16, expert=expert, num_experts=4, ep_size=2, k=1,
                           min_capacity=2, capacity_factor=2.0, drop_tokens=False)  # fmt: skip

        def forward(self, x):
            h, aux, _ = self.moe(torch.relu(self.inp(x)))
            return self.out(h), aux

    torch.manual_seed(0)
    net = Net()
    groups = {"params": list(net.parameters()), "name": "dense"}
    return net, split_params_into_different_moe_groups_for_optimizer(groups)


def moe_batch(step: int, rank: int, world: int = WORLD):
    """``moe`` cases: this rank's share of global batch ``step`` (inputs, targets)."""
    import torch

    g = torch.Generator().manual_seed(300 + step)
    x, y = torch.randn(MICRO * WORLD, 8, generator=g), torch.randn(MICRO * WORLD, 4, generator=g)
    per = MICRO * WORLD // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def moe_loss(engine, step: int, rank: int, world: int = WORLD):
    """``moe`` cases: one forward, MSE plus the router's load-balancing loss."""
    import torch

    x, y = moe_batch(step, rank, world)
    out, aux = engine(x)
    return torch.nn.functional.mse_loss(out, y) + 0.01 * aux


def _train_moe(case, out, steps, load, deepspeed) -> list[float]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    net, groups = moe_model()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=groups, config=ds_config(**case))
    if load is not None:
        engine.load_checkpoint(load)
    losses = []
    for step in steps:
        loss = moe_loss(engine, step, rank, world)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step + 1 == SAVE_AT and load is None:
            engine.save_checkpoint(out, client_state={"epoch": 7})
    return losses


def _train_pipe(case, out, steps, load, deepspeed) -> list[float]:
    net = pipe_model(*pipe_classes())
    engine, *_ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()),
                                      config=ds_config(**case))  # fmt: skip
    if load is not None:
        engine.load_checkpoint(load)
    losses = []
    for step in steps:
        losses.append(float(engine.train_batch(data_iter=pipe_batches(step))))
        if step + 1 == SAVE_AT and load is None:
            engine.save_checkpoint(out, client_state={"epoch": 7})
    return losses


def train(case: dict, out: str, steps=range(STEPS), load: str | None = None, deepspeed=None):
    """Run in each rank: DeepSpeed's loop for ``case`` (a :data:`CASES` entry); returns this
    rank's losses. ``deepspeed``: the module to run it with (None: ``import deepspeed``)."""
    if deepspeed is None:
        import deepspeed

    if case.get("pipe") or case.get("moe"):
        fn = _train_pipe if case.get("pipe") else _train_moe
        return fn(case, out, steps, load, deepspeed)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tp = case.get("tp", 1)
    rank, world = rank // tp, world // tp  # the data-parallel rank and size
    cfg = ds_config(**case)
    cfg["train_micro_batch_size_per_gpu"] = MICRO * WORLD // world
    odd = case.get("odd", False)
    net = llama() if tp > 1 else model(case.get("frozen", False), odd)
    params = [p for p in net.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=net, model_parameters=params, config=cfg)
    if load is not None:
        engine.load_checkpoint(load)
    losses = []
    for step in steps:
        x = tokens(step, rank, world, odd).to(engine.device)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
        if step + 1 == SAVE_AT and load is None:
            engine.save_checkpoint(out, client_state={"epoch": 7})
    return losses


def _child(args) -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    case = CASES[args.case]
    if case.get("fp16") and "zerostack" not in str(deepspeed.__file__):
        # DeepSpeed's CPU accelerator offers fp16 only where oneDNN computes it; torch's CPU
        # kernels compute it everywhere, and the files are DeepSpeed's own whichever computes
        from deepspeed.accelerator import get_accelerator

        type(get_accelerator()).is_fp16_supported = lambda self: True
    steps = range(SAVE_AT, STEPS) if args.load else range(STEPS)
    losses = train(case, args.out, steps, args.load)
    with open(os.path.join(args.results, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(losses, f)


def run_case(
    name: str, engine: str, out: str, load: str | None = None, python: str = sys.executable
) -> list[list[float]]:
    """Each rank's losses of one case, its folder written to ``out``; with ``load``, the steps
    after the save, resumed from the folder ``load`` (``python``: the interpreter to run)."""
    runner = ["-m", "zerostack.as_deepspeed"] if engine == "zerostack" else []
    resume = ["--load", load] if load else []
    with tempfile.TemporaryDirectory() as results:
        cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(WORLD), *runner, __file__, "--child", "--case", name, "--out", out,
               "--results", results, *resume]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        paths = [os.path.join(results, f"rank{r}.json") for r in range(WORLD)]
        if not all(os.path.exists(p) for p in paths):
            raise RuntimeError(f"{name}: exit {done.returncode}\n{done.stderr[-4000:]}")
        return [json.load(open(p)) for p in paths]


def universal(name: str, folder: str) -> list[list[float]]:
    """``folder``'s checkpoint turned into DeepSpeed's universal one in place (its tag's own
    folder then removed: the fixture holds the universal folder alone); returns each rank's
    losses of the steps after the save, DeepSpeed's resumed from the universal folder."""
    tag = open(os.path.join(folder, "latest")).read().strip()
    out = os.path.join(folder, f"{tag}_universal")
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
           os.path.join(folder, tag), "--output_folder", out, "--inject_missing_state",
           "--num_extract_workers", "1", "--num_merge_workers", "1"]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"{name}: ds_to_universal: {done.stderr[-3000:]}")
    with open(os.path.join(folder, "latest_universal"), "w") as f:
        f.write(f"{tag}_universal")
    shutil.rmtree(os.path.join(folder, tag))
    os.remove(os.path.join(folder, "latest"))
    after = run_case(name, "deepspeed", os.path.join(folder, "unused"), load=folder)
    shutil.rmtree(os.path.join(folder, "unused"), ignore_errors=True)
    return after


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["deepspeed", "zerostack"], default="deepspeed")
    parser.add_argument("-k", default="")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    parser.add_argument("--load", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    expected_path = os.path.join(FIXTURES, "expected.json")
    old = json.load(open(expected_path)) if os.path.exists(expected_path) else {}
    expected = old.get("cases", {})
    for name in [n for n in CASES if args.k in n]:
        with tempfile.TemporaryDirectory() as tmp:
            losses = run_case(name, args.engine, tmp)
            print(name, args.engine, losses, flush=True)
            if args.engine == "deepspeed":
                record = {"config": ds_config(**CASES[name]), "losses": losses}
                if CASES[name].get("universal"):
                    record["continuing"] = losses
                    after = universal(name, tmp)
                    record["losses"] = [r[:SAVE_AT] + a for r, a in zip(losses, after, strict=True)]
                    print(name, "resumed from the universal folder", record["losses"])
                dest = os.path.join(FIXTURES, name)
                shutil.rmtree(dest, ignore_errors=True)
                # the folder as DeepSpeed wrote it, less the copies of its own scripts
                shutil.copytree(tmp, dest, ignore=shutil.ignore_patterns("*.py"))
                expected[name] = record
    if args.engine == "deepspeed":
        import deepspeed
        import torch
        import transformers

        record = {
            "command": "DS_ACCELERATOR=cpu .peers/bin/python scripts/deepspeed_fixtures.py "
            "--engine deepspeed",
            "versions": {
                "deepspeed": deepspeed.__version__,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            },  # fmt: skip
            "save_at": SAVE_AT,
            "cases": expected,
        }
        with open(expected_path, "w") as f:
            f.write(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
