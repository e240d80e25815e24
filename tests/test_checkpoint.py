"""Checkpoints: exact resume, another ZeRO stage / dp / tp / pp layout on load, nothing lost on a
failed save.

Exact resume is bit for bit: the fp32 masters, the Adam moments and steps, the loss scaler and the
counters come back exactly, so the losses after resuming are the uninterrupted run's. After a
layout change the parameters right after loading are the saved ones, bit for bit, and 3 more
steps end within 1e-6 of the uninterrupted run on the new layout (only the order of sums differs
between layouts), which fails loudly if the moments were not carried over.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

import pytest
import torch

import zerostack
from zerostack.checkpoint import CheckpointError

from tests.support.models import TINY, batch, max_rel_diff, reference_train, tiny_gpt
from tests.support.ranks import run_distributed

B = 8


def _config(world, stage, gas=1, fp16=False):
    cfg = {
        "train_micro_batch_size_per_gpu": B // world // gas,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-3}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 5000,
            "stage3_param_persistence_threshold": 0,
        },
    }
    if fp16:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def _steps(engine, rank, world, first, count):
    gas = engine.gradient_accumulation_steps()
    per = B // world // gas
    losses = []
    for step in range(first, first + count):
        x, y = batch(step, B)
        for m in range(gas):
            lo = (m * world + rank) * per
            loss = engine(x[lo : lo + per], y[lo : lo + per])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


# JSON values and tensors anywhere in it (the tensors go to client_state.safetensors)
CLIENT = {
    "epoch": 1,
    "note": "three steps",
    "ema": {"w": torch.arange(6.0).view(2, 3)},
    "seen": [torch.tensor([4, 5], dtype=torch.int64), 3],
}


def _resume(rank, world, stage, root, gas, fp16):
    cfg = _config(world, stage, gas, fp16)
    whole, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
    uninterrupted = _steps(whole, rank, world, 0, 6)[3 * gas :]
    first, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
    _steps(first, rank, world, 0, 3)
    first.save_checkpoint(root, client_state=CLIENT)
    second, *_ = zerostack.initialize(model=tiny_gpt(seed=7), config=cfg)  # other weights
    path, client = second.load_checkpoint(root)
    resumed = _steps(second, rank, world, 3, 3)
    states = _state(whole), _state(second)
    return uninterrupted, resumed, client, second.global_steps, states, path


def _state(engine) -> dict[str, torch.Tensor]:
    """What exact resume must bring back: the parameters, each fp32 master with its optimizer
    state (moments and step; read from the files on NVMe) and the loss scaler."""
    out = {f"param/{k}": v for k, v in engine.full_state_dict().items()}
    for i, m in enumerate(engine.zero.masters()):
        for k, v in engine.zero.read_master(m, engine.optimizer).items():
            out[f"master{i}/{k}"] = v.clone()
        out[f"master{i}/step"] = engine.optimizer.state[m]["step"].clone()
    for k, v in engine.loss_scaler.state_dict().items():
        out[f"loss_scaler/{k}"] = torch.tensor(v)
    return out


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: {sorted(got.keys() ^ want.keys())}"
    assert any(k.endswith("/exp_avg_sq") for k in want), f"{what}: no optimizer moments"
    for k in want:
        assert torch.equal(got[k], want[k]), f"{what}: {k} differs from the uninterrupted run"


@pytest.mark.distributed
@pytest.mark.parametrize(
    "stage,gas,fp16", [(0, 1, False), (1, 2, False), (2, 1, True), (3, 2, False), (3, 1, True)]
)
@pytest.mark.slow
def test_exact_resume(stage, gas, fp16, tmp_path):
    for whole, resumed, client, steps, (want, got), path in run_distributed(
        _resume, 2, args=(stage, str(tmp_path), gas, fp16)
    ):
        assert resumed == whole  # bit for bit
        _assert_equal(got, want, f"stage {stage}")
        assert steps == 6
        assert client.keys() == CLIENT.keys() and client["epoch"] == 1
        assert client["seen"][1] == 3 and torch.equal(client["seen"][0], CLIENT["seen"][0])
        assert torch.equal(client["ema"]["w"], CLIENT["ema"]["w"])  # tensors, not pickled
        assert path == str(tmp_path / "global_step3")
    assert (tmp_path / "latest").read_text() == "global_step3"
    assert sorted(os.listdir(tmp_path / "global_step3")) == [
        "client_state.safetensors",
        "manifest.json",
        "rank00000.safetensors",
        "rank00001.safetensors",
    ]


# ------------------------------------------------------- exact resume through the engine's loader
# 12 samples, 2 per micro-batch on each of 2 ranks: 3 micro-steps an epoch. The save comes after
# micro-step 4 (epoch 1, one micro-batch in), the run ends after 8 (in epoch 2).
SAMPLES, SAVE, STOP = 12, 4, 8
DROPOUT = dataclasses.replace(TINY, dropout=0.1)
FP16_POWER = 18  # overflows within the first steps (the saved scale is smaller), then trains

RESUME_CASES = {
    "stage 0, dropout, gas 2": dict(stage=0, gas=2, dropout=True),
    "stage 3, fp16, scale lowered": dict(
        stage=3, fp16={"enabled": True, "initial_scale_power": FP16_POWER, "hysteresis": 1}
    ),
    "stage 2, bf16, dropout": dict(stage=2, bf16={"enabled": True}, dropout=True),
    "pipeline pp 2, dropout": dict(pipeline=True),
    "pipeline pp 2, stage 3, dropout": dict(pipeline=True, stage=3),
}
OFFLOAD_CASES = {
    "stage 2, cpu": dict(stage=2, offload_optimizer={"device": "cpu"}),
    "stage 3, cpu, offload_param cpu": dict(
        stage=3, offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"}
    ),
    "stage 1, nvme, fp16": dict(
        stage=1, offload_optimizer={"device": "nvme"}, fp16={"enabled": True}
    ),
    "stage 3, nvme, offload_param nvme, bf16": dict(
        stage=3,
        offload_optimizer={"device": "nvme"},
        offload_param={"device": "nvme"},
        bf16={"enabled": True},
    ),
}


def _case_config(case: dict, nvme: str) -> dict:
    cfg = _config(2, case["stage"], case.get("gas", 1))
    cfg["train_micro_batch_size_per_gpu"] = 2
    zero = cfg["zero_optimization"]
    for key in ("offload_optimizer", "offload_param"):
        if key in case:  # in files: a few sub-groups, under the test's folder
            zero[key] = {**case[key], "nvme_path": nvme}
            zero["sub_group_size"] = 3000
    for key in ("fp16", "bf16"):
        if key in case:
            cfg[key] = case[key]
    return cfg


def _loop(engine, loader, stop: int) -> list[float]:
    """A DeepSpeed-style loop over the engine's loader, epoch after epoch, to micro-step ``stop``;
    returns the losses."""
    losses = []
    for epoch in itertools.count(loader.sampler.epoch):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if engine.micro_steps == stop:
                return losses
    raise AssertionError("unreachable")


def _pipeline_engine(seed: int, data, stage: int = 1):
    from zerostack.models.gpt_pipe import GPTLoss, gpt_layers, load_plain_state
    from zerostack.pipeline import PipelineModule

    cfg = dataclasses.replace(_tp_cfg(), dropout=0.1)
    topo = zerostack.Topology.build(pp=2)
    model = PipelineModule(
        gpt_layers(cfg, topology=topo),
        topology=topo,
        loss_fn=GPTLoss(topo),
        partition_method="type:Block",
    )
    load_plain_state(model, tiny_gpt(seed=seed, cfg=cfg).state_dict(), cfg)
    config = {**_config(1, stage, gas=2), "train_micro_batch_size_per_gpu": 2}
    return zerostack.initialize(model=model, config=config, training_data=data)[0]


def _resume_cases(rank, world, root, cases):
    """Per case: an uninterrupted run through the engine's loader; a run that stops after SAVE
    micro-steps and saves; a fresh engine (other weights, other RNG) that loads and loops again.
    Returns the first and the last run's losses after SAVE and their final states."""
    out = {}
    data = list(zip(*batch(0, SAMPLES), strict=True))
    for i, (name, case) in enumerate(cases.items()):
        folder, nvme = os.path.join(root, f"case{i}"), os.path.join(root, "nvme")
        os.makedirs(nvme, exist_ok=True)
        runs = []
        for seed, stop in ((0, STOP), (0, SAVE), (7, STOP)):
            if case.get("pipeline"):  # train_batch() pulls 2 micro-batches (of 3 an epoch)
                engine = _pipeline_engine(seed, data[:6], case.get("stage", 1))
                if seed:  # a used engine: its own iterator must start again where the save was
                    engine.train_batch()
                    engine.load_checkpoint(folder)
                losses = []
                while engine.global_steps < stop // 2:
                    losses.append(engine.train_batch().item())
                losses = losses[-((STOP - SAVE) // 2) :]
            else:
                model = tiny_gpt(seed, cfg=DROPOUT if case.get("dropout") else TINY)
                engine, _, loader, _ = zerostack.initialize(
                    model=model, config=_case_config(case, nvme), training_data=data
                )
                if seed:
                    engine.load_checkpoint(folder)
                losses = _loop(engine, loader, stop)[-(STOP - SAVE) :]
            if stop == SAVE:
                engine.save_checkpoint(folder)
            else:
                runs.append((losses, _state(engine)))
            engine.destroy()
        out[name] = (*runs[0], *runs[1])
    return out


def _check_resume_cases(results, cases, root):
    for r in results:
        for name in cases:
            whole, want, resumed, got = r[name]
            assert resumed == whole, f"{name}: losses after resuming"  # bit for bit
            _assert_equal(got, want, name)
    for i, (name, case) in enumerate(cases.items()):
        folder = root / f"case{i}" / (root / f"case{i}" / "latest").read_text()
        manifest = json.loads((folder / "manifest.json").read_text())
        # 4 micro-batches of 2 samples on 2 ranks (or 2 stages, one dp rank), 3 an epoch
        epoch, consumed = (1, 4) if not case.get("pipeline") else (1, 2)
        sampler = {"epoch": epoch, "consumed_samples": consumed, "seed": 0}
        assert manifest["data_sampler"] == sampler, name
        if "fp16" in case and "initial_scale_power" in case["fp16"]:
            scaler, counters = manifest["loss_scaler"], manifest["counters"]
            assert scaler["cur_scale"] < 2.0**FP16_POWER, scaler  # an overflow halved it
            assert 0 < counters["skipped_steps"] < counters["global_steps"], counters


@pytest.mark.distributed
@pytest.mark.slow
def test_exact_resume_whole(tmp_path):
    """Parameters, moments, steps, loss scale and losses equal the uninterrupted run's after a
    save and a load in a fresh engine: with dropout (the RNG), after fp16 overflows (the loss
    scaler), in bf16, through a pipeline's train_batch, and the engine's loader continues with
    the first unseen micro-batch across epochs (its position is in the checkpoint)."""
    results = run_distributed(_resume_cases, 2, args=(str(tmp_path), RESUME_CASES))
    _check_resume_cases(results, RESUME_CASES, tmp_path)


@pytest.mark.distributed
@pytest.mark.slow
def test_exact_resume_with_offload(tmp_path):
    """The same with the optimizer in host memory or in files (read and written through the
    swapper), and at stage 3 the parameter pieces offloaded too (refreshed from loaded masters)."""
    results = run_distributed(_resume_cases, 2, args=(str(tmp_path), OFFLOAD_CASES))
    _check_resume_cases(results, OFFLOAD_CASES, tmp_path)


def test_sampler_order_and_position():
    """ResumableSampler yields DistributedSampler's order; its position survives a state dict,
    also onto another number of replicas, and another epoch starts from its beginning."""
    from torch.utils.data import DistributedSampler

    from zerostack.data.sampler import ResumableSampler

    data = list(range(13))
    for seed, epoch, rank in [(0, 0, 0), (0, 3, 1), (5, 1, 0)]:
        ours = ResumableSampler(data, num_replicas=2, rank=rank, seed=seed)
        theirs = DistributedSampler(data, num_replicas=2, rank=rank, seed=seed)
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        assert list(ours) == list(theirs)
    first = ResumableSampler(data, num_replicas=2, rank=1)
    first.set_epoch(2)
    order = list(first)
    it = iter(first)
    assert [next(it) for _ in range(4)] == order[:4]
    assert first.state_dict() == {"epoch": 2, "consumed_samples": 8, "seed": 0}
    again = ResumableSampler(data, num_replicas=2, rank=1)
    again.load_state_dict(first.state_dict())
    again.set_epoch(2)  # the restored epoch: the position stays
    assert list(again) == order[4:] and again.state_dict()["consumed_samples"] == 14
    assert list(again) == order  # the next pass is a whole one
    four = ResumableSampler(data, num_replicas=4, rank=3)
    four.load_state_dict(first.state_dict())  # 8 samples consumed = 2 per replica of 4
    whole = DistributedSampler(data, num_replicas=4, rank=3)
    whole.set_epoch(2)
    assert list(four) == list(whole)[2:]
    other = ResumableSampler(data, num_replicas=2, rank=1)
    other.load_state_dict(first.state_dict())
    other.set_epoch(3)  # another epoch: from its beginning
    assert len(list(other)) == 7


def _save(rank, world, stage, root, steps):
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(world, stage))
    _steps(engine, rank, world, 0, steps)
    engine.save_checkpoint(root)
    return engine.full_state_dict()


def _load_and_train(rank, world, stage, root, steps):
    engine, *_ = zerostack.initialize(model=tiny_gpt(seed=3), config=_config(world, stage))
    engine.load_checkpoint(root)
    loaded = engine.full_state_dict()
    _steps(engine, rank, world, engine.global_steps, steps)
    return loaded, engine.full_state_dict()


@pytest.mark.distributed
@pytest.mark.parametrize(
    "src,dst", [((4, 3), (2, 1)), ((2, 2), (4, 3)), ((2, 1), (1, 0)), ((1, 0), (4, 2))]
)
@pytest.mark.slow
def test_load_on_another_layout(src, dst, tmp_path):
    saved = run_distributed(_save, src[0], args=(src[1], str(tmp_path), 3))[0]
    loaded, final = run_distributed(_load_and_train, dst[0], args=(dst[1], str(tmp_path), 3))[0]
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    ref = reference_train(6, B, clip=0.5, lr=1e-3)
    # the reference has no warm-up: compare to a run of the same schedule without the reload
    again = run_distributed(_uninterrupted, dst[0], args=(dst[1], 6))[0]
    diff, name = max_rel_diff(final, again)
    assert diff <= 1e-6, f"{name}: {diff:.2e} from the uninterrupted run"
    assert max_rel_diff(final, ref)[0] > 1e-6  # (the schedule matters: the check can fail)


def _uninterrupted(rank, world, stage, steps):
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(world, stage))
    _steps(engine, rank, world, 0, steps)
    return engine.full_state_dict()


def _failing_save(rank, world, root):
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(world, 2))
    _steps(engine, rank, world, 0, 1)
    engine.save_checkpoint(root)
    _steps(engine, rank, world, 1, 1)
    from zerostack.checkpoint import shard

    real = shard.ShardWriter
    if rank == 1:  # this rank dies while writing its shard

        def broken(path, entries):
            raise OSError(f"{path}: simulated failure while writing")

        shard.ShardWriter = broken
    try:
        engine.save_checkpoint(root)
        error = None
    except CheckpointError as exc:
        error = str(exc)
    finally:
        shard.ShardWriter = real
    fresh, *_ = zerostack.initialize(model=tiny_gpt(seed=5), config=_config(world, 2))
    path, _ = fresh.load_checkpoint(root)
    return error, path, fresh.global_steps


@pytest.mark.distributed
def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path):
    for error, path, steps in run_distributed(_failing_save, 2, args=(str(tmp_path),)):
        assert "global_step2: not saved (rank 1: OSError:" in error
        assert "latest is unchanged" in error
        assert path == str(tmp_path / "global_step1") and steps == 1
    assert (tmp_path / "latest").read_text() == "global_step1"
    assert not (tmp_path / "global_step2").exists()


def _load_error(rank, world, root, model_seed=0, cfg=None):
    from zerostack.models import GPTConfig

    model = tiny_gpt(cfg=cfg) if cfg is not None else tiny_gpt(model_seed)
    engine, *_ = zerostack.initialize(model=model, config=_config(world, 1))
    try:
        engine.load_checkpoint(root)
    except CheckpointError as exc:
        return str(exc)
    del GPTConfig


@pytest.mark.distributed
@pytest.mark.slow
def test_damaged_missing_and_mismatched_checkpoints_are_named(tmp_path):
    run_distributed(_save, 2, args=(1, str(tmp_path), 1))
    folder = tmp_path / "global_step1"
    shard = folder / "rank00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # a flipped byte in the last tensor's data
    shard.write_bytes(bytes(data))
    msgs = run_distributed(_load_error, 2, args=(str(tmp_path),))
    assert msgs[0] == msgs[1] and msgs[0].startswith(f"{shard}: checksum mismatch in "), msgs
    shard.unlink()
    msgs = run_distributed(_load_error, 2, args=(str(tmp_path),))
    assert msgs == [f"{shard}: missing shard"] * 2
    from zerostack.models import GPTConfig

    run_distributed(_save, 2, args=(1, str(tmp_path), 1))
    wider = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, d_model=64, bias=False)
    msg = run_distributed(_load_error, 2, args=(str(tmp_path),), kwargs={"cfg": wider})[0]
    assert "wte.weight has shape [256, 32] in the checkpoint, [256, 64] in the model" in msg
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["params"]["extra.weight"] = [3]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    msgs = run_distributed(_load_error, 2, args=(str(tmp_path),))
    assert msgs == [f"{folder}: the checkpoint has 'extra.weight', the model does not"] * 2
    del manifest["params"]["extra.weight"]
    assert manifest["layout"] == {
        "world_size": 2,
        "dp": 2,
        "sp": 1,
        "ep": 1,
        "tp": 1,
        "pp": 1,
        "zero_stage": 1,
        "precision": "fp32",
    }


def _bad_client_state(rank, world, root):
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(world, 0))
    errors = []
    for bad in ({"fn": print}, {"x": {"__tensor__": "y"}}):
        try:
            engine.save_checkpoint(root, client_state=bad)
        except CheckpointError as exc:
            errors.append(str(exc))
    engine.save_checkpoint(root, tag="good", client_state={"t": torch.ones(3)})
    path = os.path.join(root, "good", "client_state.safetensors")
    from safetensors.torch import load_file, save_file

    save_file({"t": load_file(path)["t"] * 2}, path)  # same layout, other values
    try:
        engine.load_checkpoint(root, tag="good")
    except CheckpointError as exc:
        errors.append(str(exc))
    return errors, path


@pytest.mark.distributed
def test_client_state_is_json_and_tensors_checked(tmp_path):
    errors, path = run_distributed(_bad_client_state, 1, args=(str(tmp_path),))[0]
    assert errors[0].startswith("client_state['fn']: not JSON-serialisable or a tensor (")
    assert errors[1] == "client_state['x']: the key '__tensor__' is reserved"
    assert errors[2] == f"{path}: client_state tensor 't': checksum mismatch"
    assert len(errors) == 3


def _pickled_client_state(rank, world, root):
    from fractions import Fraction

    plain, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(world, 0))
    opted = _config(world, 0)
    opted["checkpoint"] = {"pickled_client_state": True}
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=opted)
    # "a/b" and a/b name two tensors: their keys must not collide
    state = {
        "hp": {"frac": Fraction(1, 3)},
        "ids": {1: "x"},
        "a/b": torch.ones(2),
        "a": {"b": torch.zeros(2)},
    }
    errors = []
    try:
        plain.save_checkpoint(root, tag="refused", client_state=state)
    except CheckpointError as exc:
        errors.append(str(exc))
    engine.save_checkpoint(root, tag="pickled", client_state=state)
    _, back = engine.load_checkpoint(root, tag="pickled")
    try:
        plain.load_checkpoint(root, tag="pickled")
    except CheckpointError as exc:
        errors.append(str(exc))
    path = os.path.join(root, "pickled", "client_state.pickle")
    with open(path, "r+b") as f:  # one byte changed
        head = f.read(1)
        f.seek(0)
        f.write(bytes([head[0] ^ 1]))
    try:
        engine.load_checkpoint(root, tag="pickled")
    except CheckpointError as exc:
        errors.append(str(exc))
    return errors, back, sorted(os.listdir(os.path.join(root, "pickled"))), path


@pytest.mark.distributed
def test_pickled_client_state_is_opt_in_and_verified(tmp_path):
    """What JSON cannot hold is refused by default, pickled into its own sha256-checked file when
    the config opts in, and unpickled only by a config that opts in too."""
    from fractions import Fraction

    errors, back, files, path = run_distributed(_pickled_client_state, 1, args=(str(tmp_path),))[0]
    assert errors[0] == (
        "client_state['hp/frac']: not JSON-serialisable or a tensor (Object of type Fraction is "
        "not JSON serializable); store it as JSON or tensors, or set "
        "checkpoint.pickled_client_state: true to pickle it"
    )
    assert errors[1].startswith(f"{path}: client_state holds pickled values and unpickling")
    assert errors[1].endswith(
        "set checkpoint.pickled_client_state: true to load them (only for checkpoints you trust)"
    )
    assert errors[2] == f"{path}: checksum mismatch"
    assert len(errors) == 3
    assert back["hp"]["frac"] == Fraction(1, 3) and back["ids"] == {1: "x"}
    assert torch.equal(back["a/b"], torch.ones(2)) and torch.equal(back["a"]["b"], torch.zeros(2))
    assert "client_state.pickle" in files and "client_state.safetensors" in files
    assert not (tmp_path / "refused").exists()


def _save_and_dump(rank, world, stage, root):
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(world, stage))
    _steps(engine, rank, world, 0, 2)
    engine.save_checkpoint(root)
    return engine.full_state_dict()


@pytest.mark.distributed
@pytest.mark.parametrize("bf16", [False, True])
def test_consolidate_loads_into_a_plain_model(tmp_path, bf16):
    from safetensors.torch import load_file

    from zerostack.checkpoint import consolidate

    full = run_distributed(_save_and_dump, 2, args=(3, str(tmp_path / "ckpt")))[0]
    out = consolidate(
        str(tmp_path / "ckpt"),
        str(tmp_path / "model.safetensors"),
        dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    weights = load_file(out)
    model = tiny_gpt(seed=9)
    model.load_state_dict(weights)  # strict: the tied head is there under its own name too
    for name, p in model.named_parameters():
        want = full[name].to(torch.bfloat16).float() if bf16 else full[name]
        assert torch.equal(p.detach(), want), name
    x, _ = batch(0, 2)
    reference = tiny_gpt(seed=9)
    reference.load_state_dict({k: v.float() for k, v in weights.items()})
    assert torch.equal(model(x), reference(x))
    if not bf16:  # the plain model computes what the trained engine's weights compute
        engine_model = tiny_gpt(seed=9)
        engine_model.load_state_dict({**full, "head.weight": full["wte.weight"]})
        assert torch.equal(model(x), engine_model(x))


# ------------------------------------------------------------------------ tp and pp layouts
def _tp_cfg():
    from zerostack.models import GPTConfig

    return GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, d_model=32, bias=False)


def _tp_save(rank, world, root):
    topo = zerostack.Topology.build(tp=2)
    torch.manual_seed(0)
    model = zerostack.models.GPT(_tp_cfg(), topology=topo)
    engine, *_ = zerostack.initialize(model=model, topology=topo, config=_config(world // 2, 1))
    per = B // topo.dp
    for step in range(3):
        x, y = batch(step, B)
        lo = topo.dp_rank * per
        engine.backward(engine(x[lo : lo + per], y[lo : lo + per]))
        engine.step()
    engine.save_checkpoint(root)
    return engine.full_state_dict()


def _plain_load(rank, world, stage, root, steps):
    engine, *_ = zerostack.initialize(
        model=tiny_gpt(seed=4, cfg=_tp_cfg()), config=_config(world, stage)
    )
    engine.load_checkpoint(root)
    loaded = engine.full_state_dict()
    _steps(engine, rank, world, 3, steps)
    return loaded, engine.full_state_dict()


def _plain_uninterrupted(rank, world, stage):
    engine, *_ = zerostack.initialize(model=tiny_gpt(cfg=_tp_cfg()), config=_config(world, stage))
    _steps(engine, rank, world, 0, 6)
    return engine.full_state_dict()


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_parallel_checkpoint_loads_on_data_parallel(tmp_path):
    """tp2 x dp2 (ZeRO 1) -> dp4 (ZeRO 3): tp slices are joined through the full parameter."""
    saved = run_distributed(_tp_save, 4, args=(str(tmp_path),))[0]
    loaded, final = run_distributed(_plain_load, 4, args=(3, str(tmp_path), 3))[0]
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    again = run_distributed(_plain_uninterrupted, 4, args=(3,))[0]
    diff, name = max_rel_diff(final, again)
    assert diff <= 1e-6, f"{name}: {diff:.2e} from the uninterrupted run"


def _pipe(rank, world, pp, tp, root, load, save, steps, first_step, stage=1):
    from zerostack.models.gpt_pipe import GPTLoss, gpt_layers, load_plain_state, plain_name
    from zerostack.pipeline import PipelineModule

    cfg = _tp_cfg()
    topo = zerostack.Topology.build(pp=pp, tp=tp)
    model = PipelineModule(
        gpt_layers(cfg, topology=topo),
        topology=topo,
        loss_fn=GPTLoss(topo),
        partition_method="type:Block",
    )
    load_plain_state(model, tiny_gpt(seed=0 if not load else 6, cfg=cfg).state_dict(), cfg)
    gas = 2
    micro = B // (topo.dp * gas)
    config = {
        **_config(topo.dp, stage),
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
    }
    engine, *_ = zerostack.initialize(model=model, config=config)
    if load:
        engine.load_checkpoint(root)
    loaded = {plain_name(k, cfg): v for k, v in engine.full_state_dict().items()}

    def data(step):
        x, y = batch(step, B)
        for m in range(gas):
            lo = (m * topo.dp + topo.dp_rank) * micro
            yield x[lo : lo + micro], y[lo : lo + micro]

    for step in range(first_step, first_step + steps):
        engine.train_batch(data(step))
    if save:
        engine.save_checkpoint(root)
    final = {plain_name(k, cfg): v for k, v in engine.full_state_dict().items()}
    return loaded, final, topo.rank("pp")


def _merge(results, which):
    out = {}
    for r in sorted(results, key=lambda r: r[2]):
        for k, v in r[which].items():
            out.setdefault(k, v)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.slow
def test_pipeline_checkpoints_change_layout(tmp_path, stage):
    """pp2 x dp2 -> tp2 x pp2 -> one rank, at ZeRO 1 and 3: the tied embedding is written once
    (by the first stage), read by both holders, and tp slices are cut from the saved full
    weights."""
    a = run_distributed(_pipe, 4, args=(2, 1, str(tmp_path / "a"), False, True, 2, 0, stage))
    b = run_distributed(_pipe, 4, args=(2, 2, str(tmp_path / "a"), True, True, 2, 2, stage))
    assert all(torch.equal(_merge(b, 0)[k], v) for k, v in _merge(a, 1).items())
    c = run_distributed(_pipe, 1, args=(1, 1, str(tmp_path / "a"), True, False, 0, 4, stage))
    assert all(torch.equal(_merge(c, 0)[k], v) for k, v in _merge(b, 1).items())
    # and the tied weight's two copies agreed when saved
    last = [r for r in b if r[2] == 1][0][1]
    assert torch.equal(last["wte.weight"], _merge(b, 1)["wte.weight"])


@pytest.mark.distributed
def test_consolidate_joins_tensor_parallel_slices(tmp_path):
    from safetensors.torch import load_file

    from zerostack.checkpoint import consolidate

    saved = run_distributed(_tp_save, 4, args=(str(tmp_path / "ckpt"),))[0]
    weights = load_file(consolidate(str(tmp_path / "ckpt"), str(tmp_path / "m.safetensors")))
    model = tiny_gpt(seed=9, cfg=_tp_cfg())
    model.load_state_dict(weights)
    assert all(torch.equal(p.detach(), saved[n]) for n, p in model.named_parameters())
