"""A DeepSpeed-style training script; only the import differs from DeepSpeed.

torchrun --nproc_per_node 2 examples/train_gpt.py --deepspeed_config examples/ds_config_zero3.json
python examples/train_gpt.py --deepspeed_config examples/ds_config_zero3.json --steps 5
"""

import argparse

import torch

import zerostack as deepspeed
from zerostack.demo.corpus import corpus_datasets
from zerostack.models import GPT, GPTConfig

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed_config", default="examples/ds_config_zero3.json")
parser.add_argument("--steps", type=int, default=50)
args = parser.parse_args()

deepspeed.init_distributed()
cfg = GPTConfig(block_size=64, n_layer=2, d_model=64, n_head=4)
with deepspeed.zero.Init():  # ZeRO-3: no rank ever holds the whole model
    torch.manual_seed(0)
    model = GPT(cfg)
train_set, _ = corpus_datasets(cfg.block_size)
engine, optimizer, loader, scheduler = deepspeed.initialize(
    args=args, model=model, model_parameters=model.parameters(), training_data=train_set
)
batches = iter(loader)
for step in range(args.steps * engine.gradient_accumulation_steps()):
    x, y = (t.to(engine.device) for t in next(batches))  # the loader yields host tensors
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    if engine.global_rank == 0 and (step + 1) % engine.gradient_accumulation_steps() == 0:
        print(f"step {engine.global_steps}: loss {loss.item():.3f} lr {engine.get_lr()[0]:.2e}")
print(f"rank {engine.global_rank}: {engine.memory_breakdown()}")
deepspeed.shutdown()
