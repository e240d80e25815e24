"""ZeRO-Offload and ZeRO-Infinity: optimizer state and parameter pieces off the device.

:mod:`.host` is the offload set-up both strategies are given (:class:`~.host.HostOffload`:
pinned host memory, copies up and down that do not stop the host, the host meter) and the
optimizer swapper; :mod:`.masters` the masters' store (memory or files), :mod:`.nvme` one rank's
folder of files, :mod:`.aio` the asynchronous file handles, :mod:`.param_swap` stage 3's
parameter pieces in files or host memory, :mod:`.states` ``engine.offload_states()``.
"""
