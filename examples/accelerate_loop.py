"""An Accelerate training loop written for DeepSpeed (``DeepSpeedPlugin``), run on zerostack with
no edit:

    torchrun --nproc_per_node 2 -m zerostack.as_deepspeed examples/accelerate_loop.py --stage 3

The script never imports zerostack; with real DeepSpeed installed instead, ``torchrun ...
examples/accelerate_loop.py`` runs it on DeepSpeed. A tiny GPT-2 from a config (no dropout),
random tokens, AdamW, ``accelerator.accumulate``, ``backward``, ``save_state`` after ``--save_at``
steps and, with ``--resume``, ``load_state`` first. Rank 0 prints ``RESULT`` and a JSON object:
the loss of each step (the mean over the ranks of the micro-batches' losses).
"""

import argparse
import json
import os

import torch
from accelerate import Accelerator, DeepSpeedPlugin, PartialState
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, GPT2Config

parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, default=3)
parser.add_argument("--gas", type=int, default=1)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--out", default="runs/accelerate_loop")
parser.add_argument("--save_at", type=int, default=0, help="save_state after this many steps")
parser.add_argument("--resume", action="store_true", help="load_state from --out first")
args = parser.parse_args()

if not torch.cuda.is_available():
    # CPU only: Accelerate finds no backend for DeepSpeed without an accelerator; give it gloo.
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")

SEQ, VOCAB = 32, 256


class Tokens(Dataset):
    def __init__(self, n: int = 64) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


plugin = DeepSpeedPlugin(
    zero_stage=args.stage, gradient_accumulation_steps=args.gas, gradient_clipping=0.0
)
accelerator = Accelerator(deepspeed_plugin=plugin)
set_seed(0)
config = GPT2Config(
    n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
)
model = AutoModelForCausalLM.from_config(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
loader = DataLoader(Tokens(), batch_size=2, shuffle=False)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

start = 0
if args.resume:
    accelerator.load_state(os.path.join(args.out, "state"))
    start = args.save_at
losses, micro = [], []
for i, batch in enumerate(loader):
    if i < start * args.gas:  # the batches the saved run trained on
        continue
    with accelerator.accumulate(model):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    micro.append(accelerator.gather(loss.detach()).mean().item())
    if len(micro) == args.gas:
        losses.append(sum(micro) / args.gas)
        micro = []
        if len(losses) + start == args.save_at and not args.resume:
            accelerator.save_state(os.path.join(args.out, "state"))
    if len(losses) + start == args.steps:
        break
if accelerator.is_main_process:
    print("RESULT " + json.dumps({"losses": losses}), flush=True)
