"""A Hugging Face causal LM trained as a DeepSpeed user trains it, with the import changed; saved
as Hugging Face files and loaded back with ``from_pretrained``.

The model is built from a small config (GPT-2 or Llama, byte-level vocabulary: nothing is
downloaded) inside ``zero.Init``, so no rank holds it whole; or, with ``--tp 2``, split by the
tensor-parallel table for its architecture (``tensor_parallel.autotp_size``).

    torchrun --nproc_per_node 2 examples/hf_causal_lm.py --arch llama
    torchrun --nproc_per_node 2 examples/hf_causal_lm.py --arch gpt2 --tp 2 --steps 20
"""

import argparse
import json
import logging

import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

import zerostack as deepspeed
from zerostack.demo.corpus import corpus_datasets

parser = argparse.ArgumentParser()
parser.add_argument("--arch", choices=["gpt2", "llama"], default="llama")
parser.add_argument("--deepspeed_config", default="examples/ds_config_hf.json")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
parser.add_argument("--out", default="runs/hf_causal_lm", help="where the model files go")
args = parser.parse_args()
logging.getLogger("transformers").setLevel(logging.ERROR)

SEQ = 64
if args.arch == "gpt2":
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=SEQ)
else:
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=SEQ,
    )
with open(args.deepspeed_config) as f:
    ds_config = json.load(f)
if args.tp > 1:
    ds_config["tensor_parallel"] = {"autotp_size": args.tp}

deepspeed.init_distributed()
torch.manual_seed(0)
# ZeRO-3 builds the model already sharded; the tensor-parallel split needs it whole first
with deepspeed.zero.Init(enabled=args.tp == 1, config_dict_or_path=ds_config):
    model = AutoModelForCausalLM.from_config(config)
train_set, val_set = corpus_datasets(SEQ)
engine, optimizer, loader, scheduler = deepspeed.initialize(
    model=model, model_parameters=model.parameters(), training_data=train_set, config=ds_config
)
batches = iter(loader)
for step in range(args.steps * engine.gradient_accumulation_steps()):
    x, _ = next(batches)  # Hugging Face shifts the labels itself
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    if engine.global_rank == 0 and (step + 1) % engine.gradient_accumulation_steps() == 0:
        print(f"step {engine.global_steps}: loss {loss.item():.3f}")

# The whole 16-bit model on rank 0, in the files from_pretrained reads.
engine.save_16bit_model(args.out, "model.safetensors")
val = torch.stack([val_set[i][0] for i in range(8)])
engine.eval()
with torch.no_grad():
    engine_loss = engine(input_ids=val, labels=val).loss.item()
if engine.global_rank == 0:
    engine.module.config.save_pretrained(args.out)
    reloaded = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.bfloat16)
    with torch.no_grad():
        loss = reloaded(input_ids=val, labels=val).loss.item()
    print(f"validation loss: engine {engine_loss:.4f}, from_pretrained({args.out!r}) {loss:.4f}")
deepspeed.shutdown()
