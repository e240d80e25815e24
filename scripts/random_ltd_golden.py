"""DeepSpeed 0.19.8's random-LTD on a tiny model, recorded as golden figures for
tests/test_token_drop.py.

    DS_ACCELERATOR=cpu .peers/bin/python scripts/random_ltd_golden.py \
        --write tests/golden/random_ltd.json

DeepSpeed's random-LTD runs three CUDA kernels (``token_sort_``, ``token_gather``,
``token_scatter_``); this machine has none, so they are replaced by the torch index operations
they compute (sort along the last dimension; gather and in-place scatter of the kept tokens,
``[batch, seq, h]`` or ``[seq, batch, h]``). Everything else is DeepSpeed's own: the engine's
schedule update at each training forward, the wrapper, the sampling (``torch.multinomial`` on
the default generator), the masks, the layer matching, the autograd functions.

Each case trains a small transformer (tokens embedded, blocks of attention and MLP, the mean
token classified) on one rank: the loss, the tokens kept and the layer-tokens consumed at each
step, and the module state dict's names.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import torch
from _golden import emit
from torch import nn

SEQ, WIDTH, VOCAB, CLASSES, LAYERS, MICRO, STEPS = 12, 8, 11, 3, 4, 4, 8

CASES = {
    "decoder_sgd_stage0": {
        "zero": 0, "optimizer": {"type": "SGD", "params": {"lr": 0.2}}, "clip": 0.0,
        "ltd": {"model_mask_name": None, "model_type": "decoder",
                "hidden_state_order": "batch_seq_dim"},
    },
    "encoder_adam_stage1_seq_first": {
        "zero": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "ltd": {"model_mask_name": "attention_mask", "model_type": "encoder",
                "hidden_state_order": "seq_batch_dim"},
    },
}  # fmt: skip


def config(case: dict) -> dict:
    """The DeepSpeed config of ``case``: random-LTD on layers 1 and 2 of 4."""
    ltd = {
        "enabled": True, "total_layer_num": LAYERS, "random_ltd_layer_num": 2,
        "random_ltd_layer_id": [1, 2], **case["ltd"],
        "random_ltd_schedule": {"min_value": 5, "max_value": SEQ, "schedule_type": "fixed_linear",
                                "schedule_config": {"require_steps": 6, "seq_per_step": 2}},
    }  # fmt: skip
    return {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
        "optimizer": case["optimizer"], "zero_optimization": {"stage": case["zero"]},
        "gradient_clipping": case.get("clip", 1.0),
        "data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": ltd}},
    }  # fmt: skip


class Block(nn.Module):
    """Pre-LN attention and MLP; ``attention_mask``: additive, ``[batch, 1, seq, seq]``."""

    def __init__(self, seq_first: bool) -> None:
        super().__init__()
        self.seq_first = seq_first
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        wide = 2 * WIDTH
        self.mlp = nn.Sequential(nn.Linear(WIDTH, wide), nn.GELU(), nn.Linear(wide, WIDTH))

    def forward(self, x, attention_mask=None):
        if self.seq_first:
            x = x.transpose(0, 1)
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / WIDTH**0.5
        if attention_mask is not None:
            scores = scores + attention_mask[:, 0]
        x = x + self.proj(scores.softmax(-1) @ v)
        x = x + self.mlp(self.norm2(x))
        return x.transpose(0, 1) if self.seq_first else x


class Net(nn.Module):
    def __init__(self, seq_first: bool) -> None:
        super().__init__()
        self.seq_first = seq_first
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.1)
        self.blocks = nn.ModuleList(Block(seq_first) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, ids, labels, attention_mask=None):
        x = self.embed(ids) + self.pos
        x = x.transpose(0, 1) if self.seq_first else x
        for block in self.blocks:
            x = block(x, attention_mask=attention_mask)
        x = x.transpose(0, 1) if self.seq_first else x
        return nn.functional.cross_entropy(self.head(x.mean(1)), labels)


def batches():
    """Each step's token ids, labels and additive padding mask (the last tokens of some
    samples are padding: -1e4 in their columns)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        labels = torch.randint(0, CLASSES, (MICRO,), generator=g)
        keep = SEQ - torch.randint(0, 4, (MICRO,), generator=g)
        mask = torch.zeros(MICRO, 1, SEQ, SEQ)
        for i, n in enumerate(keep.tolist()):
            mask[i, :, :, n:] = -1e4
        out.append((ids, labels, mask))
    return out


def model(name: str) -> Net:
    torch.manual_seed(0)
    return Net(seq_first=CASES[name]["ltd"]["hidden_state_order"] == "seq_batch_dim")


def train(engine, name: str, convert, state_dict) -> dict:
    """Wrap the blocks, train ``STEPS`` steps; the figures of each step."""
    engine = convert(engine, Block)
    torch.manual_seed(1)  # the kept tokens' draws, the same in every engine
    masked = CASES[name]["ltd"]["model_mask_name"] is not None
    out = {"loss": [], "kept": [], "consumed": []}
    for ids, labels, mask in batches():
        loss = engine(ids, labels, attention_mask=mask if masked else None)
        engine.backward(loss)
        engine.step()
        sched = engine.random_ltd_scheduler
        out["loss"].append(loss.item())
        out["kept"].append(sched.get_current_seq())
        out["consumed"].append(sched.state["consumed_layer_tokens"])
    out["state_dict"] = list(state_dict(engine))
    return out


SCHEDULE_STEPS = [0, 0, 1, 1, 2, 5, 5, 9, 30]  # repeated: micro-steps of one step


def schedule(scheduler_cls) -> list[list[int]]:
    """``update_seq`` at :data:`SCHEDULE_STEPS` (min 7 rounded to 3s, up to 40 over 10
    steps; 6 of 9 layers; global batch 16): the kept length and layer-tokens after each."""
    sched = scheduler_cls({
        "total_layer_num": 9, "random_ltd_layer_num": 6, "global_batch_size": 16,
        "layer_token_lr_schedule": {"enabled": False},
        "random_ltd_schedule": {"min_value": 7, "max_value": 40, "schedule_type": "fixed_linear",
                                "schedule_config": {"require_steps": 10, "seq_per_step": 3}},
    })  # fmt: skip
    out = []
    for step in SCHEDULE_STEPS:
        sched.update_seq(step)
        out.append([sched.get_current_seq(), sched.state["consumed_layer_tokens"]])
    return out


def _kernels() -> SimpleNamespace:
    """DeepSpeed's three random-LTD kernels as the torch operations they compute."""

    def index(t, idx, batch_first):
        idx = idx.long() if batch_first else idx.long().t()
        return (1 if batch_first else 0), idx.unsqueeze(-1).expand(*idx.shape, t.shape[-1])

    def token_sort_(indices, seq_length):
        indices.copy_(indices.sort(dim=-1).values)
        return indices

    def token_gather(activations, indices, batch_first):
        return torch.gather(activations, *index(activations, indices, batch_first))

    def token_scatter_(all_activations, layer_activations, indices, batch_first):
        dim, idx = index(all_activations, indices, batch_first)
        return all_activations.scatter_(dim, idx, layer_activations)

    return SimpleNamespace(token_sort_=token_sort_, token_gather=token_gather,
                           token_scatter_=token_scatter_)  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", help="write the JSON here (default: print it)")
    args = ap.parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")  # fmt: skip
    import deepspeed
    from deepspeed.ops.random_ltd import dropping_utils
    from deepspeed.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd
    from deepspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler

    dropping_utils.random_ltd_module = _kernels()
    out = {"command": " ".join(["DS_ACCELERATOR=cpu .peers/bin/python", *sys.argv]),
           "deepspeed": deepspeed.__version__, "schedule": schedule(RandomLTDScheduler),
           "cases": {}}  # fmt: skip
    for name, case in CASES.items():
        net = model(name)
        engine, *_ = deepspeed.initialize(model=net, config=config(case))
        out["cases"][name] = train(engine, name, convert_to_random_ltd,
                                   lambda e: e.module_state_dict())  # fmt: skip
        engine.destroy()
    return emit(out, args.write)


if __name__ == "__main__":
    raise SystemExit(main())
