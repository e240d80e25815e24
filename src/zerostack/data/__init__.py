"""Data for the engine: :mod:`.sampler` is the data loader's resumable sampler;
:mod:`.variable_batch` packs samples of different lengths under a token budget and scales the
learning rate by each batch's size (DeepSpeed's dynamic batching); :mod:`.indexed_dataset` reads
and writes Megatron's and DeepSpeed's ``.idx`` / ``.bin`` datasets.

(The demo's corpus is :mod:`zerostack.demo.corpus`.)
"""
