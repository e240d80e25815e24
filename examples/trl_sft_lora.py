"""TRL's ``SFTTrainer`` with a PEFT LoRA and non-reentrant gradient checkpointing, written for
DeepSpeed, run on zerostack with no edit.

    torchrun --nproc_per_node 2 -m zerostack.as_deepspeed examples/trl_sft_lora.py \
        --deepspeed ds_config.json --out runs/trl_sft_lora

A plain TRL script (``SFTConfig(deepspeed=...)``, ``peft_config=LoraConfig(...)``) that never
imports zerostack; with real DeepSpeed installed, ``torchrun examples/trl_sft_lora.py ...`` runs
it on DeepSpeed (tests/golden/trl.json). ZeRO-3 with LoRA adapters on a frozen base and
``use_reentrant=False`` is DeepSpeed issue #4332's case. The model is a tiny Llama from a
config, the tokenizer built here (examples/_tiny_hf.py).

Rank 0 prints ``RESULT`` and a JSON object at the end: ``"logs"``, for each step, what the
Trainer logged of the loss, grad norm and token accuracy.
"""

import argparse
import json

import torch
from _tiny_hf import Record, cpu_state, initial_model, tokenizer
from datasets import Dataset
from peft import LoraConfig
from trl import SFTConfig, SFTTrainer

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed", default=None, help="a DeepSpeed config file (JSON)")
parser.add_argument("--out", default="runs/trl_sft_lora")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--lr", type=float, default=1e-2)
parser.add_argument("--optim", default="adamw_torch", help="the Trainer's optimizer")
parser.add_argument("--max_grad_norm", type=float, default=1.0, help="0: no clipping")
parser.add_argument("--fp32", action="store_true", help="TRL's default is bf16")
args = parser.parse_args()
state = cpu_state(args.deepspeed)

KEYS = ("loss", "grad_norm", "mean_token_accuracy", "num_tokens")
texts = [" ".join(str((5 * i + 3 * j) % 61) for j in range(8)) for i in range(16)]
training_args = SFTConfig(
    output_dir=args.out,
    deepspeed=args.deepspeed,
    per_device_train_batch_size=2,
    max_steps=args.steps,
    learning_rate=args.lr,
    optim=args.optim,
    max_grad_norm=args.max_grad_norm,
    bf16=not args.fp32,
    lr_scheduler_type="constant",
    gradient_checkpointing=True,
    gradient_checkpointing_kwargs={"use_reentrant": False},
    max_length=16,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    seed=0,
    use_cpu=not torch.cuda.is_available(),
    dataloader_num_workers=0,
    disable_tqdm=True,
    **state,
)
lora = LoraConfig(
    r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
)
record = Record(KEYS)
trainer = SFTTrainer(
    model=initial_model(training_args, args.out),
    args=training_args,
    train_dataset=Dataset.from_dict({"text": texts}),
    processing_class=tokenizer(padding_side="right"),
    peft_config=lora,
    callbacks=[record],
)
trainer.train()
if training_args.process_index == 0:
    print("RESULT " + json.dumps({"logs": record.logs}), flush=True)
