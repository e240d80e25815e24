"""``deepspeed.utils.zero_to_fp32``: one fp32 state dict from a checkpoint, with DeepSpeed's
three functions and arguments, over zerostack's format (any ZeRO stage, dp, tp or pp layout;
every tensor checked against its sha256 as it is read).

    python -m zerostack.compat.deepspeed.utils.zero_to_fp32 CKPT_DIR OUT_DIR [--safe_serialization]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

import torch

from zerostack.checkpoint import full_state_dict
from zerostack.checkpoint.state import _atomic_replace, _atomic_write

from .logging import logger

_PT = {"format": "pt"}  # what transformers' from_pretrained expects in a safetensors header
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir, tag=None, exclude_frozen_parameters: bool = False, lazy_mode: bool = False
) -> dict[str, torch.Tensor]:
    """The full fp32 weights and the buffers of the checkpoint in ``checkpoint_dir`` (``tag``, or
    the one ``latest`` names), on the CPU; loads with ``model.load_state_dict``.

    ``lazy_mode``: DeepSpeed returns placeholders that ``.contiguous()`` reads; here each
    parameter is read whole either way (one at a time), and ``.contiguous()`` on a tensor is the
    tensor, so code written for either works."""
    return full_state_dict(
        os.fspath(checkpoint_dir), tag=tag, exclude_frozen=exclude_frozen_parameters
    )


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir,
    output_dir,
    max_shard_size="5GB",
    safe_serialization: bool = False,
    tag=None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write the fp32 state dict to ``output_dir``: ``model.safetensors`` with
    ``safe_serialization``, else ``pytorch_model.bin`` (``torch.save``, as DeepSpeed); split at
    ``max_shard_size`` into Hugging Face's numbered shards plus an index (the split is
    ``huggingface_hub``'s, as in DeepSpeed; None writes one file). Files are written whole and
    renamed into place."""
    return convert_zero_checkpoint_to_state_dict(
        checkpoint_dir,
        output_dir,
        dtype=torch.float32,
        max_shard_size=max_shard_size,
        safe_serialization=safe_serialization,
        tag=tag,
        exclude_frozen_parameters=exclude_frozen_parameters,
    )


def convert_zero_checkpoint_to_state_dict(
    checkpoint_dir,
    output_dir,
    dtype=torch.float32,
    max_shard_size="5GB",
    safe_serialization: bool = False,
    tag=None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """:func:`convert_zero_checkpoint_to_fp32_state_dict` in ``dtype`` (a torch dtype or
    ``"fp32"``, ``"fp16"``, ``"bf16"``) for the floating-point tensors; others keep theirs."""
    dtype = _DTYPES.get(dtype, dtype)
    if dtype not in _DTYPES.values():
        raise ValueError(f"dtype {dtype!r}: expected torch.float32, float16 or bfloat16")
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    if max_shard_size is None:
        shards, index = {name: list(state)}, None
    else:
        from huggingface_hub import split_torch_state_dict_into_shards

        stem, ext = name.split(".", 1)
        pattern = stem + "{suffix}." + ext
        split = split_torch_state_dict_into_shards(
            state, filename_pattern=pattern, max_shard_size=max_shard_size
        )
        shards = split.filename_to_tensors
        index = (
            {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            if split.is_sharded
            else None
        )
    os.makedirs(output_dir, exist_ok=True)
    for file, names in shards.items():
        part = {k: state[k] for k in names}
        if safe_serialization:
            from safetensors.torch import save_file

            seen: set[int] = set()
            for k, v in part.items():  # a tied weight's second name: its own copy
                if id(v) in seen:
                    part[k] = v.clone()
                seen.add(id(v))
            _atomic_replace(os.path.join(output_dir, file), lambda p, t=part: save_file(t, p, _PT))
        else:
            _atomic_replace(os.path.join(output_dir, file), lambda p, t=part: torch.save(t, p))
    if index is not None:
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        _atomic_write(os.path.join(output_dir, f"{name}.index.json"), text)
    logger.info(f"wrote {len(state)} tensors in {len(shards)} file(s) to {output_dir}")


def get_model_state_file(checkpoint_dir, zero_stage) -> str:
    """The model-states file of DeepSpeed's files in a tag folder (``checkpoint_dir``; zerostack
    writes them beside its own under the DeepSpeed facade): ``mp_rank_00_model_states.pt`` at
    ZeRO stages 0-2, rank 0's ``zero_pp_rank_0_mp_rank_00_model_states.pt`` at stage 3."""
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"Directory '{checkpoint_dir}' doesn't exist")
    name = "mp_rank_00_model_states.pt"
    if int(zero_stage) == 3:
        name = "zero_pp_rank_0_" + name
    path = os.path.join(checkpoint_dir, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"can't find model states file at '{path}'")
    return path


def get_optim_files(checkpoint_dir) -> list[str]:
    """DeepSpeed's optimizer-state files in a tag folder, in dp rank order."""
    found = glob.glob(os.path.join(checkpoint_dir, "*_optim_states.pt"))
    if not found:
        raise FileNotFoundError(
            f"can't find '*_optim_states.pt' files in directory '{checkpoint_dir}'"
        )
    return sorted(
        found, key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p)]
    )


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Move ``model`` to the CPU, load the checkpoint's fp32 weights into it (non-strict, as
    DeepSpeed) and return it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output_dir")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true")
    parser.add_argument("-t", "--tag", default=None)
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    args = parser.parse_args(argv)
    convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir,
        args.output_dir,
        max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization,
        tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
