"""Data for the engine: :mod:`.sampler` is the data loader's resumable sampler.

(The demo's corpus is :mod:`zerostack.demo.corpus`.)
"""
