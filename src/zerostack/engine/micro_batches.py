"""Whole batches on any engine: ``engine.train_batch()`` and ``engine.eval_batch()``.

DeepSpeed offers them on its pipeline engine; zerostack offers them on every engine, as Megatron
chooses a forward-backward function: with no pipeline (:class:`MicroBatches`) a batch is
``gradient_accumulation_steps`` micro-batches, each ``loss = engine(*micro_batch)`` (the module
returns the loss), ``engine.backward(loss)``, ``engine.step()``; with a ``PipelineModule`` the
engine's runner is :class:`zerostack.pipeline.runner.PipelineRunner`, which runs the same batch
through its schedule instead. Either way ``runner.run(engine, data_iter, train=...)`` returns the
batch's mean loss over every micro-batch and every dp rank, and without an iterator the batch
comes from the loader ``initialize(training_data=...)`` built, repeated epoch after epoch
(DeepSpeed's ``RepeatingLoader``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def map_tensors(obj, fn):
    """``obj`` (a tensor, or a tuple, list or dict of them, nested) with ``fn`` applied to each
    tensor; anything else passes through."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def to_device(batch, device: torch.device):
    """The tensors of a micro-batch on ``device`` (a copy from page-locked memory, as the
    engine's loader makes on a GPU, does not hold up the host)."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


def cast_inputs(inputs, auto_cast: bool):
    """DeepSpeed's input rule (its engine's ``_cast_inputs_half``, applied to the positional
    inputs only): with ``fp16.auto_cast`` every floating-point tensor in ``inputs`` (inside
    lists, tuples and dicts too) becomes fp16, whatever the precision; integer and bool tensors
    stay as they are. Without it nothing is cast: under bf16 or plain fp16 the model gets its
    inputs as given."""
    if not auto_cast:
        return inputs
    return map_tensors(inputs, lambda t: t.half() if t.is_floating_point() else t)


def _call(engine, batch):
    if isinstance(batch, dict):
        return engine(**batch)
    if isinstance(batch, (list, tuple)):
        return engine(*batch)
    return engine(batch)


class MicroBatches:
    """The runner without a pipeline: a batch is ``gradient_accumulation_steps`` micro-batches,
    each ``loss = engine(*micro_batch)``, ``engine.backward(loss)``, ``engine.step()``."""

    pipelined = False  # the engine's forward, backward and step are the user's to call too
    is_first_stage = is_last_stage = True  # one stage, both

    def replicated(self) -> set:
        """Parameters this runner knows another rank also holds (none)."""
        return set()

    def run(self, engine, data_iter: Iterator, *, train: bool) -> torch.Tensor:
        """The micro-batches of one batch from ``data_iter`` through the engine (with backward
        and step when ``train``); the mean of their losses over the batch and the dp ranks."""
        gas = engine.batch[2]
        total = torch.zeros((), dtype=torch.float32, device=engine.topology.device)
        with torch.set_grad_enabled(train):
            for _ in range(gas):
                loss = _call(engine, to_device(next(data_iter), engine.topology.device))
                if train:
                    engine.backward(loss)
                    engine.step()
                total += loss.detach().float()
        total = total / gas
        if engine.topology.dp > 1:
            engine.comm.all_reduce(total, axis="dp")
            total /= engine.topology.dp
        return total
