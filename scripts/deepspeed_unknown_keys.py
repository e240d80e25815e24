r"""Record where DeepSpeed refuses a key it does not know, and where it ignores one.

Run under DeepSpeed's virtualenv (zerostack is not imported); without --write it prints the JSON::

    DS_ACCELERATOR=cpu .peers/bin/python scripts/deepspeed_unknown_keys.py \
        --write tests/golden/deepspeed_unknown_keys.json

For each block of :data:`BLOCKS` (``""``: the top level), a config holding one made-up key in
that block is given to ``DeepSpeedConfig`` (world size 1, no process group): ``"refused"`` with
the error's first line, or ``"ignored"``. ``optimizer.params`` and ``scheduler.params`` are
keyword arguments of the classes DeepSpeed builds at ``initialize`` (its AdamW is FusedAdam, its
WarmupLR is ``lr_schedules.WarmupLR``): they are probed by calling those; so is
``tensor_parallel.partition_config`` (a dict AutoTP reads), through the config's
``get_partition_config_object``. zerostack's facade
(``zerostack.config.keys.DEEPSPEED_REFUSES_UNKNOWN``) follows this table, and
tests/test_config_keys.py holds the two together.
"""

import argparse
import contextlib
import json
import os
import pathlib
import sys

COMMAND = (
    "DS_ACCELERATOR=cpu .peers/bin/python scripts/deepspeed_unknown_keys.py"
    " --write tests/golden/deepspeed_unknown_keys.json"
)
UNKNOWN = "zz_not_a_key"
BLOCKS = """
activation_checkpointing aio autotuning bf16 checkpoint checkpoint.parallel_write comet
comms_logger compile csv_monitor data_efficiency data_efficiency.data_sampling
data_efficiency.data_sampling.dynamic_batching data_types expert_parallel flops_profiler fp16
hybrid_engine optimizer optimizer.params pipeline scheduler scheduler.params tensor_parallel
tensor_parallel.partition_config tensor_parallel.partition_config.layer_specs
tensorboard timers torch_autocast wandb zero_optimization zero_optimization.offload_optimizer
zero_optimization.offload_param zero_optimization.leaf_module
""".split()
BLOCKS = ["", *BLOCKS]
"""Every block of zerostack's config and every block DeepSpeed 0.19.8 reads, with the top level
(tests/test_config_keys.py checks that none is missing)."""

# What a block needs beside the made-up key for DeepSpeed to read it at all.
NEEDS = {"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR"}}


def _nested(path: str, leaf: dict) -> dict:
    out = leaf
    for part in reversed(path.split(".")):
        out = {part: {**NEEDS.get(part, {}), **out}}
    return out


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"


def probe(block: str) -> dict:
    import torch
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.lr_schedules import WarmupLR

    try:
        if block == "optimizer.params":
            from deepspeed.ops.adam import FusedAdam

            params = [torch.nn.Parameter(torch.zeros(1))]
            try:
                FusedAdam(params, **{UNKNOWN: 1})
            except (ImportError, RuntimeError):  # no compiled op here: torch's, as its fallback
                torch.optim.AdamW(params, **{UNKNOWN: 1})
        elif block.startswith("tensor_parallel.partition_config"):
            # a dict DeepSpeed reads when it builds AutoTP (its AutoTPConfig.from_dict)
            spec = {"patterns": [".*"]}
            part = {"layer_specs": [{**spec, UNKNOWN: 1}]} if block.endswith("specs") else {
                "layer_specs": [spec], UNKNOWN: 1}  # fmt: skip
            cfg = {"train_batch_size": 1, "tensor_parallel": {"partition_config": part}}
            DeepSpeedConfig(cfg).tensor_parallel_config.get_partition_config_object()
        elif block == "scheduler.params":
            opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
            WarmupLR(opt, **{UNKNOWN: 1})
        else:
            leaf = {UNKNOWN: 1}
            cfg = {"train_batch_size": 1, **(_nested(block, leaf) if block else leaf)}
            DeepSpeedConfig(cfg)
    except Exception as exc:  # noqa: BLE001 - whatever DeepSpeed raises is the fact recorded
        return {"deepspeed": "refused", "error": _first_line(exc)}
    return {"deepspeed": "ignored"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="PATH", help="write the JSON here, not to stdout")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout
        import deepspeed

        blocks = {block: probe(block) for block in BLOCKS}
    doc = {"deepspeed_version": deepspeed.__version__, "command": COMMAND, "blocks": blocks}
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    pathlib.Path(args.write).write_text(text) if args.write else sys.stdout.write(text)


if __name__ == "__main__":
    main()
