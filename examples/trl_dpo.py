"""TRL's ``DPOTrainer`` written for DeepSpeed, run on zerostack with no edit.

    torchrun --nproc_per_node 2 -m zerostack.as_deepspeed examples/trl_dpo.py \
        --deepspeed ds_config.json --out runs/trl_dpo

A plain TRL script (``DPOConfig(deepspeed=...)``) that never imports zerostack; with real
DeepSpeed installed, ``torchrun examples/trl_dpo.py ...`` runs it on DeepSpeed
(tests/golden/trl.json). The policy is a tiny Llama from a config, the tokenizer built here
(examples/_tiny_hf.py); no ``ref_model`` is given, so TRL makes the reference model and, at
ZeRO-3, prepares it with ``deepspeed.initialize`` (``prepare_deepspeed``). The preference: a
completion of even numbers over one of odd numbers.

Rank 0 prints ``RESULT`` and a JSON object at the end: ``"logs"``, for each step, what the
Trainer logged of the loss, grad norm and DPO's rewards and log-probabilities.
"""

import argparse
import json

import torch
from _tiny_hf import Record, cpu_state, initial_model, tokenizer
from datasets import Dataset
from trl import DPOConfig, DPOTrainer

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed", default=None, help="a DeepSpeed config file (JSON)")
parser.add_argument("--out", default="runs/trl_dpo")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--lr", type=float, default=1e-2)
parser.add_argument("--optim", default="adamw_torch", help="the Trainer's optimizer")
parser.add_argument("--max_grad_norm", type=float, default=1.0, help="0: no clipping")
parser.add_argument("--fp32", action="store_true", help="TRL's default is bf16")
args = parser.parse_args()
state = cpu_state(args.deepspeed)

KEYS = (
    "loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
    "rewards/margins", "logps/chosen", "logps/rejected",
)  # fmt: skip
rows = {
    "prompt": [" ".join(str((7 * i + j) % 61) for j in range(4)) for i in range(16)],
    "chosen": [" ".join(str((2 * (i + j)) % 60) for j in range(3)) for i in range(16)],
    "rejected": [" ".join(str((2 * (i + j) + 1) % 60) for j in range(3)) for i in range(16)],
}
training_args = DPOConfig(
    output_dir=args.out,
    deepspeed=args.deepspeed,
    per_device_train_batch_size=2,
    max_steps=args.steps,
    learning_rate=args.lr,
    optim=args.optim,
    max_grad_norm=args.max_grad_norm,
    bf16=not args.fp32,
    lr_scheduler_type="constant",
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
record = Record(KEYS)
trainer = DPOTrainer(
    model=initial_model(training_args, args.out),
    args=training_args,
    train_dataset=Dataset.from_dict(rows),
    processing_class=tokenizer(),
    callbacks=[record],
)
trainer.train()
if training_args.process_index == 0:
    print("RESULT " + json.dumps({"logs": record.logs}), flush=True)
