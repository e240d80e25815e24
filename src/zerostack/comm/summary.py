"""DeepSpeed's comms logger: every profiled collective summarised by op and message size, with
its latency and bandwidth, printed as DeepSpeed's ``log_summary()`` table.

The sizes and formulas are DeepSpeed's (``deepspeed/utils/comms_logging.py``, after nccl-tests'
PERFORMANCE.md): the *message size* is the tensor a rank passes in (an all-gather's input, a
reduce-scatter's input, an all-reduce's tensor); latency is in ms; algbw and busbw in Gbps, with
``n`` the number of ranks in the collective::

    all_reduce                  algbw = 2 S / t          busbw = S / t * 2 (n - 1) / n
    all_gather (S per rank)     algbw = n S / t          busbw = n S / t * (n - 1) / n
    reduce_scatter (S in all)   algbw = S / t            busbw = S / t * (n - 1) / n
    all_to_all                  algbw = S / t            busbw = S / t * (n - 1) / n
    broadcast, p2p, barrier...  algbw = busbw = S / t

Two differences from DeepSpeed, both fixes: DeepSpeed multiplies a reduce-scatter's size by n
although its message size is already the whole input (n times what each rank keeps), and takes
``n`` as the world size even for a collective on a smaller group. Each latency is the op's own;
DeepSpeed's timer sums every earlier call of the same name into the next one's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime

import torch
import torch.distributed as dist

from ..core.progress import print_progress
from ..world import world_device_type
from .records import CommLog, CommRecord

_ALL_REDUCES = ("all_reduce", "all_reduce_coalesced", "inference_all_reduce")
_GATHERS = ("all_gather", "all_gather_into_tensor")
_SCATTERS = ("reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single")
HEADER = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)")
HEADER += ("tput_avg (Gbps)", "busbw_avg (Gbps)")
STRAGGLER_HEADER = ("Comm. Op", "Message Size", "Count", "Total comm lat(ms)")
STRAGGLER_HEADER += ("Total straggler(ms)", "Avg comm lat(ms)", "Avg straggler(ms)")


def message_size(op: str, nbytes: int, ranks: int) -> int:
    """DeepSpeed's message size of a collective whose full buffer is ``nbytes`` (the CommLog's
    unit): an all-gather's is the per-rank input, every other op's the whole buffer."""
    return nbytes // max(ranks, 1) if op in _GATHERS else nbytes


def bandwidth(op: str, size: int, ms: float, n: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in Gbps of ``op`` moving a message of ``size`` bytes in ``ms`` on
    ``n`` ranks (the formulas in the module docstring)."""
    if ms <= 0:
        return 0.0, 0.0
    n = max(n, 1)
    if op in _ALL_REDUCES:
        algbw, busbw = 2 * size / ms, size / ms * (2 * (n - 1) / n)
    elif op in _GATHERS:
        algbw = size * n / ms
        busbw = algbw * ((n - 1) / n)
    elif op in _SCATTERS:
        algbw = size / ms
        busbw = algbw * ((n - 1) / n)
    else:
        algbw = busbw = size / ms
    return algbw * 8 / 1e6, busbw * 8 / 1e6  # bytes per ms -> Gbit/s


def convert_size(size_bytes: int) -> str:
    """DeepSpeed's human-readable size: ``4.0 KB``, ``1.5 MB`` (powers of 1024)."""
    if size_bytes == 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
    i = int(math.floor(math.log(size_bytes, 1024)))
    return f"{round(size_bytes / math.pow(1024, i), 2)} {names[i]}"


def trim_mean(data: list[float], trim_percent: float) -> float:
    """The mean without the lowest and highest ``trim_percent`` of the values (DeepSpeed's)."""
    n = len(data)
    if n == 0:
        return 0
    k = int(round(n * trim_percent))
    kept = sorted(data)[k : n - k]
    return sum(kept) / len(kept)


def _row(cells, formats=None) -> str:
    formats = formats or ("",) * len(cells)
    return "".join(f"{c: <20{f}}" for c, f in zip(cells, formats, strict=True))


class CommsLogger:
    """The process's comms logger (DeepSpeed's ``CommsLogger``): which ops it profiles, and per
    record name and message size ``[count, [latency ms], [algbw], [busbw]]`` (``comms_dict``).

    It is fed by :mod:`zerostack.comm`'s module functions and by the CommLogs it follows (an
    engine's); nothing is recorded while it is disabled.
    """

    def __init__(self) -> None:
        self.enabled = False
        self.verbose = False
        self.prof_all = True
        self.debug = False
        self.prof_ops: list[str] = []
        self.comms_dict: dict[str, dict[int, list]] = {}
        self.out: Callable[[str], None] | None = None  # the verbose lines (default: rank 0 prints)

    def configure(self, block) -> None:
        """Take the five keys of a ``comms_logger`` config block."""
        self.enabled, self.verbose, self.debug = block.enabled, block.verbose, block.debug
        self.prof_all, self.prof_ops = block.prof_all, list(block.prof_ops)

    def profiles(self, name: str, prof: bool = False) -> bool:
        """Whether a collective logged as ``name`` is recorded now."""
        return self.enabled and (prof or self.prof_all or name in self.prof_ops)

    # DeepSpeed's switches: all ops, or ops by name
    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = list(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = [op for op in self.prof_ops if op not in op_name_list]

    def follow(self, log: CommLog) -> None:
        """Summarise ``log``'s collectives too (an engine's), as each completes."""
        if self.observe not in log.observers:
            log.observers.append(self.observe)

    def observe(self, rec: CommRecord) -> None:
        if not self.profiles(rec.op):
            return
        name = f"{rec.op} | [axis: {rec.axis}]" if self.debug else rec.op
        self.add(rec.op, name, rec.seconds, rec.bytes, rec.ranks)

    def add(self, op: str, name: str, seconds: float, nbytes: int, ranks: int) -> None:
        """One completed collective: ``op`` names its kind (for the formulas), ``name`` its row;
        ``nbytes`` is its full buffer (the CommLog's unit) on ``ranks`` ranks."""
        ms = seconds * 1e3
        size = message_size(op, nbytes, ranks)
        algbw, busbw = bandwidth(op, size, ms, ranks)
        entry = self.comms_dict.setdefault(name, {}).setdefault(size, [0, [], [], []])
        entry[0] += 1
        entry[1].append(ms)
        entry[2].append(algbw)
        entry[3].append(busbw)
        if self.verbose:
            line = (
                f"comm op: {name} | time (ms): {ms:.2f} | msg size: {convert_size(size)} "
                f"| algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}"
            )
            (self.out or _print_rank_0)(line)

    # DeepSpeed's accessors
    def get_raw_data(self) -> dict:
        return self.comms_dict.copy()

    def has_data(self) -> bool:
        return len(self.comms_dict) > 0

    def reset_data(self) -> None:
        self.comms_dict.clear()

    def get_operation_names(self) -> list[str]:
        return list(self.comms_dict)

    def get_total_operations(self) -> int:
        return sum(v[0] for sizes in self.comms_dict.values() for v in sizes.values())

    def get_operation_summary(self, operation_name: str) -> dict | None:
        if operation_name not in self.comms_dict:
            return None
        return {s: _stats(s, v) for s, v in self.comms_dict[operation_name].copy().items()}

    def log_all(self, print_log=True, show_straggler=False, return_dict=False) -> dict | None:
        """Print (``print_log``) and/or return (``return_dict``) the summary, DeepSpeed's table
        and dictionary; ``show_straggler`` adds each op's wait for the slowest rank (the latency
        minus the fastest rank's, an all-reduce over every rank: call it on all of them)."""
        snapshot = {name: dict(sizes) for name, sizes in self.comms_dict.items()}
        result = None
        if return_dict:
            initialized = dist.is_initialized()
            result = {
                "summary": {},
                "straggler_analysis": None,
                "metadata": {
                    "world_size": dist.get_world_size() if initialized else 1,
                    "rank": dist.get_rank() if initialized else 0,
                    "timestamp": datetime.now().isoformat(),
                },
            }
        if print_log:
            print(_row(HEADER))
        for name, sizes in snapshot.items():
            if print_log:
                print(name)
            if return_dict:
                result["summary"][name] = {}
            for size, vals in sorted(sizes.items()):
                stats = _stats(size, vals)
                if return_dict:
                    result["summary"][name][size] = stats
                if print_log:
                    cells = ("", stats["msg_size_str"], vals[0], stats["total_latency_ms"])
                    cells += (stats["avg_latency_ms"], stats["tput_avg_gbps"])
                    cells += (stats["busbw_avg_gbps"],)
                    print(_row(cells, ("", "", "", ".2f", ".2f", ".2f", ".2f")))
        if show_straggler:
            stragglers = _straggler_analysis(snapshot, print_log)
            if return_dict:
                result["straggler_analysis"] = stragglers
        return result


def _stats(size: int, vals: list) -> dict:
    return {
        "count": vals[0],
        "total_latency_ms": sum(vals[1]),
        "avg_latency_ms": trim_mean(vals[1], 0.1),
        "tput_avg_gbps": trim_mean(vals[2], 0.1),
        "busbw_avg_gbps": trim_mean(vals[3], 0.1),
        "msg_size_bytes": size,
        "msg_size_str": convert_size(size),
    }


def _straggler_analysis(snapshot: dict, print_log: bool) -> dict:
    """Per op and size: latencies against the fastest rank's (a MIN all-reduce per entry, in
    the same order on every rank, which DeepSpeed also assumes: every rank ran the same ops)."""
    if print_log:
        print("_______________________________")
        print("Breakdown with straggler effect")
        print("-------------------------------")
        print(_row(STRAGGLER_HEADER))
    cuda = world_device_type() == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    out: dict = {}
    for name, sizes in snapshot.items():
        if print_log:
            print(name)
        out[name] = {}
        for size, vals in sorted(sizes.items()):
            lats = torch.tensor(vals[1], dtype=torch.float64, device=device)
            fastest = lats.clone()
            dist.all_reduce(fastest, op=dist.ReduceOp.MIN)  # not itself logged
            straggle = (lats - fastest).tolist()
            entry = {
                "count": vals[0],
                "total_comm_lat_ms": fastest.sum().item(),
                "total_straggler_ms": sum(straggle),
                "avg_comm_lat_ms": trim_mean(fastest.tolist(), 0.1),
                "avg_straggler_ms": trim_mean(straggle, 0.1),
                "msg_size_bytes": size,
                "msg_size_str": convert_size(size),
            }
            out[name][size] = entry
            if print_log:
                cells = ("", entry["msg_size_str"], vals[0], entry["total_comm_lat_ms"])
                cells += (entry["total_straggler_ms"], entry["avg_comm_lat_ms"])
                cells += (entry["avg_straggler_ms"],)
                print(_row(cells, ("", "", "", ".2f", ".2f", ".2f", ".2f")))
    return out


comms_logger = CommsLogger()  # the process's (DeepSpeed's deepspeed.comm.comms_logger)


def _print_rank_0(line: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print_progress(line)
