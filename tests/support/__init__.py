"""What the tests share: ``ranks`` (gloo ranks, rank processes), ``models`` (the tiny GPT, its
batches, the fp32 reference), ``parity``, ``matrix``, ``census``, ``hf`` and ``vcuda``."""
