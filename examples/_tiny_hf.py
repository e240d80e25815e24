"""What the TRL examples share and a user would have from the hub: a word-level tokenizer over
the numbers 0-60 built in process, a tiny Llama written once as a local "pretrained" folder,
the Trainer's logs recorded per step, and Accelerate told to use gloo on a CPU machine. Nothing
here touches DeepSpeed or zerostack."""

import os

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback

WORDS = ["<pad>", "<eos>", "<unk>"] + [str(i) for i in range(61)]


def cpu_state(deepspeed_config) -> dict:
    """On a CPU machine Accelerate finds no backend for DeepSpeed and would make a world of one:
    give it gloo before the config, and the Trainer arguments that use that state (nothing on
    GPUs)."""
    if deepspeed_config and not torch.cuda.is_available() and "WORLD_SIZE" in os.environ:
        from accelerate import PartialState

        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        return {"accelerator_config": {"use_configured_state": True}}
    return {}


def tokenizer(padding_side: str = "left") -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the numbers 0-60, built in process."""
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    out.padding_side = padding_side
    return out


def initial_model(training_args, out: str) -> str:
    """The initial model's folder, written once by the main process (seeded)."""
    init = os.path.join(out, "init")
    with training_args.main_process_first(desc="the initial model"):
        first = training_args.process_index == 0
        if first and not os.path.exists(os.path.join(init, "config.json")):
            torch.manual_seed(0)
            config = LlamaConfig(
                num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=len(WORDS), max_position_embeddings=64,
                pad_token_id=0, eos_token_id=1, bos_token_id=None,
            )  # fmt: skip
            LlamaForCausalLM(config).save_pretrained(init)
    return init


class Record(TrainerCallback):
    """The Trainer's own logs, one entry per step: the numbers among ``keys`` it logged."""

    def __init__(self, keys) -> None:
        self.keys, self.logs = keys, []

    def on_log(self, _args, state, _control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append({"step": state.global_step, **{k: logs.get(k) for k in self.keys}})
