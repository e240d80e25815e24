"""Other libraries' names for zerostack.

``zerostack.compat.deepspeed`` is DeepSpeed 0.19.8's module tree as Hugging Face Transformers,
Accelerate and Lightning import it, served by zerostack; its ``install()`` makes
``import deepspeed`` and the ``deepspeed`` distribution's metadata resolve to it, so those
libraries find and drive zerostack with no change to a training script.
"""
