"""``deepspeed.compression``: DeepSpeed 0.19.8 keeps only :mod:`.helper` of its compression
library, for the scripts that import two helpers from it."""
