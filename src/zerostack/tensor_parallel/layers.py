"""Tensor-parallel layers: the weight of each is split across the tp ranks of the grid.

Every layer is built (or converted with ``from_*``) from the unsplit torch layer, drawing the same
random numbers, and keeps this rank's slice: with the same seed, the tp shards are exactly the
slices of the plain layer, so a tp model and a plain one can be compared and converted
(:func:`split_tensor`, :func:`join_tensors`). A split parameter carries
``tensor_model_parallel = True``, ``partition_dim`` and ``partition_chunks`` (Megatron's
attribute names); a replicated one has none of them::

    fc = ColumnParallelLinear(64, 256, topology=topo)                  # weight [256 / tp, 64]
    proj = RowParallelLinear(256, 64, topology=topo)                   # weight [64, 256 / tp]
    y = proj(F.gelu(fc(x)))                                            # one all-reduce forward

``chunks`` splits a fused projection part by part: a ``[q; k; v]`` weight with ``chunks=3`` gives
each rank its q, k and v heads, not a contiguous third of the stack.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.grid import comm_for
from ..topology import Topology
from ..zero.stage3.linear import linear_saving_weight
from .mappings import (
    copy_to_tp,
    gather_from_tp,
    gather_linear_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
)


def split_tensor(t: torch.Tensor, *, parts: int, rank: int, dim: int, chunks: int = 1):
    """Rank ``rank``'s slice of ``t`` split ``parts`` ways along ``dim`` (chunk by chunk)."""
    size = t.shape[dim]
    if size % (parts * chunks):
        raise ValueError(
            f"dimension {dim} of size {size} does not split into {parts} tp ranks"
            + (f" x {chunks} chunks" if chunks > 1 else "")
        )
    width = size // (parts * chunks)
    pieces = [c.narrow(dim, rank * width, width) for c in t.chunk(chunks, dim=dim)]
    return torch.cat(pieces, dim=dim).clone()


def join_tensors(shards: list[torch.Tensor], *, dim: int, chunks: int = 1) -> torch.Tensor:
    """The inverse of :func:`split_tensor`: the whole tensor from every rank's slice, in order."""
    per_rank = [s.chunk(chunks, dim=dim) for s in shards]
    return torch.cat([rank_parts[c] for c in range(chunks) for rank_parts in per_rank], dim=dim)


def mark_split(p: nn.Parameter, *, dim: int, chunks: int = 1) -> nn.Parameter:
    p.tensor_model_parallel = True
    p.partition_dim = dim
    p.partition_chunks = chunks
    return p


def partition_spec(p: torch.Tensor) -> tuple[int, int] | None:
    """``(dim, chunks)`` of a tp-split parameter; None for a replicated one."""
    if getattr(p, "tensor_model_parallel", False):
        return p.partition_dim, p.partition_chunks
    return None


def _full_linear(d_in: int, d_out: int, bias: bool, init_method) -> nn.Linear:
    full = nn.Linear(d_in, d_out, bias=bias)  # torch's init: the same draws as the plain layer
    if init_method is not None:
        with torch.no_grad():
            init_method(full.weight)
            if full.bias is not None:
                full.bias.zero_()
    return full


class _TPModule(nn.Module):
    topology: Topology

    @property
    def comm(self):
        return comm_for(self.topology)

    @classmethod
    def _blank(cls, topology: Topology):
        obj = cls.__new__(cls)
        nn.Module.__init__(obj)
        obj.topology = topology
        return obj


class ColumnParallelLinear(_TPModule):
    """``y = x A^T + b`` with the rows of ``A`` (output features) split across tp ranks.

    The input is replicated (or, with ``sequence_parallel``, sequence-sharded and all-gathered
    here); the output is this rank's features unless ``gather_output``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        topology: Topology,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        chunks: int = 1,
        init_method=None,
    ) -> None:
        super().__init__()
        self.topology = topology
        full = _full_linear(in_features, out_features, bias, init_method)
        self._setup(full, gather_output, sequence_parallel, chunks)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        topology: Topology,
        gather_output=False,
        sequence_parallel=False,
        chunks=1,
    ) -> ColumnParallelLinear:
        """This rank's part of an existing ``nn.Linear`` (its weights are sliced, not redrawn)."""
        obj = cls._blank(topology)
        obj._setup(linear, gather_output, sequence_parallel, chunks)
        return obj

    def _setup(self, full: nn.Linear, gather_output, sequence_parallel, chunks) -> None:
        if gather_output and sequence_parallel:
            raise ValueError(
                "ColumnParallelLinear: gather_output and sequence_parallel exclude "
                "each other (the output is tp-split, the input sequence-split)"
            )
        tp, rank = self.topology.tp, self.topology.rank("tp")
        self.in_features, self.out_features = full.in_features, full.out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        cut = dict(parts=tp, rank=rank, dim=0, chunks=chunks)
        self.weight = mark_split(
            nn.Parameter(split_tensor(full.weight.detach(), **cut)), dim=0, chunks=chunks
        )
        self.bias = None
        if full.bias is not None:
            self.bias = mark_split(
                nn.Parameter(split_tensor(full.bias.detach(), **cut)), dim=0, chunks=chunks
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        comm = self.comm
        if self.sequence_parallel and comm.topo.tp > 1:
            y = gather_linear_from_sp(x, self.weight, self.bias, comm)
        else:
            y = linear_saving_weight(copy_to_tp(x, comm), self.weight, self.bias)
        return gather_from_tp(y, comm) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}/{self.topology.tp}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(_TPModule):
    """``y = x A^T + b`` with the columns of ``A`` (input features) split across tp ranks.

    The input is this rank's features (``input_is_parallel``, the output of a
    :class:`ColumnParallelLinear`) or is split here; the partial products are all-reduced (or, with
    ``sequence_parallel``, reduce-scattered along the sequence) and the bias is added once.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        topology: Topology,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        init_method=None,
    ) -> None:
        super().__init__()
        self.topology = topology
        full = _full_linear(in_features, out_features, bias, init_method)
        self._setup(full, input_is_parallel, sequence_parallel)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        topology: Topology,
        input_is_parallel=True,
        sequence_parallel=False,
    ) -> RowParallelLinear:
        obj = cls._blank(topology)
        obj._setup(linear, input_is_parallel, sequence_parallel)
        return obj

    def _setup(self, full: nn.Linear, input_is_parallel, sequence_parallel) -> None:
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        tp, rank = self.topology.tp, self.topology.rank("tp")
        self.in_features, self.out_features = full.in_features, full.out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.weight = mark_split(
            nn.Parameter(split_tensor(full.weight.detach(), parts=tp, rank=rank, dim=1)), dim=1
        )
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        comm = self.comm
        if not self.input_is_parallel:
            x = scatter_to_tp(x, comm)
        y = linear_saving_weight(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sp(y, comm)
            # The bias meets sequence shards: each rank's gradient is a part of the whole.
            return y if self.bias is None else y + copy_to_tp(self.bias, comm)
        y = reduce_from_tp(y, comm)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}/{self.topology.tp}, out={self.out_features}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(_TPModule):
    """An embedding table split by rows (the vocabulary) across tp ranks.

    Each rank looks up the tokens in its range and writes zeros for the others; the all-reduce
    (or, with ``sequence_parallel``, the reduce-scatter along the sequence) completes the rows.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        topology: Topology,
        sequence_parallel: bool = False,
        init_method=None,
    ) -> None:
        super().__init__()
        self.topology = topology
        full = nn.Embedding(num_embeddings, embedding_dim)
        if init_method is not None:
            with torch.no_grad():
                init_method(full.weight)
        self._setup(full, sequence_parallel)

    @classmethod
    def from_embedding(
        cls, emb: nn.Embedding, *, topology: Topology, sequence_parallel=False
    ) -> VocabParallelEmbedding:
        obj = cls._blank(topology)
        obj._setup(emb, sequence_parallel)
        return obj

    def _setup(self, full: nn.Embedding, sequence_parallel: bool) -> None:
        tp, rank = self.topology.tp, self.topology.rank("tp")
        self.num_embeddings, self.embedding_dim = full.num_embeddings, full.embedding_dim
        if self.num_embeddings % tp:
            raise ValueError(
                f"VocabParallelEmbedding: vocabulary of {self.num_embeddings} does "
                f"not split into {tp} tp ranks; pad it to a multiple of {tp}"
            )
        per = self.num_embeddings // tp
        self.vocab_start, self.vocab_end = rank * per, (rank + 1) * per
        self.sequence_parallel = sequence_parallel
        self.weight = mark_split(
            nn.Parameter(split_tensor(full.weight.detach(), parts=tp, rank=rank, dim=0)), dim=0
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        comm = self.comm
        if self.topology.tp == 1:
            out = F.embedding(idx, self.weight)
        else:
            outside = (idx < self.vocab_start) | (idx >= self.vocab_end)
            local = (idx - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(out, comm)
        return reduce_from_tp(out, comm)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}/{self.topology.tp}, {self.embedding_dim}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class SequenceParallelLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` run on sequence shards: its replicated weight and bias see only this
    rank's tokens, so their gradients are all-reduced over tp (:func:`copy_to_tp`)."""

    topology: Topology

    @classmethod
    def from_layer_norm(cls, ln: nn.LayerNorm, *, topology: Topology):
        obj = cls(
            ln.normalized_shape,
            eps=ln.eps,
            elementwise_affine=ln.elementwise_affine,
            bias=ln.bias is not None,
        )
        obj.topology = topology
        with torch.no_grad():
            if ln.weight is not None:
                obj.weight.copy_(ln.weight)
            if ln.bias is not None:
                obj.bias.copy_(ln.bias)
        return obj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        comm = comm_for(self.topology)
        w = None if self.weight is None else copy_to_tp(self.weight, comm)
        b = None if self.bias is None else copy_to_tp(self.bias, comm)
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)
