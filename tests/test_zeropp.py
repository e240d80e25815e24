"""ZeRO++ quantized weights (qwZ, ``zero_quantized_weights``): the int8 block quantizer's error
bound, training on two gloo ranks against a single-process run that computes at the quantized
weights the same spec describes (written here, apart from zerostack.zero.stage3.quantize), the bytes
the all-gathers put on the wire (counted by gloo's side of the CommLog: the tensors handed to
the collective), and the config's refusals."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import zerostack
from zerostack.config import ConfigError, load_config
from zerostack.zero.stage3 import quantize as qz

from tests.support.models import TINY, batch, max_rel_diff, tiny_gpt
from tests.support.ranks import run_distributed

STEPS, GLOBAL_BATCH, LR = 3, 4, 0.5
TOL = 1e-5  # fp32, the two ranks' gradients summed in another order than one process's


SPEC_BLOCK = 32  # elements per scale, as zerostack.zero.stage3.quantize.BLOCK must be


def spec_round_trip(piece: torch.Tensor, block: int = SPEC_BLOCK, top: int = 127) -> torch.Tensor:
    """The qwZ spec, element by element: blocks of ``block`` from the piece's start, scale the
    block's largest magnitude / ``top`` (127 at 8 bits, 7 at 4), values rounded to the nearest
    step (half to even)."""
    x = piece.double().reshape(-1)
    out = torch.empty_like(x)
    for lo in range(0, x.numel(), block):
        b = x[lo : lo + block]
        scale = float(torch.tensor(float(b.abs().max().float()) / top, dtype=torch.float32))
        scale = bf16_ceiling(scale)  # as the payload carries it
        if scale == 0:
            out[lo : lo + block] = 0
        else:
            q = torch.round((b.float() / torch.tensor(scale, dtype=torch.float32)).double())
            out[lo : lo + block] = q.clamp(-top, top) * scale
    return out.to(piece.dtype).view(piece.shape)


def bf16_ceiling(v: float) -> float:
    """The smallest bf16 value >= ``v`` >= 0 (8 significant bits)."""
    if v == 0:
        return 0.0
    _, e = math.frexp(v)  # v = m * 2**e, 0.5 <= m < 1
    quantum = 2.0 ** (e - 8)
    return math.ceil(v / quantum) * quantum


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """One piece through a payload and back, as one rank of one."""
    return qz.unpack(qz.pack([x])[None], [x.numel()], torch.float32)[0][0]


@pytest.mark.parametrize("numel", [1, 31, 32, 33, 1000])
@pytest.mark.parametrize("magnitude", [1e-30, 1.0, 1e6])
def test_a_round_trip_is_within_half_a_step_of_the_block_scale(numel, magnitude):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * magnitude
    y = round_trip(x)
    for lo in range(0, numel, SPEC_BLOCK):
        absmax = float(x[lo : lo + SPEC_BLOCK].abs().max())
        err = float((y[lo : lo + SPEC_BLOCK] - x[lo : lo + SPEC_BLOCK]).abs().max())
        # half a step (of a scale rounded up to bf16), plus the fp32 roundings
        assert err <= absmax / 254 * (1 + 2**-7) + absmax * 2**-22, (lo, err, absmax)
    assert torch.equal(y, spec_round_trip(x))


def test_the_grid_of_the_steps_comes_back_exactly_and_zero_blocks_stay_zero():
    steps = (torch.arange(-127, 128, dtype=torch.float32) * 0.5)[:248].view(8, 31)
    blocks = torch.cat([torch.full((8, 1), 63.5), steps], dim=1)  # absmax 63.5: a step of 0.5
    x = torch.cat([blocks.reshape(-1), torch.zeros(300)])  # 8 blocks of steps, then zeros
    assert torch.equal(round_trip(x), x)


def test_a_payload_holds_every_piece_and_its_size_is_the_formula():
    g = torch.Generator().manual_seed(1)
    pieces = [torch.randn(n, generator=g) for n in (300, 17, 5, 257)]
    numels = [p.numel() for p in pieces]
    one, two = qz.pack(pieces), qz.pack([2 * p for p in pieces])
    # 2 bytes per block scale (10 + 1 + 1 + 9 blocks), 1 per value, padded to 2
    assert one.numel() == qz.payload_bytes(numels) == 2 * 21 + 579 + 1
    rows = torch.stack([one, two])
    for p, got in zip(pieces, qz.unpack(rows, numels, torch.float32), strict=True):
        assert got.shape == (2, p.numel())
        assert torch.equal(got[0], spec_round_trip(p))
        assert torch.equal(got[1], spec_round_trip(2 * p))
    bf16 = qz.unpack(rows, numels, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in bf16)


def quantized_pieces(t: torch.Tensor, dp: int, top: int = 127) -> torch.Tensor:
    """``t`` as stage 3 at ``dp`` ranks cuts it, padded into ``dp`` equal pieces, each piece
    round-tripped on its own (values up to ``top``)."""
    flat = t.detach().reshape(-1)
    width = -(-flat.numel() // dp)
    padded = torch.zeros(width * dp)
    padded[: flat.numel()] = flat
    pieces = [spec_round_trip(padded[r * width : (r + 1) * width], top=top) for r in range(dp)]
    return torch.cat(pieces)[: flat.numel()].view(t.shape)


def quantized_weights(model: torch.nn.Module, dp: int) -> dict[str, torch.Tensor]:
    """Each parameter as stage 3 at ``dp`` ranks computes with it under qwZ."""
    return {name: quantized_pieces(p, dp) for name, p in model.named_parameters()}


def quantized_reference(steps: int, weights: bool = True, grads: bool = False, top: int = 127):
    """One process, plain SGD on the whole batch, as qwZ (``weights``) and qgZ (``grads``) at
    dp 2 must train: each rank's gradient taken at the (quantized) weights on its half of the
    batch, its pieces round-tripped (qgZ), the two summed in rank order and halved, applied to
    the exact weights."""
    model = tiny_gpt()
    shadow = tiny_gpt()
    for step in range(steps):
        with torch.no_grad():
            used = quantized_weights(model, 2) if weights else dict(model.named_parameters())
            for name, value in used.items():
                shadow.get_parameter(name).copy_(value)
        x, y = batch(step, GLOBAL_BATCH)
        half = GLOBAL_BATCH // 2
        per_rank = []
        for r in range(2):
            shadow.zero_grad(set_to_none=True)
            shadow(x[r * half : (r + 1) * half], y[r * half : (r + 1) * half]).backward()
            per_rank.append({n: p.grad.clone() for n, p in shadow.named_parameters()})
        with torch.no_grad():
            for name, p in model.named_parameters():
                g0, g1 = per_rank[0][name], per_rank[1][name]
                if grads:
                    g0, g1 = quantized_pieces(g0, 2, top), quantized_pieces(g1, 2, top)
                p -= LR * ((g0 + g1) * 0.5)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _train(
    rank,
    world,
    quantized: bool,
    steps: int,
    grads: bool = False,
    hpz: int = 1,
    offload=None,
    bits: int = 8,
):
    """Stage 3 at dp 2, plain SGD; the final weights and, for the last step, the bytes of each
    parameter all-gather as the CommLog has them and as handed to torch.distributed.
    ``offload``: "cpu" puts the parameter pieces (and the optimizer) in host memory."""
    import zerostack.comm.grid as grid

    handed = []
    exchange = grid.dist.batch_isend_irecv

    def counting(ops):  # over gloo an all-gather posts its sends and receives in one batch
        sent = [op.tensor for op in ops if op.op is dist.isend]
        received = [op.tensor for op in ops if op.op is dist.irecv]
        # this rank's rows (its inputs, each sent to every peer) and the rows it receives
        own = list({id(t): t for t in sent}.values())
        handed.append(sum(t.numel() * t.element_size() for t in own + received))
        return exchange(ops)

    grid.dist.batch_isend_irecv = counting
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {
            "stage": 3,
            "zero_quantized_weights": quantized,
            "zero_quantized_gradients": grads,
            "zero_hpz_partition_size": hpz,
            **({"zero_quantized_gradients_bits": bits} if bits != 8 else {}),
            "stage3_param_persistence_threshold": 0,  # every parameter is gathered each pass
        },
    }
    if offload:
        config["zero_optimization"]["offload_param"] = {"device": offload, "pin_memory": True}
        config["zero_optimization"]["offload_optimizer"] = {"device": offload}
    engine = zerostack.initialize(model=tiny_gpt(), config=config)[0]
    log = engine.comm.log
    for step in range(steps):
        x, y = batch(step, GLOBAL_BATCH)
        rows = slice(rank * x.shape[0] // world, (rank + 1) * x.shape[0] // world)
        first, handed[:] = len(log.records), []
        engine.backward(engine(x[rows], y[rows]))
        engine.step()
        # hpZ's secondary pieces are memory for one forward and backward, not beyond
        held = [n for n, p in engine.module.named_parameters() if p._zs.secondary is not None]
        assert not held, f"secondary pieces outlive the step: {held}"
    logged = [r.bytes for r in log.records[first:] if r.op == "all_gather"]
    step_handed = list(handed)
    moved = {}  # one step's bytes per op (and axis, with the group's size), from the CommLog
    for r in log.records[first:]:
        key = r.op if r.axis == "dp" else f"{r.op}@{r.axis}/{r.ranks}"
        moved[key] = moved.get(key, 0) + r.bytes
    return engine.full_state_dict(), logged, step_handed, moved


@pytest.fixture(scope="module")
def runs():
    plain = run_distributed(_train, world=2, args=(False, STEPS))
    quantized = run_distributed(_train, world=2, args=(True, STEPS))
    return plain, quantized


def trains_as(results, want, what: str, plain=None) -> None:
    """Every rank's final weights within TOL of the reference ``want``; and, the quantization
    being real, plain stage 3's far from it."""
    for weights, *_ in results:
        worst, name = max_rel_diff(weights, want)
        print(f"{what}: {worst:.1e} from the reference")
        assert worst < TOL, f"{name}: {worst:.2e} from the {what} reference"
    if plain is not None:
        worst, _ = max_rel_diff(plain[0][0], want)
        assert worst > 100 * TOL, f"plain stage 3 is within {worst:.2e} of the {what} reference"


@pytest.mark.distributed
def test_qwz_trains_at_the_quantized_weights_and_keeps_exact_masters(runs):
    plain, quantized = runs
    trains_as(quantized, quantized_reference(STEPS), "qwZ", plain)


@pytest.mark.distributed
def test_qwz_gathers_under_a_third_of_the_bytes(runs):
    """One step's parameter all-gathers (forward and backward): as many as plain stage 3's, each
    of int8 blocks, 3.76x fewer bytes than fp32 in all; the CommLog counts what torch got."""
    plain, quantized = runs
    (_, plain_logged, plain_handed, _), (_, quant_logged, quant_handed, _) = plain[0], quantized[0]
    assert plain_logged == plain_handed and quant_logged == quant_handed
    assert plain_handed and len(plain_handed) == len(quant_handed)
    ratio = sum(plain_handed) / sum(quant_handed)
    assert 3.5 <= ratio < 4.0, f"fp32 / int8 gather bytes {ratio:.2f}"
    print(f"qwZ: {sum(plain_handed)} -> {sum(quant_handed)} bytes gathered a step ({ratio:.2f}x)")


@pytest.mark.distributed
def test_qgz_trains_at_the_quantized_gradients_and_moves_under_a_third_of_the_bytes(runs):
    """qgZ alone: each rank's gradient pieces round-tripped before the sum (the reference), an
    all-to-all instead of the reduce-scatter, 3.76x fewer bytes than fp32's."""
    plain, _ = runs
    results = run_distributed(_train, world=2, args=(False, STEPS, True))
    trains_as(results, quantized_reference(STEPS, weights=False, grads=True), "qgZ", plain)
    plain_moved, moved = plain[0][3], results[0][3]
    assert "all_to_all" not in plain_moved and "reduce_scatter" not in moved
    ratio = plain_moved["reduce_scatter"] / moved["all_to_all"]
    assert 3.5 <= ratio < 4.0, f"fp32 / int8 gradient bytes {ratio:.2f}"
    print(f"qgZ: {plain_moved['reduce_scatter']} -> {moved['all_to_all']} bytes a step")


@pytest.mark.distributed
def test_int4_qgz_trains_at_its_coarser_gradients_and_moves_seven_times_fewer_bytes(runs):
    """``zero_quantized_gradients_bits: 4``: each rank's pieces round-tripped through values
    -7 .. 7 (the reference), two to a byte: 7.11x fewer bytes than fp32's reduce-scatter."""
    plain, _ = runs
    results = run_distributed(_train, world=2, args=(False, STEPS, True, 1, None, 4))
    want = quantized_reference(STEPS, weights=False, grads=True, top=7)
    trains_as(results, want, "int4 qgZ", plain)
    int8 = quantized_reference(STEPS, weights=False, grads=True)
    assert max_rel_diff(results[0][0], int8)[0] > 100 * TOL  # not the int8 run
    plain_moved, moved = plain[0][3], results[0][3]
    ratio = plain_moved["reduce_scatter"] / moved["all_to_all"]
    assert 6.5 <= ratio < 7.2, f"fp32 / int4 gradient bytes {ratio:.2f}"
    print(f"int4 qgZ: {plain_moved['reduce_scatter']} -> {moved['all_to_all']} bytes a step")


@pytest.mark.parametrize("numel", [1, 31, 32, 33, 1000])
def test_an_int4_round_trip_is_within_half_a_step_of_the_block_scale(numel):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g)
    y = qz.unpack(qz.pack([x], bits=4)[None], [numel], torch.float32, bits=4)[0][0]
    for lo in range(0, numel, SPEC_BLOCK):
        absmax = float(x[lo : lo + SPEC_BLOCK].abs().max())
        err = float((y[lo : lo + SPEC_BLOCK] - x[lo : lo + SPEC_BLOCK]).abs().max())
        assert err <= absmax / 14 * (1 + 2**-7) + absmax * 2**-22, (lo, err, absmax)
    assert torch.equal(y, spec_round_trip(x, top=7))


def test_an_int4_payload_holds_two_values_to_a_byte():
    """The wire format: the scales, then each piece's values as value + 8, element 2i in the low
    nibble of its byte and 2i + 1 in the high one; an odd piece ends in a half byte."""
    steps = torch.arange(-7, 8, dtype=torch.float32)  # absmax 7: a scale of exactly 1
    pieces = [steps, torch.tensor([4.0, 3.0, 2.5, 1.0])]
    payload = qz.pack(pieces, bits=4)
    assert payload.numel() == qz.payload_bytes([15, 4], bits=4) == 2 * 2 + 8 + 2
    step = 147 / 256  # 4 / 7 = 0.5714..., rounded up to 8 significant bits
    assert payload[:4].view(torch.bfloat16).tolist() == [1.0, step]
    nibbles = [v + 8 for v in range(-7, 8)] + [8]  # the lone last value, then a zero
    want = [lo | hi << 4 for lo, hi in zip(nibbles[0::2], nibbles[1::2], strict=True)]
    assert payload[4:12].tolist() == want
    # 4, 3, 2.5, 1 in steps of 0.574: 6.97, 5.22, 4.35, 1.74 -> 7, 5, 4, 2
    assert payload[12:14].tolist() == [(7 + 8) | (5 + 8) << 4, (4 + 8) | (2 + 8) << 4]
    got = qz.unpack(payload[None], [15, 4], torch.float32, bits=4)
    assert torch.equal(got[0][0], steps)
    assert got[1][0].tolist() == [7 * step, 5 * step, 4 * step, 2 * step]
    with pytest.raises(ValueError, match="quantized values are 8 or 4 bits, not 2"):
        qz.pack(pieces, bits=2)


@pytest.mark.distributed
def test_qwz_and_qgz_together_train_as_the_reference_with_both():
    results = run_distributed(_train, world=2, args=(True, STEPS, True))
    trains_as(results, quantized_reference(STEPS, weights=True, grads=True), "qwZ + qgZ")


@pytest.mark.distributed
@pytest.mark.parametrize(
    "quantized,offload", [(False, None), (True, None), (False, "cpu")], ids=["plain", "qwz", "cpu"]
)
@pytest.mark.slow
def test_hpz_gathers_the_backward_within_pairs_and_changes_no_bit(quantized, offload):
    """dp 4 with zero_hpz_partition_size 2: the forward gathers over dp, the backward within
    pairs of neighbours from the pieces the forward left (the same values, dequantized ones
    under qwZ), so the weights are those of stage 3 without hpZ, bit for bit; with the
    parameters offloaded too."""
    without = run_distributed(_train, world=4, args=(quantized, STEPS, False, 1, offload))
    results = run_distributed(_train, world=4, args=(quantized, STEPS, False, 2, offload))
    for (want, *_), (got, _, handed, moved) in zip(without, results, strict=True):
        assert want.keys() == got.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k
        plain_moved = without[0][3]
        # as many gathers' bytes as stage 3 without hpZ; the backward's in pairs
        assert moved["all_gather@hpz/2"] > 0 and "all_gather@hpz/2" not in plain_moved
        assert moved["all_gather"] < plain_moved["all_gather"]
        assert len(handed) == len(without[0][2])


def _refused_hpz(rank, world):
    try:
        _train(rank, world, False, 1, False, 3)
    except ConfigError as e:
        return str(e)


@pytest.mark.distributed
def test_an_hpz_size_that_does_not_divide_dp_is_refused_at_initialize():
    for message in run_distributed(_refused_hpz, world=2):
        assert message == (
            "zero_optimization.zero_hpz_partition_size: 3 does not divide the data-parallel size 2"
        )


def test_zeropp_is_refused_outside_stage_3():
    with pytest.raises(ConfigError, match="zero_quantized_weights: quantizes stage 3"):
        load_config({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}})
    with pytest.raises(ConfigError, match="zero_quantized_gradients: quantizes stage 3's"):
        load_config({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}})
    with pytest.raises(ConfigError, match="zero_hpz_partition_size: partitions stage 3's"):
        load_config({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}})
    with pytest.raises(ConfigError, match="zero_quantized_gradients_bits: sets the width"):
        load_config({"zero_optimization": {"stage": 3, "zero_quantized_gradients_bits": 4}})
    with pytest.raises(ConfigError, match="zero_quantized_gradients_bits: must be 8 or 4"):
        zero = {"stage": 3, "zero_quantized_gradients": True, "zero_quantized_gradients_bits": 2}
        load_config({"zero_optimization": zero})
    assert load_config({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}})


def test_tiny_has_parameters_of_several_blocks():
    """The parity above covers pieces longer than one block and pieces shorter than one."""
    widths = {-(-p.numel() // 2) for p in tiny_gpt().parameters()}
    assert max(widths) > SPEC_BLOCK and min(widths) < SPEC_BLOCK, (TINY, sorted(widths))
