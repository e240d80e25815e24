"""The checks a CUDA machine runs before zerostack's GPU path is called correct (issue 17).

    bash scripts/gpu_check.sh              # on a machine with CUDA; one JSON line per check
    python scripts/gpu_check.py --quick    # the same checks on the CPU, tiny (the suite runs it)

One process, one device (world 1): the checks that need two GPUs (pipeline, tensor parallelism,
reduce-scatter overlap) say so and are skipped on one; on two or more, ``gpu_check.sh`` runs
``zerostack train`` with pp 2 (1F1B, interleaved) and tp 2 + sequence parallelism on NCCL.
On one GPU, ``fake-dp8`` runs stages 1-3 at dp = 8 through torch's fake process group (their
dp > 1 paths; no data moves) and ``nccl-lifetimes`` runs NCCL's ops at world 1 behind queued
work with their inputs freed at once (issue 37's checks A-E: also ``offload-host-time``,
``nonfinite-skip``, ``autocast`` and ``sanitizer``, under ``TORCH_CUDA_SANITIZER=1``). The
fp32 checks compared at 1e-6 run with deterministic algorithms (cuBLAS's workspace setting).
Each check prints ``{"check": ..., "ok": ..., ...figures}``; the last line is the summary, and
the exit code is 1 when a check failed. ``zero{0-3}-{bf16,fp32}-step-no-stream-sync`` runs two
steps under torch's sync debug mode: the real-GPU counterpart of virtual CUDA's record of the
host's waits.

Tolerances, stated: 16-bit runs train with plain SGD (no normalising optimizer to hide a lost
factor) and their weights' change over 6 steps of 2 micro-steps is held to the fp32 run's on the
same batches within 5% (bf16) and 1% (fp16) relative, the largest over the tensors (16-bit
rounding of weights and activations; a missing 1/accumulation or unscale is a 50-100% error);
the fp32 variants (offload, zero.Init, activation checkpointing, resume) are held to 1e-6
relative per weight, since only where the tensors live differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch

import zerostack
from zerostack.models import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RESULTS: list[dict] = []


def report(check: str, ok: bool, **figures) -> None:
    row = {"check": check, "ok": bool(ok), **figures}
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def skipped(check: str, why: str) -> None:
    row = {"check": check, "ok": None, "skipped": why}
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def _config(stage: int, precision: str = "fp32", **extra) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, **extra.pop("zero", {})}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 10_000,
        "watchdog": {"enabled": False},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12}
    return {**cfg, **extra}


def _batches(model_cfg: GPTConfig, steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = steps * 2
    x = torch.randint(0, model_cfg.vocab_size, (n, 2, model_cfg.block_size + 1), generator=g)
    return [(b[:, :-1], b[:, 1:]) for b in x]


def _train(model_cfg, config, steps, *, init=False, seed=0, engine=None, start=0):
    """``steps`` optimizer steps on fixed batches; (engine, per-step mean losses)."""
    if engine is None:
        torch.manual_seed(seed)
        if init:
            with zerostack.zero.Init(config_dict_or_path=config):
                model = GPT(model_cfg)
        else:
            model = GPT(model_cfg)
        engine, *_ = zerostack.initialize(model=model, config=config)
    losses = []
    for x, y in _batches(model_cfg, steps + start)[2 * start :]:
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, [sum(losses[i : i + 2]) / 2 for i in range(0, len(losses), 2)]


def _weights(engine) -> dict:
    return {k: v.detach().float().cpu() for k, v in engine.full_state_dict().items()}


def _rel(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in b)


def check_precision(model_cfg, steps) -> None:
    """16-bit against fp32 with plain SGD (no normalising optimizer to hide a lost factor):
    the weights' change over the run, compared."""
    sgd = {"type": "SGD", "params": {"lr": 0.5}}
    torch.manual_seed(0)
    start = {k: v.float() for k, v in GPT(model_cfg).state_dict().items()}
    for stage in (0, 1, 2, 3):
        ref, _ = _train(model_cfg, _config(stage, optimizer=sgd), steps)
        want = {k: v - start[k] for k, v in _weights(ref).items()}
        ref.destroy()
        for precision, tol in (("bf16", 5e-2), ("fp16", 1e-2)):
            engine, _ = _train(model_cfg, _config(stage, precision, optimizer=sgd), steps)
            got = {k: v - start[k] for k, v in _weights(engine).items()}
            worst = _rel(got, want)
            report(
                f"zero{stage}-{precision}-vs-fp32",
                worst <= tol and engine.skipped_steps == 0,
                worst_update_rel=worst,
                tolerance=tol,
                skipped_steps=engine.skipped_steps,
            )
            engine.destroy()


def _steps_watched(engine, batches, watch_from: int) -> str | None:
    """A step per batch, copied from pinned memory without blocking; from batch ``watch_from``
    on, on a GPU, with the peak reset and under the sync debug mode ("error"). The first line
    of the error that stopped it, or None."""
    cuda = engine.device.type == "cuda"
    try:
        for i, (x, y) in enumerate(batches):
            if cuda and i == watch_from:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.set_sync_debug_mode("error")
            dev = engine.device
            loss = engine(x.to(dev, non_blocking=True), y.to(dev, non_blocking=True))
            engine.backward(loss)
            engine.step()
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
    return None


def check_no_stream_sync(model_cfg) -> None:
    """A step with its masters on the device never drains the stream: under torch's sync debug
    mode ("error"), which raises on ``.item()``, blocking copies and stream synchronisation, but
    not on an event's wait (how the engine reads the gradient norm). Batches are copied from
    pinned memory without blocking, and no loss is read, as in a loop that logs rarely."""
    if not torch.cuda.is_available():
        skipped("zero-step-no-stream-sync", "sync debug mode needs CUDA")
        return
    batches = [(x.pin_memory(), y.pin_memory()) for x, y in _batches(model_cfg, 3)]
    for stage in (0, 1, 2, 3):
        for precision in ("bf16", "fp32"):
            engine, _ = _train(model_cfg, _config(stage, precision, gradient_clipping=1.0), 1)
            error = _steps_watched(engine, batches[2:], watch_from=0)
            report(f"zero{stage}-{precision}-step-no-stream-sync", error is None, error=error)
            engine.destroy()


def check_offload_and_init(model_cfg, steps, tmp) -> None:
    ref2, _ = _train(model_cfg, _config(2), steps)
    want = _weights(ref2)
    ref2.destroy()
    nvme = os.path.join(tmp, "nvme")
    os.makedirs(nvme, exist_ok=True)
    cases = {
        "zero2-offload-cpu-pinned": _config(
            2, zero={"offload_optimizer": {"device": "cpu", "pin_memory": True}}
        ),
        "zero3-offload-param-cpu": _config(
            3, zero={"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
        ),
        "zero3-offload-param-nvme": _config(
            3,
            zero={
                "offload_param": {"device": "nvme", "nvme_path": nvme},
                "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
            },
        ),
    }
    for name, cfg in cases.items():
        engine, _ = _train(model_cfg, cfg, steps)
        worst = _rel(_weights(engine), want)
        report(name, worst <= 1e-6, worst_weight_rel=worst)
        engine.destroy()
    engine, _ = _train(model_cfg, _config(3), steps, init=True)
    with zerostack.zero.GatheredParameters(list(engine.module.parameters())):
        gathered = {n: p.detach().float().cpu() for n, p in engine.module.named_parameters()}
    worst = _rel(_weights(engine), want)
    same = all(torch.equal(gathered[k], _weights(engine)[k]) for k in gathered)
    report("zero3-zero.Init-GatheredParameters", worst <= 1e-6 and same, worst_weight_rel=worst)
    engine.destroy()


def check_dropout(model_cfg, steps, tmp) -> None:
    drop = dataclasses.replace(model_cfg, dropout=0.1)
    ref, want_losses = _train(drop, _config(2), steps)
    want = _weights(ref)
    ref.destroy()
    ac = dataclasses.replace(drop, checkpoint_every=1)
    engine, got_losses = _train(ac, _config(2), steps)
    worst = _rel(_weights(engine), want)
    report("activation-checkpointing-dropout", worst <= 1e-6, worst_weight_rel=worst)
    engine.destroy()
    half = steps // 2
    first, _ = _train(drop, _config(2), half)
    first.save_checkpoint(os.path.join(tmp, "ckpt"))
    first.destroy()
    torch.manual_seed(123)  # the checkpoint's generators must draw the masks, not these
    fresh, *_ = zerostack.initialize(model=GPT(drop), config=_config(2))
    fresh.load_checkpoint(os.path.join(tmp, "ckpt"))
    fresh, _ = _train(drop, _config(2), steps - half, engine=fresh, start=half)
    worst = _rel(_weights(fresh), want)
    report("save-load-step-dropout", worst <= 1e-6, worst_weight_rel=worst)
    fresh.destroy()


def check_scripts(tmp) -> None:
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(zerostack.__file__)))
    for name, cmd in (
        (
            "examples/train_gpt.py",
            [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--steps", "3"],
        ),
        (
            "zerostack-train",
            [sys.executable, "-m", "zerostack.cli", "train", "--steps", "3", "--nproc", "1"]
            + ["--no-progress", "--out", os.path.join(tmp, "demo")],
        ),
    ):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=55)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:]
        report(name, proc.returncode == 0, seconds=time.perf_counter() - t0, last_line=tail)


def check_big(layers: int, hidden: int, heads: int, seq: int, micro: int) -> None:
    """A GPT at ZeRO-3 bf16 on one device (dp = 1: nothing is sharded or gathered, so the
    memory is the whole model's states): MFU, and max_memory_allocated against the model-state
    formula, with the peak while ``initialize`` builds the engine apart."""
    from zerostack.profiling.flops import transformer_flops

    cfg = GPTConfig(vocab_size=50304, block_size=seq, n_layer=layers, n_head=heads, d_model=hidden)
    config = _config(3, "bf16")
    config["gradient_accumulation_steps"] = 1
    config["train_micro_batch_size_per_gpu"] = micro
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    engine, *_ = zerostack.initialize(model=GPT(cfg), config=config)
    init_peak = torch.cuda.max_memory_allocated() if cuda else None
    params = cfg.num_params
    x = torch.randint(0, cfg.vocab_size, (micro, seq + 1), device=engine.device)
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(4):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.backward(engine(x[:, :-1], x[:, 1:]))
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step = min(times[1:])
    flops = transformer_flops(layers, hidden, heads, cfg.vocab_size, seq, micro)
    peak = 989e12 if cuda and "H100" in torch.cuda.get_device_name() else None
    if cuda and "H200" in torch.cuda.get_device_name():
        peak = 989e12  # dense bf16, H200 (as H100 SXM)
    states = 2 * params + 4 * params + 4 * params + 8 * params  # bf16 + fp32 grad, master, Adam
    figures = {
        "dp": engine.topology.dp,
        "parameters": params,
        "step_s": step,
        "tflops": flops / step / 1e12,
        "mfu": flops / step / peak if peak else None,
        "model_state_bytes_formula": states,
    }
    if cuda:
        figures["initialize_peak_allocated"] = init_peak
        figures["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        figures["memory_reserved"] = torch.cuda.memory_reserved()
        figures["allocated_over_states"] = figures["max_memory_allocated"] / states
    report("gpt-zero3-bf16", True, **figures)
    engine.destroy()


def _sleep_ms(ms: float) -> None:
    """Queue about ``ms`` of work on the current stream (``torch.cuda._sleep``: clock cycles)."""
    torch.cuda._sleep(int(ms * 1e-3 * 1.5e9))


def check_fake_dp8(model_cfg) -> None:
    """Check A: dp = 8 on one device, through torch's fake process group (collectives move no
    data: the losses mean nothing), so stages 1-3 take their dp > 1 and NCCL paths; two steps
    after a warm-up under the sync debug mode (on a GPU), and the peak memory per stage. Runs
    in its own process: the world is the fake group's."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    batches = _batches(model_cfg, 3)
    if cuda:  # as from a pinned loader
        batches = [(x.pin_memory(), y.pin_memory()) for x, y in batches]
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        engine, *_ = zerostack.initialize(
            model=GPT(model_cfg), config=_config(stage, "bf16", gradient_clipping=1.0)
        )
        psi = sum(p.numel() for p in engine.module.parameters())
        error = _steps_watched(engine, batches, watch_from=2)  # after the warm-up step
        peak = torch.cuda.max_memory_allocated() if cuda else None
        report(
            f"fake-dp8-zero{stage}-bf16",
            error is None and engine.topology.dp == 8,
            error=error,
            device=str(engine.device),
            peak_bytes_per_param=None if peak is None else peak / psi,
        )
        engine.destroy()
    dist.destroy_process_group()


def check_nccl_lifetimes(name: str) -> None:
    """Check B: NCCL at world 1, each op of the NCCL branch launched behind 50 ms of queued
    work, its inputs freed and their memory filled with a sentinel at once: the outputs must be
    exact (the allocator did not hand out memory NCCL still reads), and ``wait()`` returns
    before the queued work ends (it orders the stream, it does not block)."""
    if not torch.cuda.is_available():
        skipped(name, "needs CUDA")
        return
    from zerostack.comm import Comm
    from zerostack.topology import Topology

    comm = Comm(Topology.build())
    dev = torch.device("cuda", torch.cuda.current_device())
    n = 1 << 20

    def reduce_scatter(x):
        out = torch.empty(n, device=dev)
        return out, comm.reduce_scatter(out, x, async_op=True), x

    def all_gather(x):
        out = torch.empty(n, device=dev)
        return out, comm.all_gather(out, x, async_op=True), x

    def all_gather_in_place(x):
        out = x.clone()
        return out, comm.all_gather(out, out[:n], async_op=True), x

    def all_to_all(x):
        out = torch.empty(n, device=dev)
        return out, comm.all_to_all(out, x, async_op=True), x

    def broadcast(x):
        out = x.clone()
        return out, comm.broadcast(out, async_op=True), x

    for op in (reduce_scatter, all_gather, all_gather_in_place, all_to_all, broadcast):
        x = torch.arange(n, device=dev, dtype=torch.float32)
        _sleep_ms(50)
        out, handle, want = op(x)
        want = want.clone()
        del x
        sentinel = [torch.full((n,), -7.0, device=dev) for _ in range(4)]
        t0 = time.perf_counter()
        handle.wait()
        waited_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        exact = torch.equal(out, want)
        report(f"{name}-{op.__name__}", exact and waited_ms < 25, waited_ms=waited_ms)
        del sentinel


def check_offload_host_time(model_cfg) -> None:
    """Check C: how long the host is held when 200 ms of work is queued before a forward and
    before a backward, with offloaded state pinned and pageable, and the page-locked bytes the
    host allocator holds beside the pinned bytes of the census."""
    if not torch.cuda.is_available():
        skipped("offload-host-time", "needs CUDA")
        return
    x, y = _batches(model_cfg, 1)[0]
    for name, zero in (
        ("zero2-offload-optimizer", {"offload_optimizer": {"device": "cpu"}}),
        ("zero3-offload-param-optimizer", {"offload_optimizer": {"device": "cpu"},
                                           "offload_param": {"device": "cpu"}}),
    ):  # fmt: skip
        for pin in (True, False):
            for block in zero.values():
                block["pin_memory"] = pin
            stage = 3 if "param" in name else 2
            cfg = _config(stage, "bf16", zero=zero, gradient_accumulation_steps=1)
            engine, _ = _train(model_cfg, cfg, 1)
            dev = engine.device
            xb, yb = x.pin_memory().to(dev), y.pin_memory().to(dev)
            torch.cuda.synchronize()
            _sleep_ms(200)
            t0 = time.perf_counter()
            loss = engine(xb, yb)
            forward_ms = (time.perf_counter() - t0) * 1e3
            torch.cuda.synchronize()
            _sleep_ms(200)
            t0 = time.perf_counter()
            engine.backward(loss)
            backward_ms = (time.perf_counter() - t0) * 1e3
            engine.step()
            figures = engine.device_memory()
            host_census = sum(engine.memory_by_device().get("cpu", {}).values())
            report(
                f"{name}-{'pinned' if pin else 'pageable'}-host-ms",
                True if not pin else backward_ms < 100,
                forward_ms=forward_ms,
                backward_ms=backward_ms,
                pinned_allocator_bytes=figures.get("pinned"),
                host_census_bytes=host_census,
            )
            engine.destroy()


def check_nonfinite_skip(model_cfg) -> None:
    """Check D: an inf gradient at the second step, stages 0-3 x bf16/fp16, fused AdamW,
    clipping on: the step is skipped on the device (masters, moments, step count and LR as
    they were; ``skipped_steps`` 1), the host does not drain the stream meanwhile, and the next
    step updates."""
    cuda = torch.cuda.is_available()
    fused = {"type": "AdamW", "params": {"lr": 1e-3}}  # torch's fused AdamW where it can
    batches = _batches(model_cfg, 3)
    for stage in (0, 1, 2, 3):
        for precision in ("bf16", "fp16"):
            torch.manual_seed(0)
            cfg = _config(stage, precision, gradient_clipping=1.0, optimizer=fused,
                          gradient_accumulation_steps=1)  # fmt: skip
            engine, *_ = zerostack.initialize(model=GPT(model_cfg), config=cfg)
            first = next(p for p in engine.module.parameters() if p.requires_grad)
            poison = [False]
            first.register_hook(
                lambda g, poison=poison: torch.full_like(g, float("inf")) if poison[0] else g
            )

            def state(engine=engine):
                masters = [m.detach().clone() for m in engine.zero.masters()]
                moments = [
                    {k: v.clone() for k, v in engine.optimizer.state.get(m, {}).items()}
                    for m in engine.zero.masters()
                ]
                return masters, moments, engine.get_lr()

            error, unchanged = None, False
            try:
                for i, (x, y) in enumerate(batches):
                    poison[0] = i == 1
                    dev = engine.device
                    if i == 1:
                        before = state()
                        if cuda:
                            torch.cuda.synchronize()
                            torch.cuda.set_sync_debug_mode("error")
                    loss = engine(x.to(dev, non_blocking=True), y.to(dev, non_blocking=True))
                    engine.backward(loss)
                    engine.step()
                    if i == 1:
                        if cuda:
                            torch.cuda.set_sync_debug_mode(0)
                        after = state()
                        unchanged = after[2] == before[2] and all(
                            torch.equal(a, b) for a, b in zip(after[0], before[0], strict=True)
                        ) and all(
                            all(torch.equal(a[k], b[k]) for k in b)
                            for a, b in zip(after[1], before[1], strict=True)
                        )  # fmt: skip
                updated = not all(
                    torch.equal(a, b) for a, b in zip(state()[0], before[0], strict=True)
                )
            except RuntimeError as exc:
                error, updated = str(exc).splitlines()[0], False
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode(0)
            report(
                f"zero{stage}-{precision}-inf-skipped-on-device",
                error is None and unchanged and updated and engine.skipped_steps == 1,
                error=error,
                skipped_steps=engine.skipped_steps,
                loss_scale=getattr(engine.loss_scaler, "loss_scale", None),
            )
            engine.destroy()


def check_autocast(model_cfg) -> None:
    """Check E (first half): a user's loop under ``torch.autocast`` (bf16) with an fp32 config
    trains at stages 0-3 (stage 3's linear replays the autocast state in backward)."""
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        engine, *_ = zerostack.initialize(model=GPT(model_cfg), config=_config(stage))
        error, losses = None, []
        try:
            for x, y in _batches(model_cfg, 2):
                with torch.autocast(kind, dtype=torch.bfloat16):
                    loss = engine(x.to(engine.device), y.to(engine.device))
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
        except RuntimeError as exc:
            error = str(exc).splitlines()[0]
        ok = error is None and all(v == v and abs(v) < 1e4 for v in losses)
        report(f"zero{stage}-user-autocast-bf16", ok, error=error, losses=losses[-1:])
        engine.destroy()


def check_compile(model_cfg, steps) -> None:
    """``engine.compile()`` at stages 0-3: the weights' change over the run against eager's
    (plain SGD; inductor in bf16 on a GPU, within 1e-2; aot_eager in fp32 on the CPU, exactly),
    nothing compiled again after the first steps, and on a GPU two more compiled steps under
    the sync debug mode ("error"): compiling adds no host wait to a step."""
    cuda = torch.cuda.is_available()
    backend, precision, tol = ("inductor", "bf16", 1e-2) if cuda else ("aot_eager", "fp32", 0.0)
    sgd = {"type": "SGD", "params": {"lr": 0.5}}
    torch.manual_seed(0)
    start = {k: v.float() for k, v in GPT(model_cfg).state_dict().items()}
    for stage in (0, 1, 2, 3):
        config = _config(stage, precision, optimizer=sgd)
        ref, _ = _train(model_cfg, config, steps)
        want = {k: v - start[k] for k, v in _weights(ref).items()}
        ref.destroy()
        torch.manual_seed(0)
        engine, *_ = zerostack.initialize(model=GPT(model_cfg), config=config)
        engine.compile(backend=backend)
        engine, _ = _train(model_cfg, config, steps, engine=engine)
        got = {k: v - start[k] for k, v in _weights(engine).items()}
        graphs = engine.compile_report.graphs
        batches = _batches(model_cfg, 1, seed=1)
        if cuda:
            batches = [(x.pin_memory(), y.pin_memory()) for x, y in batches]
        error = _steps_watched(engine, batches, watch_from=0)
        worst = _rel(got, want)
        again = engine.compile_report.graphs - graphs
        report(
            f"zero{stage}-{precision}-compiled-{backend}",
            worst <= tol and again == 0 and error is None,
            worst_update_rel=worst,
            tolerance=tol,
            graphs=graphs,
            compiled_again=again,
            error=error,
        )
        engine.destroy()


def check_sanitizer(model_cfg, tmp) -> None:
    """Check E (second half): two steps of stage 3 with parameters offloaded (pinned host
    memory, and NVMe) under torch's CUDA stream sanitizer (``TORCH_CUDA_SANITIZER=1``, set by
    ``main`` before torch starts): the real GPU's counterpart of virtual CUDA's vector clocks."""
    if not torch.cuda.is_available():
        skipped("sanitizer", "needs CUDA")
        return
    nvme = os.path.join(tmp, "nvme")
    os.makedirs(nvme, exist_ok=True)
    for where, place in (("cpu", {"device": "cpu"}),
                         ("nvme", {"device": "nvme", "nvme_path": nvme})):  # fmt: skip
        error = None
        try:
            engine, _ = _train(model_cfg, _config(3, "bf16", zero={"offload_param": place}), 2)
            engine.destroy()
        except Exception as exc:  # the sanitizer raises its own error type
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        report(f"zero3-offload-param-{where}-sanitizer", error is None, error=error)


CHECKS = (
    "precision", "no-stream-sync", "nccl-lifetimes", "fake-dp8", "nonfinite-skip",
    "offload-host-time", "autocast", "offload-and-init", "dropout", "big", "sanitizer",
    "nccl-lifetimes-avoid-record-streams", "scripts", "compile",
)  # fmt: skip
"""What ``--only`` runs, one per process (``gpu_check.sh`` gives each its own time limit)."""


def _run(name: str, small, steps: int, quick: bool, tmp: str) -> None:
    if name == "precision":
        check_precision(small, steps)
    elif name == "no-stream-sync":
        check_no_stream_sync(small)
    elif name == "offload-and-init":
        check_offload_and_init(small, steps, tmp)
    elif name == "dropout":
        check_dropout(small, steps, tmp)
    elif name == "scripts":
        check_scripts(tmp)
    elif name.startswith("nccl-lifetimes"):
        check_nccl_lifetimes(name)
    elif name == "fake-dp8":
        check_fake_dp8(small)
    elif name == "nonfinite-skip":
        check_nonfinite_skip(small)
    elif name == "offload-host-time":
        check_offload_host_time(small)
    elif name == "autocast":
        check_autocast(small)
    elif name == "sanitizer":
        check_sanitizer(small, tmp)
    elif name == "compile":
        check_compile(small, steps)
    elif quick:
        check_big(2, 64, 4, 32, 2)
    else:
        check_big(24, 2048, 16, 1024, 4)  # 1.3B parameters


def summary(rows: list[dict]) -> int:
    """Print the summary line of ``rows`` (check results); 1 when one failed."""
    checks = [r for r in rows if "check" in r]
    failed = [r["check"] for r in checks if r["ok"] is False]
    print(json.dumps({"summary": True, "failed": failed, "checks": len(checks)}), flush=True)
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="tiny sizes (the CPU smoke run)")
    p.add_argument("--list", action="store_true", help="print the check names")
    p.add_argument("--only", choices=CHECKS, help="run this check alone (no summary line)")
    p.add_argument("--summary", metavar="JSONL", help="the summary line of these results")
    args = p.parse_args()
    if args.list:
        print(" ".join(CHECKS))
        return 0
    if args.summary:
        with open(args.summary) as f:
            return summary([json.loads(x) for x in f if x.startswith("{")])
    # cuBLAS deterministic (read when cuBLAS starts): the fp32 checks compare at 1e-6
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.only == "nccl-lifetimes-avoid-record-streams":
        os.environ["TORCH_NCCL_AVOID_RECORD_STREAMS"] = "1"  # read when NCCL's group is made
    if args.only == "sanitizer" and torch.cuda.is_available():
        if os.environ.get("TORCH_CUDA_SANITIZER") != "1":  # read when torch starts: again
            env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
            os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if args.only in ("offload-and-init", "dropout"):
        torch.use_deterministic_algorithms(True, warn_only=True)  # SDPA's deterministic path
    if args.only != "fake-dp8":  # that check's world is torch's fake process group
        zerostack.init_distributed(timeout=timedelta(seconds=120))  # a hang fails in 2 minutes
    quick = args.quick or not torch.cuda.is_available()
    small = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, d_model=64)
    if not quick:
        small = GPTConfig(vocab_size=50304, block_size=256, n_layer=4, n_head=8, d_model=512)
    steps = 6
    if args.only in (None, "precision"):
        report(
            "device",
            True,
            device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            torch=torch.__version__,
            gpus=torch.cuda.device_count(),
        )
    own_world = ("fake-dp8", "nccl-lifetimes-avoid-record-streams", "sanitizer")
    names = [args.only] if args.only else [
        c for c in CHECKS if (c != "scripts" or not args.quick) and c not in own_world
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="zs-gpu-check-") as tmp:
        for name in names:
            _run(name, small, steps, quick, tmp)
    if args.only is None and torch.cuda.device_count() < 2:
        for what in ("pipeline-pp2", "tp2-sequence-parallel", "reduce-scatter-overlap"):
            skipped(what, "needs 2 GPUs")
    if args.only != "fake-dp8":
        zerostack.shutdown()
    if args.only:
        return 1 if any(r["ok"] is False for r in RESULTS) else 0
    return summary(RESULTS)


if __name__ == "__main__":
    sys.exit(main())
