"""The monitor blocks (``tensorboard``, ``csv_monitor``, ``wandb``) write what the training loop
saw, on rank 0 only, with DeepSpeed's names and layout; ``steps_per_print`` prints on stdout.

DeepSpeed's x-axis is ``global_samples`` after the step; its train loss is the step's mean over
the micro-batches and the dp ranks (its pipeline engine's ``agg_train_loss``)."""

from __future__ import annotations

import contextlib
import csv
import glob
import io
import json
import logging
import os
import re
import struct

import pytest

from zerostack.config import ConfigError, load_config
from zerostack.monitor import CSVMonitor, open_monitors

from tests.support.models import TINY, batch, micro_batches, tiny_gpt
from tests.support.ranks import run_distributed

MICRO, GAS, STEPS = 2, 2, 3
NAMES = ("train_loss", "lr", "grad_norm", "memory_bytes_rank0", "comm_bytes_dp_rank0")


def _config(**extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 0.1}},
        "steps_per_print": 2,
        **extra,
    }


def _read_csv(path: str) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def _train(rank, world, out, monitors):
    import zerostack

    blocks = {k: {"enabled": True, "output_path": out, "job_name": "job"} for k in monitors}
    if "wandb" in monitors:  # an offline run under out/wandb/
        os.environ.update(WANDB_MODE="offline", WANDB_DIR=out, WANDB_SILENT="true")
        blocks["wandb"] = {"enabled": True, "project": "zerostack-test"}
    config = _config(**blocks)
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=config)
    seen = {"loss": [], "lr": [], "grad_norm": [], "memory": [], "comm_dp": []}
    flushed = None
    for step in range(STEPS):
        x, y = batch(step, MICRO * GAS * world)
        window = []
        for micro in range(GAS):
            lo = (micro * world + rank) * MICRO
            loss = engine(x[lo : lo + MICRO], y[lo : lo + MICRO])
            window.append(loss.item())
            engine.backward(loss)
            engine.step()
        seen["loss"].append(window)
        seen["lr"].append(engine.get_lr()[0])
        seen["grad_norm"].append(engine.get_global_grad_norm())
        seen["memory"].append(sum(engine.memory_breakdown().values()))
        log = engine.comm.log
        seen["comm_dp"].append(sum(r.bytes for r in log.for_step(step) if r.axis == "dp"))
        if step == 1 and rank == 0 and "csv_monitor" in monitors:  # steps_per_print: flushed
            flushed = len(_read_csv(os.path.join(out, "job", "Train_Samples_train_loss.csv")))
    engine.destroy()
    return seen, flushed, engine.train_batch_size()


def _expected(results):
    """Per step: the mean over ranks and micro-batches of the losses the loops saw."""
    losses = [[sum(r[0]["loss"][s]) / GAS for r in results] for s in range(STEPS)]
    return [sum(per_rank) / len(per_rank) for per_rank in losses]


@pytest.mark.distributed
def test_tensorboard_and_csv_hold_what_the_loop_saw(tmp_path):
    """dp 2, 2 micro-batches a step: the loss of each step is the mean of the 4 losses the two
    loops saw; lr, grad norm, memory and dp bytes are what the engine reported after the step."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = str(tmp_path)
    results = run_distributed(_train, 2, args=(out, ("tensorboard", "csv_monitor")))
    seen, flushed, tbs = results[0]
    loss = _expected(results)
    assert abs(loss[0] - sum(results[0][0]["loss"][0]) / GAS) > 1e-6  # the ranks' losses differ
    steps = [tbs * (s + 1) for s in range(STEPS)]
    want = {
        "train_loss": loss,
        "lr": seen["lr"],
        "grad_norm": seen["grad_norm"],
        "memory_bytes_rank0": seen["memory"],
        "comm_bytes_dp_rank0": seen["comm_dp"],
    }
    assert len(set(seen["lr"])) == STEPS and min(seen["comm_dp"]) > 0

    # TensorBoard: one event file (rank 0's), the values at x = global_samples
    files = glob.glob(os.path.join(out, "job", "events.out.tfevents.*"))
    assert len(files) == 1, files
    acc = EventAccumulator(os.path.join(out, "job"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {f"Train/Samples/{n}" for n in NAMES} | {"Train/Samples/samples_per_sec"} <= tags
    assert "Train/Samples/loss_scale" not in tags  # fp32: DeepSpeed writes it in fp16 only
    for name, values in want.items():
        events = acc.Scalars(f"Train/Samples/{name}")
        assert [e.step for e in events] == steps, name
        assert [e.value for e in events] == pytest.approx(values, rel=1e-6), name
    speed = acc.Scalars("Train/Samples/samples_per_sec")
    assert [e.step for e in speed] == steps[1:] and min(e.value for e in speed) > 0

    # CSV: DeepSpeed's layout, the same values; flushed at the end of the print interval
    assert flushed == 1 + 2  # header and the first two steps, read before destroy()
    for name, values in want.items():
        rows = _read_csv(os.path.join(out, "job", f"Train_Samples_{name}.csv"))
        assert rows[0] == ["step", name]
        assert [int(r[0]) for r in rows[1:]] == steps, name
        assert [float(r[1]) for r in rows[1:]] == pytest.approx(values, rel=1e-6), name


def _pipeline(rank, world, out):
    import zerostack
    from zerostack import Topology
    from zerostack.models.gpt_pipe import GPTLoss, gpt_layers
    from zerostack.pipeline import PipelineModule

    topo = Topology.build(pp=2)
    model = PipelineModule(gpt_layers(TINY), topology=topo, loss_fn=GPTLoss())
    config = _config(csv_monitor={"enabled": True, "output_path": out, "job_name": "pp"})
    engine, *_ = zerostack.initialize(model=model, config=config)
    losses = []
    for step in range(STEPS):
        losses.append(engine.train_batch(iter(micro_batches(step, MICRO, GAS))).item())
    engine.destroy()
    return losses, engine.train_batch_size()


@pytest.mark.distributed
def test_the_pipeline_engine_writes_the_last_stages_loss_from_rank_0(tmp_path):
    """Rank 0 (the first stage) writes the batch's mean loss, which the last stage computed:
    what ``train_batch()`` returned; its pp bytes are the activations it sent and received."""
    out = str(tmp_path)
    (losses, tbs), _ = run_distributed(_pipeline, 2, args=(out,))
    rows = _read_csv(os.path.join(out, "pp", "Train_Samples_train_loss.csv"))
    assert [int(r[0]) for r in rows[1:]] == [tbs * (s + 1) for s in range(STEPS)]
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(losses, rel=1e-6)
    pp = _read_csv(os.path.join(out, "pp", "Train_Samples_comm_bytes_pp_rank0.csv"))
    assert len(pp) == 1 + STEPS and min(float(r[1]) for r in pp[1:]) > 0


def _wandb_history(path: str) -> dict[int, dict[str, float]]:
    """The logged values per step of an offline wandb run file (``run-<id>.wandb``: LevelDB's
    log format, 32 KiB blocks of records with a 7-byte header, after a 7-byte file header;
    each record a ``wandb_internal_pb2.Record``)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, parts, out = 7, 32768, b"", {}
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last part of one
            rec = pb.Record()
            rec.ParseFromString(parts)
            parts = b""
            if rec.WhichOneof("record_type") == "history":
                items = {"/".join(i.nested_key) or i.key: i.value_json for i in rec.history.item}
                out[rec.history.step.num] = {
                    k: json.loads(v) for k, v in items.items() if not k.startswith("_")
                }
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_wandb_offline_run_holds_what_the_loop_saw(tmp_path):
    pytest.importorskip("wandb")
    out = str(tmp_path)
    results = run_distributed(_train, 2, args=(out, ("wandb",)))
    seen, _, tbs = results[0]
    runs = glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(runs) == 1, runs  # rank 0's only
    history = _wandb_history(runs[0])
    assert sorted(history) == [tbs * (s + 1) for s in range(STEPS)]
    steps = sorted(history)
    loss = [history[x]["Train/Samples/train_loss"] for x in steps]
    assert loss == pytest.approx(_expected(results), rel=1e-6)
    assert [history[x]["Train/Samples/lr"] for x in steps] == pytest.approx(seen["lr"])
    assert "Train/Samples/samples_per_sec" in history[steps[1]]


def _print_run(rank, world, out, setup):
    import zerostack

    buf = io.StringIO()
    if setup == "logging":
        logging.basicConfig(level=logging.INFO, stream=buf, format="%(name)s: %(message)s")
    elif setup == "silenced":
        logging.getLogger("zerostack").setLevel(logging.WARNING)
    config = _config(
        fp16={"enabled": True, "initial_scale_power": 8},
        csv_monitor={"enabled": True, "output_path": out, "job_name": "fp16"},
        flops_profiler={"enabled": True, "profile_step": 1, "detailed": False},
    )
    stdout = io.StringIO()
    scales = []
    with contextlib.redirect_stdout(stdout):
        engine, *_ = zerostack.initialize(model=tiny_gpt(), config=config)
        for step in range(4):
            x, y = batch(step, MICRO * GAS)
            for micro in range(GAS):
                lo = micro * MICRO
                engine.backward(engine(x[lo : lo + MICRO], y[lo : lo + MICRO]))
                engine.step()
            scales.append(engine.loss_scale)
        engine.destroy()
    flops = engine.flops_profile.last_step_flops
    return stdout.getvalue(), buf.getvalue(), scales, flops, engine.world_size


def _step_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if re.match(r"(zerostack: )?step=", ln)]


@pytest.mark.distributed
def test_steps_per_print_is_seen_on_stdout_once(tmp_path):
    """Without a logging set-up the step line goes to stdout (as DeepSpeed prints it); with one
    that shows INFO, only through logging; with the "zerostack" logger set above INFO, nowhere.
    The same run writes fp16's loss scale, and TFLOP/s once the flops profiler has a step."""
    out = str(tmp_path)
    stdout, logged, scales, flops, world = run_distributed(_print_run, 1, args=(out, None))[0]
    lines = _step_lines(stdout)
    assert [ln.split()[0] for ln in lines] == ["step=2", "step=4"], stdout
    assert "loss_scale=" in lines[0] and "samples/s=" in lines[1]
    assert logged == ""

    rows = _read_csv(os.path.join(out, "fp16", "Train_Samples_loss_scale.csv"))
    assert rows[0] == ["step", "loss_scale"]
    assert [int(r[0]) for r in rows[1:]] == [4, 8, 12, 16]
    assert [float(r[1]) for r in rows[1:]] == scales and scales[0] == 256.0
    # the same seconds divide both: TFLOP/s per rank over samples/s is flops per sample
    speed = {
        r[0]: float(r[1]) for r in _read_csv(f"{out}/fp16/Train_Samples_samples_per_sec.csv")[1:]
    }
    tflops = _read_csv(os.path.join(out, "fp16", "Train_Samples_tflops_per_rank.csv"))[1:]
    assert [r[0] for r in tflops] == ["8", "12", "16"]  # profiled at step 2
    for x, value in tflops:
        assert float(value) / speed[x] == pytest.approx(flops / world / 1e12 / 4, rel=1e-9)

    stdout, logged, *_ = run_distributed(_print_run, 1, args=(out, "logging"))[0]
    assert _step_lines(stdout) == []
    assert [ln.split()[1] for ln in _step_lines(logged)] == ["step=2", "step=4"], logged
    assert all(ln.startswith("zerostack: step=") for ln in _step_lines(logged))

    stdout, logged, *_ = run_distributed(_print_run, 1, args=(out, "silenced"))[0]
    assert _step_lines(stdout) == [] and _step_lines(logged) == []


def _initialize_error(rank, world, config):
    import zerostack

    try:
        zerostack.initialize(model=tiny_gpt(), config=config)
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.distributed
def test_a_path_rank_0_cannot_write_fails_on_every_rank(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    config = _config(csv_monitor={"enabled": True, "output_path": str(blocker)})
    errors = run_distributed(_initialize_error, 2, args=(config,))
    assert errors == [
        f"csv_monitor.output_path: cannot create {blocker}/DeepSpeedJobName: Not a directory",
        "csv_monitor: rank 0 could not open this monitor (its error says why)",
    ]


def test_a_missing_package_is_one_line_naming_the_key(monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "tensorboard", None)
    cfg = load_config({"tensorboard": {"enabled": True, "output_path": str(tmp_path)}})
    with pytest.raises(ConfigError) as err:
        open_monitors(cfg, rank=1)  # every rank checks, not only the writer
    assert str(err.value) == (
        "tensorboard.enabled: needs the tensorboard package, which is not installed: "
        "pip install tensorboard (or pip install 'zerostack[tensorboard]')"
    )
    assert os.listdir(tmp_path) == []


def test_csv_layout_is_deepspeeds(tmp_path):
    """One file per metric, ``/`` and spaces as ``_``; header ``step,<last part>``; a file is
    appended to, its header written once per process (as DeepSpeed's csvMonitor)."""
    cfg = load_config({"csv_monitor": {"enabled": True, "output_path": str(tmp_path)}})
    mon = CSVMonitor(cfg.csv_monitor)
    mon.write_events([("Train/Samples/train loss", 2.5, 8), ("lr", 0.1, 8)])
    mon.write_events([("Train/Samples/train loss", 2.25, 16)])
    mon.close()
    job = tmp_path / "DeepSpeedJobName"
    assert sorted(os.listdir(job)) == ["Train_Samples_train_loss.csv", "lr.csv"]
    assert _read_csv(job / "Train_Samples_train_loss.csv") == [
        ["step", "train loss"],
        ["8", "2.5"],
        ["16", "2.25"],
    ]
    assert _read_csv(job / "lr.csv") == [["step", "lr"], ["8", "0.1"]]


def test_off_rank_0_nothing_is_opened(tmp_path):
    cfg = load_config({"csv_monitor": {"enabled": True, "output_path": str(tmp_path)}})
    master = open_monitors(cfg, rank=1)
    assert master.enabled and master.monitors == []
    master.write_events([("lr", 0.1, 1)])
    assert os.listdir(tmp_path) == []
    assert not open_monitors(load_config({}), rank=0).enabled
