"""zerostack's CUDA + NCCL path, run here on virtual CUDA (tests/support/vcuda.py): every tensor
carries the device CUDA would give it, ops that mix devices fail as on a GPU, and every tensor
handed to torch.distributed must be a contiguous cuda tensor, as NCCL requires. Each path runs on
two gloo ranks twice, once plainly on the CPU and once with ``Topology.device`` = cuda:0, and must
end with the same weights bit for bit (the same ops on the same host memory: the devices change
nothing but where things would live)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time

import pytest
import torch

import zerostack
from zerostack.models import GPT, GPTConfig

from tests.support.models import TINY, batch, micro_batches, tiny_gpt
from tests.support.ranks import run_distributed
from tests.support.vcuda import HOST_WAITS, UNALIGNED, DeviceError, virtual_cuda

STEPS, MICRO, GAS = 2, 2, 2


def _config(stage: int, **extra) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    zero.update(extra.pop("zero", {}))
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 1000,
    }
    cfg.update(extra)
    return cfg


def _loop(engine, rank: int, world: int, steps=range(STEPS)) -> list[float]:
    """The DeepSpeed loop, batches moved to ``engine.device`` as a user moves them."""
    losses = []
    for step in steps:
        x, y = batch(step, MICRO * GAS * world)
        for m in range(GAS):
            lo = (m * world + rank) * MICRO
            xb, yb = x[lo : lo + MICRO].to(engine.device), y[lo : lo + MICRO].to(engine.device)
            loss = engine(xb, yb)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _host(state: dict) -> dict:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


# ---------------------------------------------------------------------- the paths
def _zero(rank, world, root, stage, model_cfg=TINY, **extra):
    torch.manual_seed(0)
    model = tiny_gpt(cfg=model_cfg)
    engine, *_ = zerostack.initialize(model=model, config=_config(stage, **extra))
    assert engine.device.type == ("cuda" if _VIRTUAL else "cpu")
    losses = _loop(engine, rank, world)
    return _host(engine.full_state_dict()), losses


def _offload_param(rank, world, root, device):
    nvme = {}
    if device == "nvme":
        nvme = {"nvme_path": os.path.join(root, f"swap{rank}")}
        os.makedirs(nvme["nvme_path"], exist_ok=True)
    zero = {
        "offload_param": {"device": device, **nvme},
        "offload_optimizer": {"device": device, **nvme},
    }
    return _zero(rank, world, root, 3, zero=zero)


def _zero_init(rank, world, root):
    torch.manual_seed(0)
    cfg = _config(3)
    with zerostack.zero.Init(config_dict_or_path=cfg):
        model = tiny_gpt()
    engine, *_ = zerostack.initialize(model=model, config=cfg)
    with zerostack.zero.GatheredParameters(list(engine.module.parameters())):
        first = _host({"wte": engine.module.wte.weight})
    losses = _loop(engine, rank, world)
    return _host(engine.full_state_dict()) | {"gathered.wte": first["wte"]}, losses


def _resume(rank, world, root, stage, model_cfg=TINY):
    """Save after a step, load into a fresh engine, step again: the run without the break."""
    torch.manual_seed(0)
    engine, *_ = zerostack.initialize(model=tiny_gpt(cfg=model_cfg), config=_config(stage))
    losses = _loop(engine, rank, world, range(1))
    engine.save_checkpoint(os.path.join(root, "ckpt"))
    torch.manual_seed(1)  # the restored generators, not these, must draw the dropout masks
    fresh, *_ = zerostack.initialize(model=tiny_gpt(seed=1, cfg=model_cfg), config=_config(stage))
    fresh.load_checkpoint(os.path.join(root, "ckpt"))
    losses += _loop(fresh, rank, world, range(1, STEPS))
    return _host(fresh.full_state_dict()), losses


def _cpu_adam(rank, world, root, offload=True):
    """A user's own CPUAdam, the optimizer offloaded (without: refused on the device)."""
    from zerostack.optim.cpu_adam import CPUAdam

    torch.manual_seed(0)
    model = tiny_gpt()
    cfg = _config(2, zero={"offload_optimizer": {"device": "cpu" if offload else "none"}})
    del cfg["optimizer"]
    opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.01, adamw_mode=True)
    engine, *_ = zerostack.initialize(model=model, optimizer=opt, config=cfg)
    losses = _loop(engine, rank, world)
    return _host(engine.full_state_dict()), losses


PIPE = GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=4, d_model=32, bias=False)


def _pipeline(rank, world, root, schedule, chunks):
    from zerostack import Topology
    from zerostack.models.gpt_pipe import GPTLoss, gpt_layers, load_plain_state
    from zerostack.pipeline import PipelineModule

    topo = Topology.build(pp=2)
    model = PipelineModule(
        gpt_layers(PIPE, topology=topo),
        topology=topo,
        loss_fn=GPTLoss(topo),
        partition_method="type:Block",
        virtual_stages=chunks,
    )
    load_plain_state(model, tiny_gpt(cfg=PIPE).state_dict(), PIPE)
    cfg = _config(1, pipeline={"schedule": schedule, "virtual_stages": chunks})
    engine, *_ = zerostack.initialize(model=model, config=cfg)
    losses = []
    for step in range(STEPS):
        losses.append(engine.train_batch(iter(micro_batches(step, MICRO, GAS))).item())
    return _host(engine.full_state_dict()), losses


def _tensor_parallel(rank, world, root, stage):
    from zerostack import Topology
    from zerostack.models import GPT

    topo = Topology.build(tp=2)
    torch.manual_seed(0)
    model = GPT(TINY, topology=topo, sequence_parallel=True)
    engine, *_ = zerostack.initialize(model=model, config=_config(stage))
    losses = []
    for step in range(STEPS):
        x, y = batch(step, MICRO * GAS)
        for m in range(GAS):
            xb, yb = x[m * MICRO : (m + 1) * MICRO], y[m * MICRO : (m + 1) * MICRO]
            loss = engine(xb.to(engine.device), yb.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return _host(engine.full_state_dict()), losses


def _cli_train(rank, world, root, *extra):
    """``zerostack train``'s run (its evaluation and checkpoint included), in this process."""
    from zerostack.cli import _build_config, _parser
    from zerostack.demo.train import train

    argv = ["--steps", "2", "--n-layer", "2", "--d-model", "32", "--n-head", "2"]
    argv += ["--block-size", "16", "--micro-batch", "2", "--no-progress", *extra]
    argv += ["--out", os.path.join(root, "out"), "--save-dir", os.path.join(root, "ckpt")]
    args = _parser().parse_args(["train", *argv])
    args.nproc = world
    summary = train(args, _build_config(args))
    losses = [summary["first_loss"], summary["final_loss"], summary["val_loss"]]
    return {}, losses if rank == 0 else None


def _example(rank, world, root):
    """examples/train_gpt.py, the DeepSpeed script, as torchrun would run it."""
    import runpy
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "..", "examples", "train_gpt.py")
    config = os.path.join(here, "..", "examples", "ds_config_zero3.json")
    sys.argv = [script, "--steps", "2", "--deepspeed_config", config]
    runpy.run_path(script, run_name="__main__")
    return {}, []


CASES = {
    "stage0": (_zero, (0,)),
    "stage1": (_zero, (1,)),
    "stage2": (_zero, (2,)),
    "stage3": (_zero, (3,)),
    "stage3-bf16": (_zero, (3,), {"bf16": {"enabled": True}}),
    "stage3-bf16-zeropp": (
        _zero,
        (3,),
        {
            "bf16": {"enabled": True},
            "zero": {
                "zero_quantized_weights": True,
                "zero_quantized_gradients": True,
                "zero_hpz_partition_size": 2,
            },
        },
    ),
    "stage2-fp16": (_zero, (2,), {"fp16": {"enabled": True, "initial_scale_power": 8}}),
    "stage2-offload": (_zero, (2,), {"zero": {"offload_optimizer": {"device": "cpu"}}}),
    "stage1-offload-pinned": (
        _zero,
        (1,),
        {"zero": {"offload_optimizer": {"device": "cpu", "pin_memory": True}}},
    ),
    "stage3-offload-param-cpu": (_offload_param, ("cpu",)),
    "stage3-offload-param-nvme": (_offload_param, ("nvme",)),
    "stage3-zero-init": (_zero_init, ()),
    "stage2-resume": (_resume, (2,)),
    "stage3-resume": (_resume, (3,)),
    "cpu-adam-offload": (_cpu_adam, ()),
    "zerostack-train": (_cli_train, ()),
    "zerostack-train-pp2-offload": (_cli_train, ("--pp", "2", "--offload", "cpu")),
    "example-train-gpt": (_example, ()),
    "pipeline-1f1b": (_pipeline, ("1f1b", 1)),
    "pipeline-interleaved": (_pipeline, ("interleaved", 2)),
    "tp2-sp-stage1": (_tensor_parallel, (1,)),
}
DROPOUT = dataclasses.replace(TINY, dropout=0.1)
# compared with another case on virtual CUDA, not with the CPU run: dropout draws from the
# device's generator there
AGAINST = {
    "dropout": (_zero, (2,), {"model_cfg": DROPOUT}),
    "activation-checkpointing-dropout": (
        _zero,
        (2,),
        {
            "model_cfg": dataclasses.replace(DROPOUT, checkpoint_every=1),
            "activation_checkpointing": {"partition_activations": True},
        },
        "dropout",
    ),
    "resume-dropout": (_resume, (2,), {"model_cfg": DROPOUT}, "dropout"),
}

_VIRTUAL = False


def _run(rank, world, root, name, virtual):
    global _VIRTUAL
    fn, args, *extra = CASES.get(name) or AGAINST[name]
    kwargs = extra[0] if extra else {}
    _VIRTUAL = virtual
    if not virtual:
        return fn(rank, world, os.path.join(root, "cpu"), *args, **kwargs)
    with virtual_cuda():
        return fn(rank, world, os.path.join(root, "cuda"), *args, **kwargs)


def _same(reference, results) -> None:
    for (want, want_losses), (got, got_losses) in zip(reference, results, strict=True):
        assert got_losses == want_losses
        assert want.keys() == got.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_the_cuda_path_runs_and_matches_the_cpu_run(tmp_path, name):
    plain = run_distributed(_run, world=2, args=(str(tmp_path), name, False))
    _same(plain, run_distributed(_run, world=2, args=(str(tmp_path), name, True)))


def _refused(rank, world, root):
    with virtual_cuda():
        try:
            _cpu_adam(rank, world, root, offload=False)
        except zerostack.ConfigError as e:
            return str(e)


@pytest.mark.distributed
def test_a_users_cpu_adam_without_offload_is_refused_on_the_device(tmp_path):
    """DeepSpeedCPUAdam refuses device tensors; so does CPUAdam, before the first step."""
    for message in run_distributed(_refused, world=2, args=(str(tmp_path),)):
        assert message == (
            "optimizer: CPUAdam steps masters in host memory, these are on cuda:0; set "
            'zero_optimization.offload_optimizer.device to "cpu" (or pass torch.optim.AdamW)'
        )


@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for n in AGAINST if len(AGAINST[n]) > 3])
def test_with_dropout_on_the_device_generator(tmp_path, name):
    """Activation checkpointing recomputes with the same device masks; a resumed run draws
    the masks the uninterrupted one draws (the device generator is checkpointed)."""
    reference = run_distributed(_run, world=2, args=(str(tmp_path / "ref"), AGAINST[name][3], True))
    _same(reference, run_distributed(_run, world=2, args=(str(tmp_path), name, True)))


# ---------------------------------------------------------------------- binding the device
class _Stop(Exception):
    pass


def test_nccl_init_binds_the_local_rank_device(monkeypatch):
    """``init_distributed`` on NCCL sets LOCAL_RANK's device and hands it to the process
    group as ``device_id`` (the communicators bind to it, no rank lands on cuda:0)."""
    import torch.distributed as dist

    from zerostack import world

    calls = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set", d))

    def init(backend, **kwargs):
        calls["init"] = (backend, kwargs.get("device_id"))
        raise _Stop

    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(_Stop):
        world.init_distributed(dist_backend="nccl", init_method="env://")
    assert calls == {"set": torch.device("cuda", 3), "init": ("nccl", torch.device("cuda", 3))}


@pytest.mark.parametrize(
    "backend, watchdog, seconds",
    [
        ("nccl", None, 180),  # the watchdog's 120 s and a minute
        ("nccl", {"timeout": 600}, 660),
        ("cpu:gloo,cuda:nccl", {"timeout": 30}, 90),
        ("nccl", {"enabled": False}, 1800),  # DeepSpeed's 30 minutes
        ("gloo", None, 1800),  # the host waits in gloo's collectives: the watchdog sees them
    ],
)
def test_nccl_times_out_a_minute_after_the_watchdog_with_its_flight_recorder_on(
    monkeypatch, backend, watchdog, seconds
):
    """NCCL's collectives return before they run: the watchdog names one that never completes,
    and NCCL's own timeout, which dumps its flight recorder (switched on unless the environment
    says otherwise), follows a minute later, not 30 minutes later."""
    import torch.distributed as dist

    import zerostack.comm

    got = {}
    monkeypatch.setattr(os, "environ", {"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"})
    monkeypatch.setattr(dist, "is_initialized", lambda: False)

    def init(backend, **kwargs):
        got["timeout"] = kwargs["timeout"].total_seconds()
        raise _Stop

    monkeypatch.setattr(dist, "init_process_group", init)
    config = None if watchdog is None else {"watchdog": watchdog}
    with pytest.raises(_Stop):
        zerostack.comm.init_distributed(dist_backend=backend, config=config, init_method="env://")
    assert got["timeout"] == seconds
    recorder = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"}  # the user's size stands
    if "nccl" in backend:
        recorder["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    assert os.environ == recorder


def test_initialize_gives_nccl_the_configs_watchdog_bound(monkeypatch):
    import torch.distributed as dist

    from zerostack import world

    got = {}
    monkeypatch.setattr(os, "environ", {})
    monkeypatch.setattr(world, "default_backend", lambda: "nccl")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)

    def init(backend, **kwargs):
        got[backend] = kwargs["timeout"].total_seconds()
        raise _Stop

    monkeypatch.setattr(dist, "init_process_group", init)
    with pytest.raises(_Stop):
        config = _config(1, watchdog={"timeout": 5})
        zerostack.initialize(model=torch.nn.Linear(2, 2), config=config)
    assert got == {"nccl": 65.0}


@pytest.mark.parametrize(
    "local, current, count, bound",
    [("2", 0, 4, 2), ("0", 0, 4, None), ("2", 2, 4, None), ("2", 0, 1, None), (None, 0, 4, None)],
)
def test_a_group_made_elsewhere_gets_the_local_rank_device(
    monkeypatch, local, current, count, bound
):
    """A process group the user made without ``set_device``: Topology takes LOCAL_RANK's
    device, unless it is current already or not visible (one GPU per process)."""
    from zerostack import world

    seen = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", seen.append)
    if local is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local)
    world._bind_local_device()
    assert seen == ([] if bound is None else [bound])


@pytest.mark.slow
def test_the_gpu_check_script_runs_its_checks_on_the_cpu():
    """scripts/gpu_check.py --quick: every single-device check of the GPU script, tiny, here
    (the script a CUDA machine runs must not first fail there on a typo)."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = os.path.dirname(os.path.dirname(zerostack.__file__))  # this zerostack (a mutant's)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=src)
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "scripts", "gpu_check.py"), "--quick"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = {r["check"]: r for r in rows if "check" in r}
    assert rows[-1] == {"summary": True, "failed": [], "checks": len(checks)}
    for stage in range(4):
        for precision in ("bf16", "fp16"):
            row = checks[f"zero{stage}-{precision}-vs-fp32"]
            assert row["ok"] and 0 < row["worst_update_rel"] <= row["tolerance"], row
    for name in ("zero3-offload-param-nvme", "save-load-step-dropout", "gpt-zero3-bf16"):
        assert checks[name]["ok"], checks[name]
    for stage in range(4):
        for name in (f"zero{stage}-bf16-inf-skipped-on-device", f"zero{stage}-user-autocast-bf16"):
            assert checks[name]["ok"], checks[name]
        row = checks[f"zero{stage}-fp32-compiled-aot_eager"]  # compiled as eager, to the bit
        assert row["ok"] and row["worst_update_rel"] == 0 and row["graphs"] >= 1, row


# ---------------------------------------------------------------------- seconds of GPU work
def _synchronizations(rank, world, root, wall: bool, comms: bool):
    with virtual_cuda():
        count = [0]

        def synchronize(*args, **kwargs):
            count[0] += 1

        torch.cuda.synchronize = synchronize  # the context puts its own back on exit
        cfg = _config(2, wall_clock_breakdown=wall, comms_logger={"enabled": comms})
        engine, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
        count[0] = 0
        _loop(engine, rank, world, range(1))  # one step: 2 micro-steps
        return count[0]


@pytest.mark.distributed
def test_gpu_seconds_wait_for_the_device_only_when_asked_for(tmp_path):
    """The ``comms_logger`` times each collective after the device's work; with
    ``wall_clock_breakdown`` forward, backward and step are timed so too (a synchronisation at
    each end: 6 more per micro-step, 12 in a step of two); neither asked for, nothing waits."""
    counts = {}
    for wall, comms in ((False, False), (False, True), (True, True)):
        args = (str(tmp_path), wall, comms)
        counts[wall, comms] = run_distributed(_synchronizations, world=2, args=args)
    assert counts[False, False] == [0, 0]
    for comm_only, both in zip(counts[False, True], counts[True, True], strict=True):
        assert comm_only > 0 and both == comm_only + 12, counts


# ---------------------------------------------------------------------- the host's waits
_ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}  # torch's fused AdamW
_SGD = {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9}}  # no fused kernel: no found_inf
_WAIT_CASES = [(stage, p, _ADAMW) for stage in range(4) for p in ("fp32", "bf16", "fp16")]
_WAIT_CASES += [(0, "bf16", _SGD), (3, "fp32", _SGD)]


def _steps_waits(engine, rank, world) -> list[list[tuple[str, str]]]:
    """Each step's host waits, in order, with the optimizer's launch (``("launch", "")``) and
    the end of each forward (``("forward", "")``) marked among them. The loop reads no loss, as
    a loop that logs rarely, and copies its batches without blocking, as from a pinned loader."""
    launch = engine.optimizer.step

    def launched(*args, **kwargs):
        HOST_WAITS.append(("launch", ""))
        return launch(*args, **kwargs)

    engine.optimizer.step = launched
    steps = []
    for step in range(STEPS):
        HOST_WAITS.clear()
        x, y = (t.pin_memory() for t in batch(step, MICRO * GAS * world))  # a pinned loader's
        for m in range(GAS):
            lo = (m * world + rank) * MICRO
            xb, yb = (t[lo : lo + MICRO].to(engine.device, non_blocking=True) for t in (x, y))
            loss = engine(xb, yb)
            HOST_WAITS.append(("forward", ""))
            engine.backward(loss)
            engine.step()
        steps.append(list(HOST_WAITS))
    return steps


def _host_waits(rank, world, root):
    out = []
    with virtual_cuda():
        for stage, precision, optimizer in _WAIT_CASES:
            extra = {"gradient_clipping": 1.0, "optimizer": optimizer}
            if precision != "fp32":
                extra[precision] = {"enabled": True}
            torch.manual_seed(0)
            engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(stage, **extra))
            steps = _steps_waits(engine, rank, world)
            out.append((stage, precision, optimizer["type"], steps, engine.get_global_grad_norm()))
            engine.destroy()
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_a_step_on_the_device_waits_only_for_its_norm(tmp_path):
    """A ZeRO step with its masters on the device never drains the GPU's stream: the gradient
    norm is copied to the host behind the work that makes it and read through an event. With
    torch's fused AdamW the update (skipped on the device by ``found_inf`` when the norm is not
    finite) is queued before that read, so the GPU is still busy while the host waits; an
    optimizer without ``found_inf`` (SGD) is launched after it. Stages 0-3, fp32 / bf16 / fp16,
    clipping on."""
    for rank in run_distributed(_host_waits, world=2, args=(str(tmp_path),)):
        for stage, precision, optimizer, steps, norm in rank:
            want = [("launch", ""), ("event", "")]
            if optimizer == "SGD":
                want = want[::-1]
            want = [("forward", "")] * GAS + want
            assert steps == [want] * STEPS, (stage, precision, optimizer, steps)
            assert norm > 0, (stage, precision, optimizer)


_OFFLOAD_CASES = {
    "stage1": (1, {"offload_optimizer": {"device": "cpu", "pin_memory": True}}),
    "stage2": (2, {"offload_optimizer": {"device": "cpu", "pin_memory": True}}),
    "stage3": (3, {"offload_optimizer": {"device": "cpu", "pin_memory": True}}),
    "stage3-param-cpu": (
        3,
        {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    ),
    "stage3-param-nvme": (3, {"offload_param": {"device": "nvme"}}),
}


def _offloaded_waits(rank, world, root):
    out = {}
    with virtual_cuda():
        for name, (stage, zero) in _OFFLOAD_CASES.items():
            if "nvme" in name:
                os.makedirs(path := os.path.join(root, f"{name}{rank}"), exist_ok=True)
                zero = {"offload_param": {"device": "nvme", "nvme_path": path}}
            extra = {"gradient_clipping": 1.0, "bf16": {"enabled": True}, "zero": zero}
            torch.manual_seed(0)
            engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(stage, **extra))
            out[name] = _steps_waits(engine, rank, world)
            engine.destroy()
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_offloading_queues_its_uploads_and_waits_only_for_the_gradients(tmp_path):
    """With the optimizer (or the parameters) offloaded, the host waits for the device only
    where it must: to read the reduced gradients it steps on (copies from the device; with the
    optimizer offloaded only events behind the copies, at stages 2-3 waited for once the GPU is
    past them, at stage 1 once for all of the boundary's).
    Offloaded
    parameter pieces go up for each gather, and the stepped masters come back down to the
    parameters, in copies the host does not wait for; the staging buffers they go through are
    written again only after an event recorded behind their last copy (``("event", "")``)."""
    for rank in run_distributed(_offloaded_waits, world=2, args=(str(tmp_path),)):
        for name, steps in rank.items():
            assert len(steps) == STEPS
            for waits in steps:
                kinds = [kind for kind, _ in waits]
                assert kinds.count("launch") == 1 and kinds.count("forward") == GAS, waits
                # forward queues everything, the fetches of offloaded pieces included
                assert kinds[0] == "forward", (name, waits)
                # after the launch: the write-back, waiting on staging events at most (pieces in
                # files, stepped on the device, are read back to be written there)
                after = kinds[kinds.index("launch") + 1 :]
                if name != "stage3-param-nvme":
                    assert set(after) <= {"event"}, (name, waits)
                # every wait on the whole stream reads gradients from the device; stages 2-3
                # bring their pieces down behind events (Downloads), added into the host
                # gradients later, and stage 1 queues its boundary copies and waits for them
                # once: the host never waits for the whole stream for gradients
                streams = [what for kind, what in waits if kind == "stream"]
                if name in ("stage1", "stage2", "stage3", "stage3-param-cpu"):
                    assert streams == [], waits
                    assert "event" in kinds[: kinds.index("launch")], waits
                else:
                    assert streams
                    assert all("from the device" in w or w == "to(cpu)" for w in streams)


def test_a_staging_buffer_is_written_again_only_after_its_copy():
    """Uploads' guard, and virtual CUDA's model of an in-flight copy that it relies on: the
    second write of a staging buffer waits for the event behind the first copy; writing the
    buffer without that wait is refused as the race it is on a GPU."""
    from zerostack.zero.offload.host import Uploads

    with virtual_cuda():
        uploads = Uploads(torch.device("cuda", 0), pin=True)
        key = torch.nn.Parameter(torch.zeros(1))
        dst = torch.zeros(4, dtype=torch.bfloat16, device="cuda")
        master = torch.arange(4, dtype=torch.float32)
        uploads.copy(key, dst, master)
        assert HOST_WAITS == []  # queued, not waited for
        master += 1  # the master itself is not what the copy reads
        uploads.copy(key, dst, master)
        assert HOST_WAITS == [("event", "")]
        assert dst.cpu().tolist() == [1.0, 2.0, 3.0, 4.0]
        staging, _ = uploads.staging[key]
        uploads.copy(key, dst, master)  # in flight again
        with pytest.raises(DeviceError, match="non-blocking copy to the device may still"):
            staging.add_(1)


ODD = GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, d_model=20, bias=True)


def _alignment(rank, world, stage):
    with virtual_cuda():
        torch.manual_seed(0)
        cfg = _config(stage, bf16={"enabled": True}, zero={"reduce_bucket_size": 1000})
        engine, *_ = zerostack.initialize(model=GPT(ODD), config=cfg)
        UNALIGNED.clear()  # what initialize broadcast: the user's tensors, whole
        _loop(engine, rank, world, steps=range(2))
        engine.destroy()
        return list(UNALIGNED)


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_collective_buffer_starts_16_byte_aligned(stage):
    """A model whose sizes are not multiples of 8 (biases of 20 and 60, a 20-wide model), in
    bf16 at dp 2: every tensor the training steps hand to NCCL starts on a 16-byte boundary
    (bucket pieces, stage 3's coalesced pieces and rows), where NCCL and multi-tensor apply
    take their fast paths. With pieces padded to whole elements only, several do not."""
    for unaligned in run_distributed(_alignment, world=2, args=(stage,)):
        assert unaligned == [], unaligned[:3]


def test_offloaded_gradients_come_down_on_a_side_stream():
    """Downloads' copies run on a stream of their own, behind the collective that made the
    piece: the compute stream goes on without them (writing the piece on it now would be the
    race virtual CUDA refuses), the piece may be freed at once (announced to the copy's stream),
    and the host waits only for the copy's event when it settles."""
    from zerostack.zero.offload.host import Downloads

    with virtual_cuda():
        downloads = Downloads(torch.device("cuda", 0))
        got = []
        first = torch.arange(4.0, device="cuda") * 2  # "reduced" on the compute stream
        downloads.fetch(first, got.append)
        with pytest.raises(DeviceError, match="may still be reading"):
            first.add_(1)  # the compute stream is not ordered after the copy
        second = torch.arange(4.0, device="cuda") + 10
        downloads.fetch(second, got.append)
        del second  # freed on the compute stream while its copy may run: record_stream
        (torch.ones(4, device="cuda") + 1).sum()  # the next op raises a race found at a free
        assert got == [] and HOST_WAITS == []  # queued, nothing waited for
        downloads.settle()
        assert HOST_WAITS == [("event", ""), ("event", "")]
        assert [t.tolist() for t in got] == [[0.0, 2.0, 4.0, 6.0], [10.0, 11.0, 12.0, 13.0]]


def _pageable(rank, world, root):
    with virtual_cuda():
        zero = {"offload_optimizer": {"device": "cpu", "pin_memory": False}}
        extra = {"bf16": {"enabled": True}, "zero": zero}
        torch.manual_seed(0)
        engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(2, **extra))
        steps = _steps_waits(engine, rank, world)
        engine.destroy()
    return steps


@pytest.mark.distributed
def test_pageable_offload_stops_the_host_and_is_warned_about(tmp_path, caplog):
    """``pin_memory: false`` on a GPU: the write-back of the stepped masters comes from pageable
    memory, so each copy stops the host until the stream has drained (CUDA's rule, modelled by
    virtual CUDA); ``initialize`` says so in one warning. The default pins (DeepSpeed's)."""
    from zerostack.config import load_config
    from zerostack.config.keys import warn_pageable_offload

    for steps in run_distributed(_pageable, world=2, args=(str(tmp_path),)):
        for waits in steps:
            after = waits[waits.index(("launch", "")) + 1 :]
            assert ("stream", "pageable non_blocking aten.copy_.default to the device") in after
    pageable = {"offload_optimizer": {"device": "cpu", "pin_memory": False}}
    cfg = load_config(_config(2, zero=pageable))
    with caplog.at_level("WARNING", logger="zerostack"):
        warn_pageable_offload(cfg, torch.device("cpu"), 0)  # nothing to stop on a CPU
        warn_pageable_offload(cfg, torch.device("cuda"), 1)  # rank 0 says it
        assert caplog.messages == []
        warn_pageable_offload(cfg, torch.device("cuda"), 0)
        default = load_config(_config(2, zero={"offload_optimizer": {"device": "cpu"}}))
        warn_pageable_offload(default, torch.device("cuda"), 0)
    assert caplog.messages == [
        "zero_optimization.offload_optimizer.pin_memory=false: offloaded state is copied from "
        "pageable host memory, and each copy stops the host until the GPU's stream has drained; "
        "set it true (DeepSpeed's default) unless page-locked memory is short"
    ]


def _window_grads(rank, world, root, virtual, stage):
    from zerostack.utils import safe_get_full_grad

    context = virtual_cuda() if virtual else contextlib.nullcontext()
    with context:
        torch.manual_seed(0)
        zero = {"offload_optimizer": {"device": "cpu"}}
        engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(stage, zero=zero))
        x, y = batch(0, MICRO * GAS * world)
        lo = rank * MICRO
        xb, yb = (t[lo : lo + MICRO].to(engine.device) for t in (x, y))
        engine.backward(engine(xb, yb))  # the window's first micro-step: its pieces pending
        grads = [safe_get_full_grad(p).cpu() for p in engine.module.parameters()]
        engine.destroy()
    return grads


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_a_mid_window_gradient_read_sees_the_pending_downloads(tmp_path, stage):
    """Stages 2-3 with the optimizer offloaded: the pieces come down to host memory behind
    events and are added later; ``safe_get_full_grad`` between micro-steps settles them first,
    and reads what the CPU run reads, bit for bit."""
    cpu = run_distributed(_window_grads, world=2, args=(str(tmp_path), False, stage))
    cuda = run_distributed(_window_grads, world=2, args=(str(tmp_path), True, stage))
    for a, b in zip(cpu, cuda, strict=True):
        assert all(torch.equal(g, h) for g, h in zip(a, b, strict=True))
        assert any(g.abs().sum() > 0 for g in a)


def _device_records(rank, world, root):
    with virtual_cuda():
        torch.manual_seed(0)
        engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(2))
        x, y = batch(0, MICRO * GAS * world)
        for m in range(GAS):
            lo = (m * world + rank) * MICRO
            xb, yb = (t[lo : lo + MICRO].to(engine.device) for t in (x, y))
            engine.backward(engine(xb, yb))
            if m < GAS - 1:
                engine.step()
        log = engine.comm.log
        backward = {r.seq: r.op for r in log.in_flight.values() if r.on_device}
        engine.step()
        log.poll()  # as the watchdog's thread does
        left = sorted(set(backward) & set(log.in_flight))
        engine.destroy()
    return sorted(set(backward.values())), left


@pytest.mark.distributed
def test_a_collective_stays_in_flight_until_the_device_has_run_it(tmp_path):
    """On NCCL ``wait()`` returns before the collective runs: the backward's reduce-scatters are
    still in flight, on the device, after ``backward`` returns (a watchdog can name one that
    never completes), and leave once the step's read of the norm has waited for them."""
    for ops, left in run_distributed(_device_records, world=2, args=(str(tmp_path),)):
        assert ops == ["reduce_scatter"] and left == []


def _side_stream(rank, world, root, virtual):
    """Stage 3 with the parameters offloaded to host memory: two steps; the final weights, and
    on virtual CUDA whether every piece went up on a stream other than the default one."""
    zero = {"offload_param": {"device": "cpu", "pin_memory": True}}
    cfg = _config(3, zero=zero, bf16={"enabled": True}, gradient_clipping=1.0)
    with virtual_cuda() if virtual else contextlib.nullcontext():
        torch.manual_seed(0)
        engine, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
        store = engine.zero.param_swapper.store
        load, sides = store.load, []

        def on_side(*args, **kwargs):
            sides.append(torch.cuda.current_stream() is not torch.cuda.default_stream())
            return load(*args, **kwargs)

        if virtual:
            store.load = on_side
        _loop(engine, rank, world)
        weights = _host(engine.full_state_dict())
        engine.destroy()
    return weights, sides


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
def test_offloaded_pieces_go_up_on_a_side_stream(tmp_path, world):
    """The pieces of offloaded parameters are copied up and gathered on a side stream, so the
    copies overlap the compute queued after them; virtual CUDA's stream model refuses any use
    of them, or of the gathered parameters, that is not ordered after that stream, and any free
    of its memory that another stream's use could outlive. At dp 1 the gathered parameters are
    the copied pieces themselves, read on the compute stream. Weights end as the CPU run's."""
    cpu = run_distributed(_side_stream, world=world, args=(str(tmp_path), False))
    cuda = run_distributed(_side_stream, world=world, args=(str(tmp_path), True))
    for (want, _), (got, sides) in zip(cpu, cuda, strict=True):
        assert sides and all(sides), sides
        assert want.keys() == got.keys()
        for k in want:
            assert torch.equal(want[k], got[k]), k


def test_the_stream_model_refuses_unordered_uses():
    """Virtual CUDA's streams, on a planted race of each kind: a read of another stream's
    write, a write over another stream's read, a free another stream's use may outlive; each
    allowed once ordered (wait_stream, an event, record_stream)."""
    with virtual_cuda():
        side, main = torch.cuda.Stream(), torch.cuda.current_stream()
        with torch.cuda.stream(side):
            x = torch.ones(4, device="cuda")
        with pytest.raises(DeviceError, match="without a wait between them"):
            x + 1
        main.wait_stream(side)
        y = x + 1
        with torch.cuda.stream(side):
            with pytest.raises(DeviceError, match="may still be reading"):
                x.mul_(2)
            side.wait_event(main.record_event())
            x.mul_(2)
        with torch.cuda.stream(side):
            z = torch.zeros(4, device="cuda")
        main.wait_stream(side)
        y += z
        del z  # made on the side stream, last used on main: the allocator may reuse it at once
        with pytest.raises(DeviceError, match="record_stream"):
            y + 1
        with torch.cuda.stream(side):
            w = torch.zeros(4, device="cuda")
        main.wait_stream(side)
        y += w
        w.record_stream(main)
        del w
        y + 1


def _device_memory(rank, world, root):
    with virtual_cuda():
        figures = {"memory_allocated": 5, "max_memory_allocated": 7, "memory_reserved": 11}
        for name, value in figures.items():
            setattr(torch.cuda, name, lambda device=None, value=value: value)
        torch.cuda.host_memory_stats = lambda: {"allocated_bytes.current": 16, "active_bytes": 9}
        monitor = {"enabled": True, "output_path": root, "job_name": "job"}
        engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(2, csv_monitor=monitor))
        _loop(engine, rank, world, range(1))
        engine.destroy()
        return engine.device_memory()


@pytest.mark.distributed
def test_the_cuda_allocator_figures_are_reported_beside_the_census(tmp_path):
    """``engine.device_memory()``: the CUDA allocator's allocated / peak / reserved bytes and
    the page-locked bytes its host allocator holds, rounded (empty on the CPU), written by the
    monitors each step on a GPU."""
    for figures in run_distributed(_device_memory, world=2, args=(str(tmp_path),)):
        assert figures == {"allocated": 5, "max_allocated": 7, "reserved": 11, "pinned": 16}
    written = (tmp_path / "job" / "Train_Samples_cuda_max_allocated_bytes_rank0.csv").read_text()
    assert written.splitlines() == ["step,cuda_max_allocated_bytes_rank0", "8,7.0"]  # x: samples
    torch.manual_seed(0)
    cpu, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(0))
    assert cpu.device_memory() == {}
    cpu.destroy()


def _threads(rank, world, root, offload):
    import os as _os

    with virtual_cuda():
        torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1
        _os.cpu_count = lambda: 16
        zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
        engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(2, zero=zero))
        threads = torch.get_num_threads()
        engine.destroy()
        return threads


@pytest.mark.distributed
@pytest.mark.parametrize("offload, threads", [(True, 8), (False, 1)])
def test_an_offloaded_optimizer_gets_the_cores_on_a_gpu_node(tmp_path, offload, threads):
    """16 cores, 2 local ranks: CPUAdam steps with 8 threads per rank, not torchrun's one."""
    assert run_distributed(_threads, world=2, args=(str(tmp_path), offload)) == [threads] * 2


# ---------------------------------------------------------------------- the start's peak
def _device_model() -> tuple[GPT, int]:
    """A GPT of 0.8M parameters built on the (virtual) device, and its parameter count."""
    cfg = GPTConfig(vocab_size=512, block_size=16, n_layer=4, n_head=4, d_model=128)
    torch.manual_seed(0)
    model = GPT(cfg).to("cuda")
    return model, sum(p.numel() for p in model.parameters())


def _init_peak(rank, world, root, stage, precision):
    from tests.support.vcuda import MEMORY

    with virtual_cuda():
        model, psi = _device_model()
        torch.cuda.reset_peak_memory_stats()
        assert MEMORY.allocated == 4 * psi  # the model, fp32, on the device
        config = _config(stage, **({precision: {"enabled": True}} if precision else {}))
        # gloo's worker thread may hold the tensor of a broadcast a while after the wait
        # returns; here the last one is always held, so the peak cannot depend on that race
        held, broadcast = [], torch.distributed.broadcast

        def holding(tensor, *args, **kwargs):
            held[:] = [tensor]
            return broadcast(tensor, *args, **kwargs)

        torch.distributed.broadcast = holding
        try:
            engine, *_ = zerostack.initialize(model=model, config=config)
        finally:
            torch.distributed.broadcast = broadcast
            held.clear()
        return torch.cuda.max_memory_allocated() / psi, torch.cuda.memory_allocated() / psi


@pytest.mark.distributed
@pytest.mark.parametrize(
    "stage, precision, peak, after",
    [(1, "bf16", 8, 6), (2, "bf16", 8, 6), (1, None, 8, 8), (2, None, 8, 6)],
)
def test_the_start_peaks_near_the_steady_state(tmp_path, stage, precision, peak, after):
    """Device bytes per parameter while ``initialize`` builds stages 1-2 (dp 2), counted by
    virtual CUDA's allocator: the fp32 model (4) and, parameter by parameter, its 16-bit buffer
    (2) and fp32 master pieces (4 / dp), never a whole fp32 copy beside them (12 before); then
    the steady state, the model's own storage gone: parameters, gradients (bf16: 2 + 2; fp32
    stage 1: 4 + 4, the master a view; stage 2: 4 + 4 / dp) and masters (bf16: 4 / dp). The
    optimizer's moments come at its first step."""
    for got_peak, got_after in run_distributed(
        _init_peak, world=2, args=(str(tmp_path), stage, precision)
    ):
        assert (got_peak, got_after) == (peak, after)


# ---------------------------------------------------------------------- device and host apart
def _by_device(rank, world, root, stage, offload):
    from tests.support.vcuda import MEMORY

    with virtual_cuda():
        model, psi = _device_model()
        zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
        engine, *_ = zerostack.initialize(
            model=model, config=_config(stage, bf16={"enabled": True}, zero=zero)
        )
        del model
        _loop(engine, rank, world, steps=range(1))
        places = engine.memory_by_device()
        kinds = engine.memory_breakdown()
        state = [t for s in engine.optimizer.state.values() for t in s.values()]
        steps = [t for t in state if torch.is_tensor(t) and t.dim() == 0 and t.is_cuda]
        for _ in range(100):  # gloo's worker thread may hold a waited gather's input a moment
            gc.collect()
            # the virtual allocator: every live device storage, less fused Adam's step counters
            device_bytes = MEMORY.allocated - sum(t.nbytes for t in steps)
            if device_bytes == sum(places["cuda"].values()):
                break
            time.sleep(0.01)
        engine.destroy()
        return psi, places, kinds, device_bytes


@pytest.mark.distributed
@pytest.mark.parametrize("stage, offload", [(1, False), (2, True), (3, True)])
def test_device_and_host_bytes_are_reported_apart(tmp_path, stage, offload):
    """``engine.memory_by_device()`` splits ``memory_breakdown`` by where each buffer lives
    (bf16, dp 2, after a step): with the optimizer offloaded the fp32 masters, their Adam
    moments and the fp32 gradient shard are host bytes, the 16-bit parameters and gradients
    device bytes, and the device side is every byte virtual CUDA's allocator still holds."""
    for psi, places, kinds, device_bytes in run_distributed(
        _by_device, world=2, args=(str(tmp_path), stage, offload)
    ):
        # the split adds up to the breakdown, kind by kind
        for kind, total in kinds.items():
            assert sum(place.get(kind, 0) for place in places.values()) == total, kind
        cuda = places["cuda"]
        assert sum(cuda.values()) == device_bytes
        shard = psi // 2  # this rank's share of each fp32 buffer, at dp 2
        if not offload:
            assert set(places) == {"cuda"}
            assert cuda["master"] == 4 * shard and cuda["optimizer"] == 8 * shard
            continue
        host = places["cpu"]
        assert host == {"params": 0, "grads": 4 * shard, "master": 4 * shard, "scratch": 0,
                        "optimizer": 8 * shard}  # fmt: skip
        assert cuda["master"] == cuda["optimizer"] == 0
        assert cuda["params"] == (2 * psi if stage < 3 else 2 * shard)


def test_a_cpu_run_holds_everything_on_the_host():
    torch.manual_seed(0)
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(2))
    assert engine.memory_by_device() == {"cpu": engine.memory_breakdown()}
    engine.destroy()


def _gpu_check_sh(tmp_path, budget: int):
    import json
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", OUT=str(tmp_path), GPU_CHECK_BUDGET=str(budget))
    proc = subprocess.run(
        ["bash", os.path.join(root, "scripts", "gpu_check.sh")],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    rows = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    saved = (tmp_path / "gpu_check.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in saved] == rows[:-1]  # written as they came, but the summary
    return proc, rows


def test_the_gpu_check_skips_what_its_time_budget_no_longer_fits(tmp_path):
    """No check is started that the budget cannot hold (one device call must end in time)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    from gpu_check import CHECKS

    proc, rows = _gpu_check_sh(tmp_path, budget=0)
    assert proc.returncode == 0, proc.stderr[-2000:]
    skipped = "out of time (GPU_CHECK_BUDGET)"
    assert rows[: len(CHECKS)] == [{"check": c, "ok": None, "skipped": skipped} for c in CHECKS]
    assert rows[-1] == {"summary": True, "failed": [], "checks": len(rows) - 1}


@pytest.mark.slow
def test_the_gpu_check_script_runs_on_this_cpu_machine(tmp_path):
    """``bash scripts/gpu_check.sh``, as the lent machine runs it: every check in its own
    process, each passing (tiny, on the CPU) or skipped saying why (two GPUs, CUDA's sync
    debug mode), then the summary; no traceback."""
    proc, rows = _gpu_check_sh(tmp_path, budget=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert rows[-1]["summary"] and rows[-1]["failed"] == []
    assert all(r["ok"] or r.get("skipped") for r in rows[:-1]), rows
    # 3 two-GPU runs, the sync debug mode; NCCL's lifetimes (twice), offload's host time and
    # the stream sanitizer need CUDA
    assert sum(1 for r in rows if r.get("skipped")) == 8
    names = {r["check"] for r in rows[:-1]}
    assert {"zero3-bf16-vs-fp32", "examples/train_gpt.py", "gpt-zero3-bf16"} <= names
    assert {f"fake-dp8-zero{stage}-bf16" for stage in (1, 2, 3)} <= names  # check A at dp 8
    for stage in range(4):  # checks D and E's autocast
        assert {f"zero{stage}-fp16-inf-skipped-on-device", f"zero{stage}-user-autocast-bf16"} <= (
            names
        )
        assert f"zero{stage}-fp32-compiled-aot_eager" in names
    assert "Traceback" not in (tmp_path / "gpu_check.err").read_text()
