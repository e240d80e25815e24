"""TRL's ``GRPOTrainer`` written for DeepSpeed, run on zerostack with no edit.

    torchrun --nproc_per_node 2 -m zerostack.as_deepspeed examples/trl_grpo.py \
        --deepspeed ds_config.json --out runs/trl_grpo

A plain TRL script (``GRPOConfig(deepspeed=...)``): it never imports zerostack. With real
DeepSpeed installed instead, ``torchrun examples/trl_grpo.py ...`` runs the same script on
DeepSpeed (tests/golden/trl.json holds those figures). The policy is a tiny Llama from a config;
the tokenizer is built here (examples/_tiny_hf.py, a word-level vocabulary of 64 tokens);
nothing is downloaded.
Generation is ``model.generate`` (no vLLM); with ``--beta`` above 0 the reference model goes
through TRL's ``prepare_deepspeed``. The reward counts the completion's tokens that are even
numbers, so it is learnable and the same for every engine.

Rank 0 prints ``RESULT`` and a JSON object at the end: ``"logs"``, for each step, the Trainer's
logged loss, grad norm, reward, its spread and (with ``--beta``) the KL.
"""

import argparse
import json

import torch
from _tiny_hf import Record, cpu_state, initial_model, tokenizer
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed", default=None, help="a DeepSpeed config file (JSON)")
parser.add_argument("--out", default="runs/trl_grpo")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--beta", type=float, default=0.1, help="KL weight; 0: no reference model")
parser.add_argument("--lr", type=float, default=1e-2)
parser.add_argument("--optim", default="adamw_torch", help="the Trainer's optimizer")
parser.add_argument("--max_grad_norm", type=float, default=1.0, help="0: no clipping")
parser.add_argument("--no_gradient_checkpointing", action="store_true", help="TRL's default is on")
parser.add_argument("--fp32", action="store_true", help="TRL's default is bf16")
args = parser.parse_args()
state = cpu_state(args.deepspeed)

SAMPLED: list[str] = []  # this rank's completions, in order


def even_numbers(completions, **kwargs) -> list[float]:
    """The share of a completion's words that are even numbers."""
    SAMPLED.extend(completions)
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(w.isdigit() and int(w) % 2 == 0 for w in words) / max(len(words), 1))
    return out


prompts = [" ".join(str((7 * i + j) % 61) for j in range(4)) for i in range(16)]
training_args = GRPOConfig(
    output_dir=args.out,
    deepspeed=args.deepspeed,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=6,
    max_steps=args.steps,
    learning_rate=args.lr,
    optim=args.optim,
    max_grad_norm=args.max_grad_norm,
    gradient_checkpointing=not args.no_gradient_checkpointing,
    bf16=not args.fp32,
    lr_scheduler_type="constant",
    beta=args.beta,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    seed=0,
    use_cpu=not torch.cuda.is_available(),
    dataloader_num_workers=0,
    disable_tqdm=True,
    **state,
)
record = Record(("loss", "grad_norm", "reward", "reward_std", "kl"))
trainer = GRPOTrainer(
    model=initial_model(training_args, args.out),
    reward_funcs=even_numbers,
    args=training_args,
    train_dataset=Dataset.from_dict({"prompt": prompts}),
    processing_class=tokenizer(),
    callbacks=[record],
)
trainer.train()
if training_args.process_index == 0:
    print("RESULT " + json.dumps({"logs": record.logs, "completions": SAMPLED}), flush=True)
