"""DeepSpeed's ALST tutorial script, run on zerostack with no edit to its DeepSpeed calls.

    torchrun --nproc_per_node 2 -m zerostack.as_deepspeed examples/alst_tutorial.py
    torchrun --nproc_per_node 2 -m zerostack.as_deepspeed examples/alst_tutorial.py \
        --tiled_mlp --offload_checkpoints

The training loop of Part 1 of DeepSpeed's "Arctic Long Sequence Training (ALST) for HF
Transformers integration" tutorial (docs/_tutorials/ulysses-alst-sequence-parallelism.md),
with Part 2's tiled MLP monkey patch (``--tiled_mlp``) and its checkpoint-offload context
(``--offload_checkpoints``, with Transformers' gradient checkpointing on), as a user copies
them. It never imports zerostack; with real DeepSpeed installed, ``torchrun
examples/alst_tutorial.py`` runs it on DeepSpeed (tests/golden/alst_tutorial.json holds those
figures, from scripts/alst_tutorial_runs.py). What differs from the tutorial's text, and why:

- the model is a tiny Llama built from a config here (seeded) and saved to ``--model`` (this
  machine reaches no hub), in place of ``hf-internal-testing/tiny-random-LlamaForCausalLM``;
- ``dist_backend="gloo"``, not ``"nccl"`` (a CPU machine);
- ``model.step()`` after ``model.backward(loss)`` (the tutorial's loop only backpropagates, so
  nothing would be trained), and ``--sgd``: torch's SGD without momentum instead of the
  config's Adam (Adam hides a constant factor in the gradient);
- rank 0 prints ``RESULT`` and a JSON object at the end: per iteration the loss and
  ``model.get_global_grad_norm()``.
"""

import argparse
import json
import math
import os

import deepspeed
import deepspeed.comm as dist
import torch
from deepspeed.runtime.activation_checkpointing.offload_activations import (
    get_checkpoint_hidden_states_offloading_ctx_manager,
)
from deepspeed.runtime.sequence_parallel.ulysses_sp import (
    TiledMLP,
    UlyssesSPAttentionHF,
    UlyssesSPDataLoaderAdapter,
)
from deepspeed.runtime.utils import move_to_device
from deepspeed.utils import groups
from torch import tensor
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="runs/alst_tutorial_model")
parser.add_argument("--tiled_mlp", action="store_true", help="Part 2's TiledMLP monkey patch")
parser.add_argument(
    "--offload_checkpoints",
    action="store_true",
    help="gradient checkpointing with Part 2's checkpoint-offload context",
)
parser.add_argument("--sgd", action="store_true", help="torch's SGD at lr 0.5 for Adam")
args = parser.parse_args()

model_name_or_path = args.model
seq_length = 64
sequence_parallel_size = 2
micro_batch_size = 1

config_dict = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {
        "stage": 3,
    },
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "sequence_parallel_size": sequence_parallel_size,
}

# a simple Dataset
# replace with a real dataset but make sure `position_ids` are returned
input_ids = tensor(
    [[1, 10, 10, 10, 2, 2], [1, 20, 20, 20, 2, 2]],
)
position_ids = tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])
ds = torch.utils.data.TensorDataset(input_ids, position_ids)


def collate_fn(batch):
    input_ids, position_ids = batch[0]
    return dict(
        input_ids=input_ids.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        labels=input_ids.unsqueeze(0),
    )


dist.init_distributed(dist_backend="gloo", dist_init_required=True)

if dist.get_rank() == 0 and not os.path.exists(os.path.join(model_name_or_path, "config.json")):
    torch.manual_seed(0)  # not in the tutorial: the model it downloads, built here
    small = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq_length,
    )
    LlamaForCausalLM(small).save_pretrained(model_name_or_path)
torch.distributed.barrier()

if args.tiled_mlp:  # Part 2: "Tiled MLP computation"

    def tiled_mlp_forward_common(self, x):
        """a monkey patch to replace modeling_llama.LlamaMLP.forward and other identical MLP
        implementations to perform a tiled compute of the same"""

        # figure out the number of shards
        bs, seqlen, hidden = x.shape
        num_shards = math.ceil(seqlen / hidden)
        # it's crucial that all ranks run the same number of shards
        tensor = torch.tensor(num_shards, device=x.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        num_shards = tensor.item()

        # only needed for deepspeed
        compute_params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]

        def mlp_forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

        return TiledMLP.apply(
            mlp_forward,
            self,
            x,
            num_shards,
            compute_params,
        )

    from transformers.models.llama import modeling_llama

    modeling_llama.LlamaMLP.forward = tiled_mlp_forward_common

# Ulysses injection into HF Transformers
mpu = UlyssesSPAttentionHF.register_with_transformers(
    model_name_or_path=model_name_or_path,
    core_attn_implementation="sdpa",
    sequence_parallel_size=sequence_parallel_size,
    micro_batch_size=micro_batch_size,
    seq_length=seq_length,
    seq_length_is_variable=True,
)

# Deepspeed setup
model = AutoModelForCausalLM.from_pretrained(model_name_or_path)
optimizer = None
if args.sgd:
    del config_dict["optimizer"]
    config_dict["zero_allow_untested_optimizer"] = True  # DeepSpeed asks for it
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
if args.offload_checkpoints:
    model.gradient_checkpointing_enable()
model, _, _, _ = deepspeed.initialize(
    config=config_dict,
    model=model,
    model_parameters=model.parameters(),
    optimizer=optimizer,
    mpu=mpu,
)

# UlyssesSPDataLoaderAdapter injection
sp_group = groups._get_sequence_parallel_group()
sp_world_size = groups._get_sequence_parallel_world_size()
sp_rank = groups._get_sequence_parallel_rank()
dl = torch.utils.data.DataLoader(ds, batch_size=micro_batch_size, collate_fn=collate_fn)
dl = UlyssesSPDataLoaderAdapter(
    dl,
    sp_rank=sp_rank,
    sp_group=sp_group,
    sp_world_size=sp_world_size,
    device=model.device,
)

# Part 2: "Activation checkpoint offload to CPU", one context reused for every step
ctx = get_checkpoint_hidden_states_offloading_ctx_manager() if args.offload_checkpoints else None

# Normal training loop
figures = []
for iter, batch in enumerate(dl):
    batch = move_to_device(batch, model.device)

    with ctx if ctx is not None else torch.enable_grad():
        outputs = model(**batch)
        # as of this writing HF doesn't calculate loss with shift_labels yet and requires us to
        # do it manually (liger does that automatically)
        shift_labels = batch["shift_labels"]
        loss = model.module.loss_function(
            logits=outputs.logits,
            labels=None,
            shift_labels=shift_labels,
            vocab_size=model.module.config.vocab_size,
        )

        # differentiable weighted per-shard-loss aggregation across ranks
        losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
        # special dealing with SFT that has prompt tokens that aren't used in loss computation
        good_tokens = (shift_labels != -100).view(-1).sum()
        good_tokens_per_rank = torch.distributed.nn.functional.all_gather(
            good_tokens, group=sp_group
        )
        total_loss = sum(
            losses_per_rank[rank] * good_tokens_per_rank[rank] for rank in range(sp_world_size)
        )
        total_good_tokens = sum(good_tokens_per_rank)
        loss = total_loss / max(total_good_tokens, 1)

        if dist.get_rank() == 0:
            print(f"{iter}: {loss=}")

        model.backward(loss)
    model.step()  # not in the tutorial's loop (see the module's text)
    norm = model.get_global_grad_norm()  # a tensor on DeepSpeed at ZeRO-3, a float on zerostack
    figures.append({"iter": iter, "loss": loss.item(), "grad_norm": float(norm)})

if dist.get_rank() == 0:
    print("RESULT " + json.dumps({"figures": figures}), flush=True)
