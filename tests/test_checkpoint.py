"""Checkpoints: exact resume, another ZeRO stage / dp / tp / pp layout on load, nothing lost on a
failed save.

Exact resume is bit for bit: the fp32 masters, the Adam moments and steps, the loss scaler and the
counters come back exactly, so the losses after resuming are the uninterrupted run's. After a
layout change the parameters right after loading are the saved ones, bit for bit, and 3 more
steps end within 1e-6 of the uninterrupted run on the new layout (only the order of sums differs
between layouts), which fails loudly if the moments were not carried over.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from common import batch, max_rel_diff, reference_train, tiny_gpt
from distributed import run_distributed

import zerostack
from zerostack.checkpoint import CheckpointError

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


def _resume(rank, world, stage, root, gas, fp16):
    cfg = _config(world, stage, gas, fp16)
    whole, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
    uninterrupted = _steps(whole, rank, world, 0, 6)[3 * gas :]
    first, *_ = zerostack.initialize(model=tiny_gpt(), config=cfg)
    _steps(first, rank, world, 0, 3)
    first.save_checkpoint(root, client_state={"epoch": 1, "note": "three steps"})
    second, *_ = zerostack.initialize(model=tiny_gpt(seed=7), config=cfg)  # other weights
    path, client = second.load_checkpoint(root)
    resumed = _steps(second, rank, world, 3, 3)
    return uninterrupted, resumed, client, second.global_steps, second.loss_scale, path


@pytest.mark.parametrize(
    "stage,gas,fp16", [(0, 1, False), (1, 2, False), (2, 1, True), (3, 2, False), (3, 1, True)]
)
def test_exact_resume(stage, gas, fp16, tmp_path):
    for whole, resumed, client, steps, _, path in run_distributed(
        _resume, 2, args=(stage, str(tmp_path), gas, fp16)
    ):
        assert resumed == whole  # bit for bit
        assert client == {"epoch": 1, "note": "three steps"} and steps == 6
        assert path == str(tmp_path / "global_step3")
    assert (tmp_path / "latest").read_text() == "global_step3"
    assert sorted(os.listdir(tmp_path / "global_step3")) == [
        "manifest.json",
        "rank00000.safetensors",
        "rank00001.safetensors",
    ]


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


@pytest.mark.parametrize(
    "src,dst", [((4, 3), (2, 1)), ((2, 2), (4, 3)), ((2, 1), (1, 0)), ((1, 0), (4, 2))]
)
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
    from zerostack.checkpoint import state

    real = state.save_file
    if rank == 1:  # this rank dies while writing its shard

        def broken(tensors, path):
            raise OSError(f"{path}: simulated failure while writing")

        state.save_file = broken
    try:
        engine.save_checkpoint(root)
        error = None
    except CheckpointError as exc:
        error = str(exc)
    finally:
        state.save_file = real
    fresh, *_ = zerostack.initialize(model=tiny_gpt(seed=5), config=_config(world, 2))
    path, _ = fresh.load_checkpoint(root)
    return error, path, fresh.global_steps


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
        "tp": 1,
        "pp": 1,
        "zero_stage": 1,
        "precision": "fp32",
    }


def _bad_client_state(rank, world, root):
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(world, 0))
    try:
        engine.save_checkpoint(root, client_state={"fn": print})
    except CheckpointError as exc:
        return str(exc)


def test_client_state_must_be_json(tmp_path):
    msg = run_distributed(_bad_client_state, 1, args=(str(tmp_path),))[0]
    assert msg.startswith("client_state: not JSON-serialisable")


def _save_and_dump(rank, world, stage, root):
    engine, *_ = zerostack.initialize(model=tiny_gpt(), config=_config(world, stage))
    _steps(engine, rank, world, 0, 2)
    engine.save_checkpoint(root)
    return engine.full_state_dict()


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


def test_tensor_parallel_checkpoint_loads_on_data_parallel(tmp_path):
    """tp2 x dp2 (ZeRO 1) -> dp4 (ZeRO 3): tp slices are joined through the full parameter."""
    saved = run_distributed(_tp_save, 4, args=(str(tmp_path),))[0]
    loaded, final = run_distributed(_plain_load, 4, args=(3, str(tmp_path), 3))[0]
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    again = run_distributed(_plain_uninterrupted, 4, args=(3,))[0]
    diff, name = max_rel_diff(final, again)
    assert diff <= 1e-6, f"{name}: {diff:.2e} from the uninterrupted run"


def _pipe(rank, world, pp, tp, root, load, save, steps, first_step):
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
        **_config(topo.dp, 1),
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


def test_pipeline_checkpoints_change_layout(tmp_path):
    """pp2 x dp2 (ZeRO 1) -> tp2 x pp2 -> one rank: the tied embedding is written once (by the
    first stage), read by both holders, and tp slices are cut from the saved full weights."""
    a = run_distributed(_pipe, 4, args=(2, 1, str(tmp_path / "a"), False, True, 2, 0))
    b = run_distributed(_pipe, 4, args=(2, 2, str(tmp_path / "a"), True, True, 2, 2))
    assert all(torch.equal(_merge(b, 0)[k], v) for k, v in _merge(a, 1).items())
    c = run_distributed(_pipe, 1, args=(1, 1, str(tmp_path / "a"), True, False, 0, 4))
    assert all(torch.equal(_merge(c, 0)[k], v) for k, v in _merge(b, 1).items())
    # and the tied weight's two copies agreed when saved
    last = [r for r in b if r[2] == 1][0][1]
    assert torch.equal(last["wte.weight"], _merge(b, 1)["wte.weight"])


def test_consolidate_joins_tensor_parallel_slices(tmp_path):
    from safetensors.torch import load_file

    from zerostack.checkpoint import consolidate

    saved = run_distributed(_tp_save, 4, args=(str(tmp_path / "ckpt"),))[0]
    weights = load_file(consolidate(str(tmp_path / "ckpt"), str(tmp_path / "m.safetensors")))
    model = tiny_gpt(seed=9, cfg=_tp_cfg())
    model.load_state_dict(weights)
    assert all(torch.equal(p.detach(), saved[n]) for n, p in model.named_parameters())
