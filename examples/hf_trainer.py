"""A Hugging Face ``Trainer`` script written for DeepSpeed, run on zerostack with no edit.

    torchrun --nproc_per_node 2 -m zerostack.as_deepspeed examples/hf_trainer.py \
        --deepspeed examples/ds_config_trainer.json --out runs/hf_trainer

The script is a plain DeepSpeed Trainer script (``TrainingArguments(deepspeed=...)``): it never
imports zerostack. ``zerostack.as_deepspeed`` makes ``import deepspeed`` resolve to zerostack
before the script runs; with real DeepSpeed installed instead, ``torchrun ... examples/
hf_trainer.py`` runs the same script on DeepSpeed (tests/golden/hf_trainer.json holds those
losses, measured once). A tiny GPT-2 from a config (nothing is downloaded), random tokens.

Rank 0 prints ``RESULT`` and a JSON object at the end: ``"losses"``, the Trainer's logged loss
and grad norm per step, and with ``--reload``, the loss of the saved model loaded back with
``from_pretrained`` on one batch.
"""

import argparse
import json
import os

import torch
from torch.utils.data import Dataset
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed", default=None, help="a DeepSpeed config file (JSON)")
parser.add_argument("--out", default="runs/hf_trainer")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--micro", type=int, default=2, help="per-device batch")
parser.add_argument("--gas", type=int, default=1, help="gradient accumulation steps")
parser.add_argument("--save_steps", type=int, default=0, help="checkpoint every N steps")
parser.add_argument("--resume", default=None, help="a checkpoint folder to resume from")
parser.add_argument("--reload", action="store_true", help="save_model, then from_pretrained")
parser.add_argument("--bf16", action="store_true")
parser.add_argument("--max_grad_norm", type=float, default=1.0, help="0: no clipping")
args = parser.parse_args()

if args.deepspeed and not torch.cuda.is_available() and "WORLD_SIZE" in os.environ:
    # CPU only: Accelerate finds no backend for DeepSpeed without an accelerator and would make
    # a world of one; give it gloo before TrainingArguments (not needed on GPUs).
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    cpu_state = {"accelerator_config": {"use_configured_state": True}}
else:
    cpu_state = {}

SEQ, VOCAB = 32, 256


class Tokens(Dataset):
    """64 random sequences, the same on every rank and every run."""

    def __init__(self, n: int = 64) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Record(TrainerCallback):
    """The Trainer's own logs: loss and grad norm per step."""

    def __init__(self) -> None:
        self.steps = []

    def on_log(self, _args, state, _control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.steps.append([state.global_step, logs["loss"], logs.get("grad_norm")])


training_args = TrainingArguments(
    output_dir=args.out,
    deepspeed=args.deepspeed,
    per_device_train_batch_size=args.micro,
    gradient_accumulation_steps=args.gas,
    max_steps=args.steps,
    learning_rate=1e-3,
    max_grad_norm=args.max_grad_norm,
    lr_scheduler_type="constant",
    logging_steps=1,
    save_strategy="steps" if args.save_steps else "no",
    save_steps=args.save_steps or 500,
    report_to=[],
    seed=0,
    train_sampling_strategy="sequential",  # the same batches on 1 rank or 2
    bf16=args.bf16,
    use_cpu=not torch.cuda.is_available(),
    dataloader_num_workers=0,
    disable_tqdm=True,
    **cpu_state,
)
set_seed(0)  # the initial weights too
config = GPT2Config(  # no dropout: the same numbers on 1 rank or 2
    n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
)
model = AutoModelForCausalLM.from_config(config)  # under ZeRO-3: built sharded (zero.Init)
record = Record()
trainer = Trainer(model=model, args=training_args, train_dataset=Tokens(), callbacks=[record])
trainer.train(resume_from_checkpoint=args.resume)

result = {"losses": record.steps}
if args.reload:
    trainer.save_model(os.path.join(args.out, "final"))
    trainer.accelerator.wait_for_everyone()
    if training_args.process_index == 0:
        # one process, no ZeRO-3: loaded whole, as a user of the saved model loads it
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        loaded = AutoModelForCausalLM.from_pretrained(os.path.join(args.out, "final"))
        batch = Tokens().ids[:4]
        with torch.no_grad():
            result["reload_loss"] = loaded(input_ids=batch, labels=batch).loss.item()
if training_args.process_index == 0:
    print("RESULT " + json.dumps(result), flush=True)
