"""The machine a plan is for: devices, memory, peak and achieved throughput, links.

A :class:`Hardware` is plain data. Bundled profiles are **nominal**: vendor peak figures and
commonly reported link speeds, with an achieved-matmul fraction that is an assumption, not a
measurement (``nominal=True``); ``zerostack plan --calibrate`` measures this machine instead
(:func:`calibrate`: a large matmul and a gloo all-reduce between two local processes).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

GB = 1e9


class PlanError(ValueError):
    """A plan that cannot be made (one line naming what)."""


@dataclass(frozen=True)
class Hardware:
    """Per device: memory, peak and achieved flop rate; links: bandwidth (bytes/s, one
    direction, per device) and latency inside a node and between nodes; host side: PCIe to the
    host and the CPU's optimizer throughput (parameters per second of Adam)."""

    name: str
    gpus: int
    gpus_per_node: int
    memory_bytes: float
    peak_flops: float  # per device, in the training dtype
    matmul_efficiency: float = 0.6  # achieved / peak on a transformer's matmuls
    # the attention core (FlashAttention's fused kernel): achieved / peak in the flops it
    # really runs (causal: half the square); 0: as matmul_efficiency (a calibrated machine,
    # whose layer measurement already holds it)
    attention_efficiency: float = 0.0
    hbm_bw: float = float("inf")  # device memory bandwidth (inf: elementwise work is in the
    # measured efficiency, as a calibrated machine's is)
    # what a training step's kernels reach of each kernel's own benchmark above (smaller shapes
    # than the best, gaps between launches, interference with communication), and NCCL's bus
    # bandwidth of the links' line rate: fitted to the published runs for the nominal profiles
    # (benchmarks/published.py --fit), 1 for a calibrated machine (measured as a step runs)
    kernel_derate: float = 1.0
    link_efficiency: float = 1.0
    # how much slower compute runs while a collective overlaps it (0.189: 18.9% slower); a
    # calibrated machine's 0 (its ranks share cores and do not overlap)
    overlap_slowdown: float = 0.0
    intra_bw: float = 150 * GB  # inside a node, per device
    inter_bw: float = 12.5 * GB  # between nodes, per device
    intra_latency: float = 5e-6
    inter_latency: float = 10e-6
    host_bw: float = 25 * GB  # PCIe device <-> host, per device
    cpu_adam_params_per_s: float = 1e9  # CPUAdam throughput per device's host share
    device_adam_bytes_per_s: float = 1.5e12  # optimizer step on the device (memory bound)
    nominal: bool = True
    # 0: each device computes on its own. n > 0: the devices are processes sharing n CPU cores
    # (calibrated with more ranks than cores): a rank that waits lends its core to the others,
    # and collectives use the same cores as compute, so they do not overlap it.
    shared_cores: int = 0

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise PlanError(f"gpus: {self.gpus} with {self.gpus_per_node} per node")
        if self.gpus % self.gpus_per_node and self.gpus > self.gpus_per_node:
            raise PlanError(
                f"gpus: {self.gpus} is not a whole number of nodes of {self.gpus_per_node}"
            )
        for name in ("memory_bytes", "peak_flops", "intra_bw", "inter_bw"):
            if getattr(self, name) <= 0:
                raise PlanError(f"{name}: {getattr(self, name)} must be positive")
        fractions = (
            "matmul_efficiency",
            "attention_efficiency",
            "kernel_derate",
            "link_efficiency",
        )
        for name in fractions:
            value = getattr(self, name)
            if not 0 < value <= 1 and not (name == "attention_efficiency" and value == 0):
                raise PlanError(f"{name}: {value} is not in (0, 1]")
        if not 0 <= self.overlap_slowdown < 1:
            raise PlanError(f"overlap_slowdown: {self.overlap_slowdown} is not in [0, 1)")
        if self.hbm_bw <= 0:
            raise PlanError(f"hbm_bw: {self.hbm_bw} must be positive")

    def scaled(self, **changes) -> Hardware:
        return dataclasses.replace(self, **changes)


# Nominal profiles, each figure with its source:
# * peak: the vendors' data sheets, dense bf16/fp16 tensor cores (A100 312 TFLOP/s; H100 and H200
#   SXM 989; HGX B200 2,250), HBM bandwidth likewise (A100 80GB 2.039 TB/s; H100 SXM 3.35;
#   H200 4.8; B200 8.0);
# * matmul_efficiency: the Maximum Achievable Matmul FLOPS measured with mamf-finder.py over
#   bf16 shapes (stas00/ml-engineering, compute/accelerator/README.md, "Maximum Achievable
#   Matmul FLOPS comparison table"): A100 SXM 267.9 of 312 (85.9%), H100 SXM 792.1 of 989
#   (80.1%); H200 and B200 are not in it: the H100's fraction is used (H200 is the same chip);
# * attention_efficiency: FlashAttention-2 (Dao 2023, arXiv 2307.08691, section 4.1): forward
#   and backward reach 50-73% of the A100's peak (0.55 taken, the causal, 2k-8k end) and up to
#   335 TFLOP/s on an H100 (0.34); B200 assumed as H100;
# * links: NVLink 3 600 GB/s and NVLink 4 900 GB/s bidirectional per GPU (300 and 450 one way);
#   NVLink 5 1.8 TB/s (900 one way); between nodes, the fabric (FABRICS, below).
# * kernel_derate and link_efficiency: fitted together to the 28 published runs the cost model
#   prices (benchmarks/published.py --fit: 5.7% mean absolute error, and 5.7% for each row
#   predicted with the pair fitted to the others).
FITTED = {"kernel_derate": 0.75, "link_efficiency": 0.85}
# * overlap_slowdown: compute running beside collectives (NCCL's kernels take SMs and memory
#   bandwidth) is slower by 18.9% on average, measured on A100s and H100s (Lee et al. 2025,
#   "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
#   Learning", arXiv 2507.03114, abstract); taken as published, not fitted.
OVERLAP_SLOWDOWN = 0.189

# Fabrics between nodes: one way, per device (``inter_bw``), at the line rate. Each profile
# below carries the fabric its DGX/HGX system ships with (one adapter per GPU); ``profile(...,
# fabric=...)`` puts another in:
# * infiniband-hdr: one 200 Gb/s HDR adapter per GPU (DGX A100; Narayanan et al. 2021, section
#   5: Selene's "eight NVIDIA Mellanox 200Gbps HDR Infiniband HCAs" per server);
# * infiniband-ndr: one 400 Gb/s NDR adapter per GPU (DGX H100, H200, B200);
# * roce-400g: RDMA over Converged Ethernet at 400 Gb/s per GPU, as Llama 3 405B trained on it
#   (the Llama 3 paper, arXiv 2407.21783, section 3.3.1: its RoCE and InfiniBand clusters both
#   "leverage 400 Gbps interconnects between GPUs"); no latency of its own is known to us, so
#   the profile's is kept;
# * omni-path: Intel Omni-Path (100 Gb/s a link), four links per 8-GPU node, as BLOOM trained
#   on Jean Zay (bigscience train/tr11-176B-ml/README.md: "8 GPUs per node ... 4 OmniPath
#   links").
FABRICS: dict[str, float] = {
    "infiniband-hdr": 200e9 / 8,
    "infiniband-ndr": 400e9 / 8,
    "roce-400g": 400e9 / 8,
    "omni-path": 4 * 100e9 / 8 / 8,
}

PROFILES: dict[str, Hardware] = {
    "a100-80gb": Hardware(
        name="a100-80gb",
        gpus=8,
        gpus_per_node=8,
        memory_bytes=80 * GB,
        peak_flops=312e12,
        matmul_efficiency=0.859,
        attention_efficiency=0.55,
        hbm_bw=2039 * GB,
        intra_bw=300 * GB,
        inter_bw=FABRICS["infiniband-hdr"],
        host_bw=25 * GB,
        device_adam_bytes_per_s=1.6e12,
        **FITTED,
        overlap_slowdown=OVERLAP_SLOWDOWN,
    ),
    "h100-80gb": Hardware(
        name="h100-80gb",
        gpus=8,
        gpus_per_node=8,
        memory_bytes=80 * GB,
        peak_flops=989e12,
        matmul_efficiency=0.801,
        attention_efficiency=0.34,
        hbm_bw=3350 * GB,
        intra_bw=450 * GB,
        inter_bw=FABRICS["infiniband-ndr"],
        host_bw=50 * GB,
        device_adam_bytes_per_s=2.8e12,
        **FITTED,
        overlap_slowdown=OVERLAP_SLOWDOWN,
    ),
    "h200-141gb": Hardware(
        name="h200-141gb",
        gpus=8,
        gpus_per_node=8,
        memory_bytes=141 * GB,
        peak_flops=989e12,
        matmul_efficiency=0.801,
        attention_efficiency=0.34,
        hbm_bw=4800 * GB,
        intra_bw=450 * GB,
        inter_bw=FABRICS["infiniband-ndr"],
        host_bw=50 * GB,
        device_adam_bytes_per_s=4.0e12,
        **FITTED,
        overlap_slowdown=OVERLAP_SLOWDOWN,
    ),
    "b200-180gb": Hardware(
        name="b200-180gb",
        gpus=8,
        gpus_per_node=8,
        memory_bytes=180 * GB,
        peak_flops=2250e12,
        matmul_efficiency=0.801,
        attention_efficiency=0.34,
        hbm_bw=8000 * GB,
        intra_bw=900 * GB,
        inter_bw=FABRICS["infiniband-ndr"],
        host_bw=64 * GB,
        device_adam_bytes_per_s=6.4e12,
        **FITTED,
        overlap_slowdown=OVERLAP_SLOWDOWN,
    ),
}


def profile(
    name: str, *, gpus: int | None = None, fabric: str | None = None, **overrides
) -> Hardware:
    """A bundled profile (``gpus`` devices, between nodes ``fabric``, a key of
    :data:`FABRICS`; the rest as bundled unless overridden)."""
    key = name.lower()
    if key not in PROFILES:
        raise PlanError(f"--hardware: {name!r} is not one of {', '.join(sorted(PROFILES))}")
    hw = PROFILES[key]
    if fabric is not None:
        if fabric not in FABRICS:
            raise PlanError(f"--fabric: {fabric!r} is not one of {', '.join(FABRICS)}")
        hw = hw.scaled(name=f"{hw.name}+{fabric}", inter_bw=FABRICS[fabric])
    changes = {k: v for k, v in overrides.items() if v is not None}
    if gpus is not None:
        changes["gpus"] = gpus
    return hw.scaled(**changes) if changes else hw


def calibrate(
    *,
    gpus: int | None = None,
    model=None,
    size: int = 1024,
    repeats: int = 3,
    comm_bytes: int = 8 * 2**20,
) -> Hardware:
    """This machine, measured (``nominal=False``): one process's fp32 matmul rate (its
    ``torch.get_num_threads()`` threads, as a training rank runs) as peak flops, the fraction of
    it one of ``model``'s layers reaches forward and backward (:func:`layer_efficiency`; 1
    without a model), and a gloo all-reduce among as many local processes as ranks (up to 8):
    its latency per hop from a 4-byte one and its bus bandwidth from a ``comm_bytes`` one, for
    every link. One
    "device" per core by default; ``gpus`` ranks on fewer cores share them (each gets
    ``cores / gpus`` of the rate) and the host's memory."""
    flops = matmul_flops(size, repeats)
    efficiency = 1.0 if model is None else min(1.0, layer_efficiency(model, flops))
    cores = os.cpu_count() or 1
    ranks = gpus or cores
    share = min(1.0, cores / ranks)
    group = max(2, min(ranks, 8))  # as many processes as will share the cores (up to 8)
    figures = _gloo_figures(comm_bytes, group)
    hops = 2 * (group - 1)  # a ring all-reduce: 2 (n - 1) steps
    latency = figures["idle"] / hops
    # bus bandwidth: a ring all-reduce moves 2 (n - 1) / n of the buffer per rank
    bw = hops / group * comm_bytes / max(figures["large"] - figures["idle"], 1e-9)
    if ranks > cores:  # a collective waits for ranks the scheduler has not run yet
        latency = max(latency, figures["busy"] / hops)
    return Hardware(
        name="this-machine",
        gpus=ranks,
        gpus_per_node=ranks,
        memory_bytes=host_memory() / ranks,
        peak_flops=flops * share,
        matmul_efficiency=efficiency,
        intra_bw=bw,
        inter_bw=bw,
        intra_latency=latency,
        inter_latency=latency,
        host_bw=bw * 100,  # no device: "offload" is a copy within host memory
        cpu_adam_params_per_s=flops * share / 40,  # CPUAdam: ~20 flops, 16 bytes per parameter
        device_adam_bytes_per_s=flops * share / 2,
        nominal=False,
        shared_cores=cores if ranks > cores else 0,
    )


def matmul_flops(size: int = 1024, repeats: int = 3) -> float:
    """This process's fp32 matmul rate (flop/s), best of ``repeats`` ``size``-square products."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def layer_efficiency(
    m,
    flops_per_s: float,
    *,
    micro_batch: int = 1,
    repeats: int = 3,
    max_hidden: int = 1024,
    max_seq: int = 512,
) -> float:
    """Achieved over ``flops_per_s`` on one of the model's own layers, forward and backward in
    fp32 on this process: what a training step reaches of a bare matmul's rate (LayerNorms,
    softmax, GELU and the memory traffic between the products make it less than 1). Layers
    wider than ``max_hidden`` or longer than ``max_seq`` are sampled at those sizes, the
    head width kept."""
    import torch

    from ..models.gpt import Block, GPTConfig
    from ..profiling.flops import transformer_flops

    head = m.hidden // m.heads
    hidden = min(m.hidden, max(head, max_hidden // head * head))
    heads, seq = hidden // head, min(m.seq, max_seq)
    block = Block(GPTConfig(block_size=seq, n_layer=1, n_head=heads, d_model=hidden, bias=m.bias))
    x = torch.randn(micro_batch, seq, hidden, requires_grad=True)
    sizes = dict(hidden=hidden, heads=heads, vocab=1, seq=seq, batch=micro_batch)
    flops = transformer_flops(2, **sizes) - transformer_flops(1, **sizes)  # one layer
    best = float("inf")
    for i in range(repeats + 1):  # the first run warms up
        t0 = time.perf_counter()
        block(x).sum().backward()
        if i:
            best = min(best, time.perf_counter() - t0)
    return flops / best / flops_per_s


def host_memory() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GB


def _gloo_figures(nbytes: int, world: int) -> dict[str, float]:
    """Gloo all-reduce figures among ``world`` local processes (the slowest rank's): seconds of
    a 4-byte one when every rank waits for it (``idle``) and when the ranks arrive from compute
    (``busy``: a ~1 ms matmul before each; ranks sharing cores arrive as the scheduler lets
    them), and of an ``nbytes`` one (``large``)."""
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        procs = [
            ctx.Process(target=_allreduce_worker, args=(r, world, store, nbytes, queue))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results = [queue.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    return {k: max(r[k] for r in results) for k in results[0]}


def _allreduce_worker(rank: int, world: int, store_path: str, nbytes: int, queue) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    small, large = torch.ones(1), torch.ones(max(1, nbytes // 4))
    dist.all_reduce(large)  # warm up

    def best_of(t: torch.Tensor, n: int = 5) -> float:
        best = float("inf")
        for _ in range(n):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            best = min(best, time.perf_counter() - t0)
        return best

    a = torch.randn(256, 256)
    waits = []
    dist.barrier()
    for _ in range(40):
        for _ in range(8):
            a @ a  # about a millisecond of compute
        t0 = time.perf_counter()
        dist.all_reduce(small)
        waits.append(time.perf_counter() - t0)
    queue.put({"idle": best_of(small), "large": best_of(large), "busy": sum(waits) / len(waits)})
    dist.destroy_process_group()
