"""``deepspeed.ops``: the optimizers Accelerate and DeepSpeed configs name, and the BERT layer
of DeepSpeed's tutorials. zerostack has no compiled ops: these are torch's optimizers, zerostack's
CPU Adam, its Lion and LAMB, and a plain-torch transformer layer; also DeepSpeed4Science's Evoformer
attention in torch and the DeepNVMe handles over Python file I/O (``op_builder``)."""

from . import adagrad, adam, deepspeed4science, lamb, lion, op_builder, transformer

__all__ = ["adagrad", "adam", "deepspeed4science", "lamb", "lion", "op_builder", "transformer"]
