"""Joining and leaving the job's world: ``init_distributed`` (backend, device, timeouts, the
agent's store), ``shutdown``, and what the rest asks of the world (its device type, timeout).

:class:`~zerostack.topology.Topology` builds the grid over the world this module joined; the one
module-level record here is a list of weak references to the objects that hold process groups,
for :func:`shutdown`.
"""

from __future__ import annotations

import logging
import os
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn_functional

DEFAULT_TIMEOUT = timedelta(minutes=30)
WATCHDOG_BOUND = 120.0
"""The watchdog's bound in seconds when its block sets none (:mod:`zerostack.watchdog`)."""
NCCL_MARGIN = 60.0
"""Seconds NCCL's own timeout leaves the watchdog to name a hang before NCCL ends the job."""

_GROUP_HOLDERS: list[weakref.ref] = []
"""Objects that keep process groups (each :class:`Topology`, a pipeline's tied-weight groups),
weakly (a Topology compares by value, so it cannot be in a WeakSet); :func:`shutdown` calls
their ``release_groups()``."""


def hold_groups(holder) -> None:
    """Record ``holder`` (with a ``release_groups()`` method) for :func:`shutdown`."""
    _GROUP_HOLDERS[:] = [r for r in _GROUP_HOLDERS if r() is not None]
    _GROUP_HOLDERS.append(weakref.ref(holder))


def _launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


log = logging.getLogger("zerostack")


def device_type_of(backend: str, cuda_available: bool) -> str:
    """Where a group with ``backend`` computes: "cuda" when CUDA is available and the group
    reduces CUDA tensors with other than gloo ("nccl"; "cpu:gloo,cuda:nccl", as torchtitan sets
    it; no backend named, which is gloo + NCCL on a GPU machine), else "cpu". By what the group
    does on each device, never by its name: ``get_backend()`` of a gloo + NCCL group is not
    "nccl", and such a job trained on the CPU without a word."""
    if not cuda_available:
        return "cpu"
    if dist.Backend(backend) == dist.Backend.UNDEFINED:  # torch's default for each device
        devices = dist.Backend.default_device_backend_map
    else:
        devices = dist.BackendConfig(dist.Backend(backend)).get_device_backend_map()
    return "cuda" if devices.get("cuda", "gloo") != "gloo" else "cpu"


def world_device_type() -> str:
    """:func:`device_type_of` the world group (initialised)."""
    return device_type_of(dist.get_backend_config(), torch.cuda.is_available())


def local_device_index(local: int, visible: int) -> int:
    """The GPU of the rank whose launcher says ``LOCAL_RANK`` ``local``, among ``visible``
    devices: its own when visible; when fewer are visible (Slurm ``--gpus-per-task``, an MPI
    wrapper setting ``CUDA_VISIBLE_DEVICES`` per rank), the only one, or ``local % visible``,
    with a warning (``set_device(local)`` would fail with "invalid device ordinal")."""
    if local < visible or visible == 0:  # none visible: CUDA's own error, naming the index
        return local
    index = 0 if visible == 1 else local % visible
    log.warning(
        "LOCAL_RANK %d but %d visible GPU(s): using cuda:%d (one per process, as with Slurm's "
        "--gpus-per-task, is fine; otherwise check CUDA_VISIBLE_DEVICES)",
        local,
        visible,
        index,
    )
    return index


def default_backend() -> str:
    """NCCL when this process can see a CUDA device, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def default_timeout(backend: str | None = None, watchdog=None) -> timedelta:
    """The process groups' timeout when none is given, for ``backend`` (the default one: None)
    and the config's ``watchdog`` block (a :class:`~zerostack.config.WatchdogConfig`, or None
    for its defaults).

    On CUDA the watchdog's bound plus :data:`NCCL_MARGIN`: NCCL's collectives return before they
    run, so a collective that never completes is named by the watchdog, and NCCL's own timeout
    (dumping its flight recorder) follows a minute later, not 30 minutes later (torch's NCCL
    default is 10). On gloo, or with the watchdog off, DeepSpeed's 30 minutes."""
    backend = backend or default_backend()
    enabled = watchdog is None or watchdog.enabled
    if not enabled or device_type_of(backend, cuda_available=True) != "cuda":
        return DEFAULT_TIMEOUT
    bound = (watchdog.timeout if watchdog is not None else None) or WATCHDOG_BOUND
    return timedelta(seconds=bound + NCCL_MARGIN)


def init_distributed(
    dist_backend: str | None = None,
    timeout: timedelta | None = None,
    init_method: str | None = None,
    rank: int = -1,
    world_size: int = -1,
    *,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    **_ignored,
) -> None:
    """Initialise ``torch.distributed`` once, from the launcher's environment (DeepSpeed's
    signature).

    Under ``torchrun`` the rendezvous comes from ``RANK``/``WORLD_SIZE``/``MASTER_*``. Without
    them, the rank and world size come from Open MPI, MPICH/PMI or Slurm's ``srun`` (with
    ``auto_mpi_discovery``), rank 0's address from ``MASTER_ADDR`` or Slurm's node list, the port
    from ``MASTER_PORT`` or ``distributed_port`` (see :mod:`zerostack.launcher.discovery`); a
    world larger than one with no address is a ``RendezvousError``. A plain ``python script.py``
    runs as a world of one with an in-memory store, so scripts need no launcher to try things.
    Calling again after initialisation does nothing. ``timeout`` defaults to
    :func:`default_timeout`'s; on CUDA, NCCL's flight recorder is switched on where the
    environment does not set its variables (:data:`.launcher.environment.FLIGHT_RECORDER`).
    """
    if dist.is_initialized():
        return
    backend = dist_backend or default_backend()
    timeout = timeout if timeout is not None else default_timeout(backend)
    if init_method is None and not _launched_by_torchrun():
        from .launcher.discovery import discover

        found = discover(
            os.environ,
            rank=rank,
            world_size=world_size,
            default_port=distributed_port,
            mpi=auto_mpi_discovery,
        )
        if found is not None and found.world_size > 1:
            os.environ.update(found.env())  # what torch's env:// and LOCAL_RANK readers expect
    bound = {}
    cuda = device_type_of(backend, cuda_available=True) == "cuda"  # asked for, so meant
    if cuda:
        from .launcher.environment import FLIGHT_RECORDER

        for key, value in FLIGHT_RECORDER.items():  # read when NCCL's group is made
            os.environ.setdefault(key, value)
    if cuda and "LOCAL_RANK" in os.environ:
        # this rank's GPU, before the group exists: NCCL's communicators bind to it (device_id),
        # instead of every rank of a node landing on cuda:0
        index = local_device_index(int(os.environ["LOCAL_RANK"]), torch.cuda.device_count())
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        bound = {"device_id": device}
    if init_method is None and _restartable_agent_store():
        store, rank, world_size = _attempt_store(timeout)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **bound
        )
    elif init_method is not None or _launched_by_torchrun():
        dist.init_process_group(
            backend,
            init_method=init_method,
            timeout=timeout,
            rank=rank,
            world_size=world_size,
            **bound,
        )
    else:
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **bound
        )


def _bind_local_device() -> None:
    """A process group made outside zerostack, with no ``set_device``: every rank of a node
    would compute on cuda:0. Take the launcher's ``LOCAL_RANK`` device when it is visible and
    not the current one (with one visible GPU per process, cuda:0 is right)."""
    local = os.environ.get("LOCAL_RANK")
    if local is None:
        return
    index = local_device_index(int(local), torch.cuda.device_count())
    if index != torch.cuda.current_device():
        torch.cuda.set_device(index)


def _restartable_agent_store() -> bool:
    """Under torchrun whose agent serves the job's store (the default): the store outlives a
    restart (``--max-restarts``), so keys of the failed attempt are still in it."""
    return _launched_by_torchrun() and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _attempt_store(timeout: timedelta):
    """torchrun's store seen under a prefix per attempt (``TORCHELASTIC_RESTART_COUNT``).

    torch's ``env://`` rendezvous adds no such prefix, trusting a new store per attempt, but with
    the c10d rendezvous the agent shares one store across restarts: a restarted rank could read
    a dead peer's gloo address, and the watchdog its last heartbeat (pytorch#135712)."""
    env = os.environ
    store = dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        int(env["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefixed = dist.PrefixStore(f"/zerostack/attempt_{attempt}/", store)
    return prefixed, int(env["RANK"]), int(env["WORLD_SIZE"])


def shutdown() -> None:
    """Tear the process groups down together: a barrier, then ``destroy_process_group``, and
    the groups' worker threads end here, not at interpreter exit.

    A rank that destroys its gloo group while a peer is still running (say, rank 0 writing its
    summary) can abort at exit with "terminate called without an active exception"; the barrier
    makes every rank arrive first. The same abort follows when a group outlives
    ``destroy_process_group`` (a DeviceMesh keeps its groups; ``torch.distributed.nn.functional``
    keeps the world group as a default argument): the interpreter's final collection destroys
    it, and a gloo thread still dropping a finished collective's tensor asks for the GIL of an
    interpreter that is ending (std::terminate). Releasing every reference first destroys each
    group inside ``destroy_process_group``, which joins its threads.
    """
    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        dist.barrier()
    for ref in _GROUP_HOLDERS:
        holder = ref()
        if holder is not None:
            holder.release_groups()
    _GROUP_HOLDERS.clear()
    _release_default_arguments()
    dist.destroy_process_group()


def _release_default_arguments() -> None:
    """``torch.distributed.nn.functional``'s functions take ``group=group.WORLD``, evaluated when
    the module is imported: after ``init_process_group`` (torch._dynamo imports it with the first
    optimizer), the defaults hold the world group. None is the same group to them (their
    collectives read None as the default group) and holds nothing."""
    for fn in vars(dist_nn_functional).values():
        defaults = getattr(fn, "__defaults__", None)
        if getattr(fn, "__module__", None) == dist_nn_functional.__name__ and defaults:
            fn.__defaults__ = tuple(
                None if isinstance(d, dist.ProcessGroup) else d for d in defaults
            )


def world_timeout() -> timedelta:
    """The timeout the world group was initialised with (torch keeps it on the backend)."""
    group = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return DEFAULT_TIMEOUT


def _set_group_timeout(group: dist.ProcessGroup, timeout: timedelta) -> None:
    # DeviceMesh creates its sub-groups with the backend's default timeout (30 min for gloo), not
    # the world group's; bring them in line so a stuck collective fails as fast as the user asked.
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is not None:
        setter(timeout, group)
