"""Tensor-parallel layers and region functions against the unsplit torch layers, at tp = 2 and 4.

Every check builds the plain layer and the split one from the same seed, feeds both the same
input and the same upstream gradient, and compares outputs, input gradients and (sliced) weight
gradients. Tolerance 1e-6 relative: a split layer sums the same products in another grouping
(partial sums added by the all-reduce), ~1e-7 relative in fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerostack import Topology
from zerostack.comm.grid import comm_for
from zerostack.tensor_parallel import (
    SEQ_DIM,
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    VocabParallelEmbedding,
    gather_from_sp,
    gather_from_tp,
    join_tensors,
    reduce_scatter_to_sp,
    scatter_to_sp,
    scatter_to_tp,
    split_tensor,
    vocab_parallel_cross_entropy,
)

from tests.support.ranks import run_distributed

TOL = 1e-6
B, S, D_IN, D_OUT = 2, 8, 16, 24


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _close(name: str, a: torch.Tensor, b: torch.Tensor, failures: list[str]) -> None:
    if a.shape != b.shape:
        failures.append(f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}")
    elif _rel(a, b) > TOL:
        failures.append(f"{name}: relative difference {_rel(a, b):.2e}")


def _inputs(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _part(t: torch.Tensor, topo: Topology, dim: int, chunks: int = 1) -> torch.Tensor:
    return split_tensor(t, parts=topo.tp, rank=topo.rank("tp"), dim=dim, chunks=chunks)


def _column(topo, failures, *, gather_output, chunks=1, sequence_parallel=False):
    torch.manual_seed(3)
    ref = nn.Linear(D_IN, D_OUT)
    torch.manual_seed(3)
    layer = ColumnParallelLinear(
        D_IN,
        D_OUT,
        topology=topo,
        gather_output=gather_output,
        chunks=chunks,
        sequence_parallel=sequence_parallel,
    )
    tag = f"column(gather={gather_output}, chunks={chunks}, sp={sequence_parallel})"
    _close(
        f"{tag} weight",
        layer.weight.detach(),
        _part(ref.weight.detach(), topo, 0, chunks),
        failures,
    )
    x = _inputs(B, S, D_IN, seed=1).requires_grad_()
    gy = _inputs(B, S, D_OUT, seed=2)
    y_ref = ref(x)
    y_ref.backward(gy)
    xin = x.detach()
    if sequence_parallel:
        xin = _part(xin, topo, SEQ_DIM)
    xin.requires_grad_()
    y = layer(xin)
    if gather_output:
        _close(f"{tag} output", y.detach(), y_ref.detach(), failures)
        y.backward(gy)
    else:
        _close(f"{tag} output", y.detach(), _part(y_ref.detach(), topo, -1, chunks), failures)
        y.backward(_part(gy, topo, -1, chunks))
    want_gx = x.grad if not sequence_parallel else _part(x.grad, topo, SEQ_DIM)
    _close(f"{tag} input grad", xin.grad, want_gx, failures)
    _close(
        f"{tag} weight grad", layer.weight.grad, _part(ref.weight.grad, topo, 0, chunks), failures
    )
    _close(f"{tag} bias grad", layer.bias.grad, _part(ref.bias.grad, topo, 0, chunks), failures)


def _row(topo, failures, *, input_is_parallel, sequence_parallel=False):
    torch.manual_seed(4)
    ref = nn.Linear(D_OUT, D_IN)
    torch.manual_seed(4)
    layer = RowParallelLinear(
        D_OUT,
        D_IN,
        topology=topo,
        input_is_parallel=input_is_parallel,
        sequence_parallel=sequence_parallel,
    )
    tag = f"row(parallel_input={input_is_parallel}, sp={sequence_parallel})"
    x = _inputs(B, S, D_OUT, seed=5).requires_grad_()
    gy = _inputs(B, S, D_IN, seed=6)
    y_ref = ref(x)
    y_ref.backward(gy)
    xin = _part(x.detach(), topo, -1) if input_is_parallel else x.detach().clone()
    xin.requires_grad_()
    y = layer(xin)
    if sequence_parallel:
        _close(f"{tag} output", y.detach(), _part(y_ref.detach(), topo, SEQ_DIM), failures)
        y.backward(_part(gy, topo, SEQ_DIM))
    else:
        _close(f"{tag} output", y.detach(), y_ref.detach(), failures)
        y.backward(gy)
    want_gx = _part(x.grad, topo, -1) if input_is_parallel else x.grad
    _close(f"{tag} input grad", xin.grad, want_gx, failures)
    _close(f"{tag} weight grad", layer.weight.grad, _part(ref.weight.grad, topo, 1), failures)
    _close(f"{tag} bias grad", layer.bias.grad, ref.bias.grad, failures)


def _embedding(topo, failures, *, sequence_parallel=False):
    vocab = 8 * topo.tp
    torch.manual_seed(5)
    ref = nn.Embedding(vocab, D_IN)
    torch.manual_seed(5)
    layer = VocabParallelEmbedding(vocab, D_IN, topology=topo, sequence_parallel=sequence_parallel)
    tag = f"embedding(sp={sequence_parallel})"
    idx = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(7))
    gy = _inputs(B, S, D_IN, seed=8)
    y_ref = ref(idx)
    y_ref.backward(gy)
    y = layer(idx)
    if sequence_parallel:
        _close(f"{tag} output", y.detach(), _part(y_ref.detach(), topo, SEQ_DIM), failures)
        y.backward(_part(gy, topo, SEQ_DIM))
    else:
        _close(f"{tag} output", y.detach(), y_ref.detach(), failures)
        y.backward(gy)
    _close(f"{tag} weight grad", layer.weight.grad, _part(ref.weight.grad, topo, 0), failures)


def _cross_entropy(topo, failures):
    vocab = 16 * topo.tp
    logits = _inputs(B, S, vocab, seed=9).requires_grad_()
    targets = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(10))
    ref = F.cross_entropy(logits.view(-1, vocab), targets.view(-1), reduction="none").view(B, S)
    gy = _inputs(B, S, seed=11).abs()
    ref.backward(gy)
    local = _part(logits.detach(), topo, -1).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, comm_for(topo))
    _close("cross entropy loss", loss.detach(), ref.detach(), failures)
    loss.backward(gy)
    _close("cross entropy grad", local.grad, _part(logits.grad, topo, -1), failures)


def _layer_norm(topo, failures):
    torch.manual_seed(12)
    ref = nn.LayerNorm(D_IN)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    layer = SequenceParallelLayerNorm.from_layer_norm(ref, topology=topo)
    x = _inputs(B, S, D_IN, seed=13).requires_grad_()
    gy = _inputs(B, S, D_IN, seed=14)
    ref(x).backward(gy)
    xs = _part(x.detach(), topo, SEQ_DIM).requires_grad_()
    y = layer(xs)
    y.backward(_part(gy, topo, SEQ_DIM))
    _close("sp layer norm input grad", xs.grad, _part(x.grad, topo, SEQ_DIM), failures)
    _close("sp layer norm weight grad", layer.weight.grad, ref.weight.grad, failures)
    _close("sp layer norm bias grad", layer.bias.grad, ref.bias.grad, failures)


def _mappings(topo, failures):
    """The region functions alone: forward values and the gradients autograd gets through them."""
    comm = comm_for(topo)
    x = _inputs(B, S, D_OUT, seed=15)
    g = _inputs(B, S, D_OUT, seed=16)
    # scatter then gather along the features (and along the sequence) is the identity both ways
    for scatter, gather, dim in (
        (scatter_to_tp, gather_from_tp, -1),
        (scatter_to_sp, gather_from_sp, SEQ_DIM),
    ):
        xi = x.clone().requires_grad_()
        part = scatter(xi, comm)
        _close(f"{scatter.__name__} value", part.detach(), _part(x, topo, dim), failures)
        kwargs = {"grad_is_partial": False} if gather is gather_from_sp else {}
        whole = gather(part, comm, **kwargs)
        _close(f"{gather.__name__} value", whole.detach(), x, failures)
        whole.backward(g)
        _close(f"{scatter.__name__}/{gather.__name__} grad", xi.grad, g, failures)
    r = topo.rank("tp")
    # a gathered sequence that feeds a tp-split layer: each rank's gradient is a partial sum
    # (here g * (rank + 1)), and this rank's shard gets the sum of the parts for its slice
    xi = _part(x, topo, SEQ_DIM).clone().requires_grad_()
    gather_from_sp(xi, comm).backward(g * (r + 1))
    total = sum(range(1, topo.tp + 1))
    _close("gather_from_sp partial grad", xi.grad, _part(g * total, topo, SEQ_DIM), failures)
    # reduce-scatter of tp partial sums along the sequence: every rank holds x * (rank + 1)
    xi = (x * (r + 1)).requires_grad_()
    out = reduce_scatter_to_sp(xi, comm)
    total = sum(range(1, topo.tp + 1))
    _close("reduce_scatter_to_sp value", out.detach(), _part(x * total, topo, SEQ_DIM), failures)
    out.backward(_part(g, topo, SEQ_DIM))
    _close("reduce_scatter_to_sp grad", xi.grad, g, failures)


def _all_layers(rank, world):
    topo = Topology.build(tp=world)
    failures: list[str] = []
    for gather_output in (True, False):
        _column(topo, failures, gather_output=gather_output)
    _column(topo, failures, gather_output=False, chunks=3)
    _column(topo, failures, gather_output=False, sequence_parallel=True)
    for input_is_parallel in (True, False):
        _row(topo, failures, input_is_parallel=input_is_parallel)
    _row(topo, failures, input_is_parallel=True, sequence_parallel=True)
    _embedding(topo, failures)
    _embedding(topo, failures, sequence_parallel=True)
    _cross_entropy(topo, failures)
    _layer_norm(topo, failures)
    _mappings(topo, failures)
    return failures


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_layers_match_unsplit_torch_layers(tp):
    for rank, failures in enumerate(run_distributed(_all_layers, tp)):
        assert not failures, f"tp rank {rank}: " + "; ".join(failures)


def test_split_and_join_are_inverse_and_slice_chunk_by_chunk():
    t = torch.arange(24.0).view(6, 4)
    parts = [split_tensor(t, parts=2, rank=r, dim=0, chunks=3) for r in range(2)]
    # [q; k; v] with 2 rows each: rank 0 gets the first row of q, k and v
    assert parts[0][:, 0].tolist() == [0.0, 8.0, 16.0]
    assert torch.equal(join_tensors(parts, dim=0, chunks=3), t)
    cols = [split_tensor(t, parts=4, rank=r, dim=1) for r in range(4)]
    assert torch.equal(join_tensors(cols, dim=1), t)
    with pytest.raises(ValueError, match="dimension 0 of size 6 does not split into 4 tp ranks"):
        split_tensor(t, parts=4, rank=0, dim=0)


def _bad_shapes(rank, world):
    topo = Topology.build(tp=world)
    errors = []
    for build in (
        lambda: VocabParallelEmbedding(7, 4, topology=topo),
        lambda: ColumnParallelLinear(4, 9, topology=topo, chunks=3),
        lambda: ColumnParallelLinear(
            4, 8, topology=topo, gather_output=True, sequence_parallel=True
        ),
    ):
        try:
            build()
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.distributed
def test_shapes_that_do_not_split_are_clear_errors():
    errors = run_distributed(_bad_shapes, 2)[0]
    assert "vocabulary of 7 does not split into 2 tp ranks" in errors[0]
    assert "dimension 0 of size 9 does not split into 2 tp ranks x 3 chunks" in errors[1]
    assert "gather_output and sequence_parallel exclude each other" in errors[2]
