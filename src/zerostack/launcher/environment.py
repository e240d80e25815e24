"""What a launch carries to every node: DeepSpeed's exported variables and its env files.

As DeepSpeed's runner does, variables whose names start with one of :data:`EXPORT_PREFIXES`
travel to every node (and NCCL's flight recorder, :data:`FLIGHT_RECORDER`), with the current
folder put first on ``PYTHONPATH``; then the lines of
``.deepspeed_env`` (the name ``DS_ENV_FILE`` gives, if set) and then ``.zerostack_env``, each
looked for in the home folder and then the current one (a later file wins). A file holds
``KEY=VALUE`` lines; blank lines and ``#`` comments are skipped.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from .hostfile import LaunchError

# DeepSpeed's list (with CUDA's NCCL), and GLOO for CPU jobs (GLOO_SOCKET_IFNAME)
EXPORT_PREFIXES = ("NCCL", "PYTHON", "MLFLOW", "MV2", "UCX", "GLOO")

_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1", "ip6-localhost"}

FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
"""NCCL's flight recorder, on unless the environment sets these: a collective that times out
then writes each rank's last collectives (op, sizes, state) to ``TORCH_FR_DUMP_TEMP_FILE``
(default ``/tmp/nccl_trace_rank_<rank>``; ``torchfrtrace`` reads them). Every node gets them
from the launcher, and :func:`zerostack.init_distributed` sets them too (under plain torchrun)."""


def parse_env_file(text: str, path: str) -> dict[str, str]:
    """``{KEY: VALUE}`` from an env file's text; a line without ``=`` names ``path:line``."""
    out: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip() or " " in key.strip():
            raise LaunchError(f"{path}:{number}: {line!r} is not KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def env_file_names(env: Mapping[str, str]) -> list[str]:
    """DeepSpeed's file (``DS_ENV_FILE`` or ``.deepspeed_env``), then zerostack's."""
    return [env.get("DS_ENV_FILE", ".deepspeed_env"), ".zerostack_env"]


def exports(env: Mapping[str, str], cwd: str, home: str) -> dict[str, str]:
    """The variables every node gets: the exported prefixes, ``PYTHONPATH`` with ``cwd`` first,
    then the env files (home folder, then ``cwd``)."""
    out = {k: v for k, v in env.items() if k.startswith(EXPORT_PREFIXES)}
    out.update({k: env.get(k, v) for k, v in FLIGHT_RECORDER.items()})
    out["PYTHONPATH"] = cwd + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for name in env_file_names(env):
        for folder in (home, cwd):
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                with open(path) as f:
                    out.update(parse_env_file(f.read(), path))
    return out


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine (loopback names, or its own host name)."""
    if host in _LOCAL_NAMES or host.startswith("127."):
        return True
    return host in (socket.gethostname(), socket.getfqdn())
