"""Tensor parallelism for Hugging Face models, from an explicit table per architecture.

DeepSpeed's AutoTP guesses which linear layers to split; here each architecture names them
(Megatron's pattern: the first projection of a block is split by output features, "column", the
second by input features, "row", so each attention and each MLP costs one all-reduce forward and
one backward). Embeddings, norms and the LM head stay replicated. An architecture that is not in
the table is refused with the list of those that are::

    config = {..., "tensor_parallel": {"autotp_size": 2}}
    engine, *_ = zerostack.initialize(model=hf_model, config=config)

The split happens in place: each parameter keeps its identity and its name, and holds this tp
rank's slice (``tensor_model_parallel``, ``partition_dim``, ``partition_chunks`` as the other
tensor-parallel layers), so the optimizer groups a user built before still apply, and
``full_state_dict`` / ``save_16bit_model`` join the slices back into the Hugging Face layout.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.grid import comm_for
from ..topology import Topology
from .layers import mark_split, split_tensor
from .mappings import copy_to_tp, reduce_from_tp


@dataclass(frozen=True)
class Policy:
    """Which submodules of an architecture are split, by the end of their qualified names."""

    column: tuple[str, ...]  # output features split; the input arrives whole
    row: tuple[str, ...]  # input features split; the partial outputs are all-reduced
    chunks: dict[str, int] = field(default_factory=dict)  # fused outputs (q, k, v) split per part
    divisible: Callable[[object], dict[str, int]] = lambda cfg: {}  # sizes tp must divide
    adjust: Callable[[nn.Module, int], None] | None = None  # attention bookkeeping per block


def _gpt2_sizes(cfg) -> dict[str, int]:
    if getattr(cfg, "add_cross_attention", False):
        raise ValueError("tensor parallelism: GPT-2 with cross-attention is not in the table")
    return {"n_head": cfg.n_head, "n_inner": cfg.n_inner or 4 * cfg.n_embd}


def _gpt2_adjust(model: nn.Module, tp: int) -> None:
    for m in model.modules():
        if type(m).__name__ == "GPT2Attention":
            m.split_size //= tp  # c_attn's output is this rank's q, k and v heads
            m.num_heads //= tp
            m.embed_dim //= tp


def _llama_sizes(cfg) -> dict[str, int]:
    return {
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads or cfg.num_attention_heads,
        "intermediate_size": cfg.intermediate_size,
    }


POLICIES: dict[str, Policy] = {
    "gpt2": Policy(
        column=("attn.c_attn", "mlp.c_fc"),
        row=("attn.c_proj", "mlp.c_proj"),
        chunks={"attn.c_attn": 3},
        divisible=_gpt2_sizes,
        adjust=_gpt2_adjust,
    ),
    # Llama's attention reshapes with -1 heads and keeps the q/kv group ratio: nothing to adjust
    "llama": Policy(
        column=(
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ),
        row=("self_attn.o_proj", "mlp.down_proj"),
        divisible=_llama_sizes,
    ),
}


def model_type(model: nn.Module) -> str | None:
    """The Hugging Face ``config.model_type`` of ``model`` (None for a model without one)."""
    return getattr(getattr(model, "config", None), "model_type", None)


def policy_for(model: nn.Module) -> Policy:
    kind = model_type(model)
    if kind not in POLICIES:
        what = f"model_type {kind!r}" if kind else f"{type(model).__name__} (no config.model_type)"
        raise ValueError(
            f"tensor_parallel.autotp_size: no tensor-parallel policy for {what}; known: "
            f"{', '.join(sorted(POLICIES))} (or build the model from zerostack.tensor_parallel "
            "layers, or give it a parallelize(topology) method)"
        )
    return POLICIES[kind]


class TPLinear(nn.Module):
    """A linear layer (``nn.Linear``, or transformers' ``Conv1D`` with its weight stored
    ``[in, out]``) whose parameters hold this tp rank's slice; the same parameter objects."""

    def __init__(self, layer: nn.Module, *, mode: str, topology: Topology, chunks: int = 1):
        super().__init__()
        self.transposed = type(layer).__name__ == "Conv1D"
        if not (self.transposed or isinstance(layer, nn.Linear)):
            raise ValueError(f"tensor parallelism: cannot split a {type(layer).__name__}")
        self.mode, self.topology = mode, topology
        tp, rank = topology.tp, topology.rank("tp")
        out_dim = 1 if self.transposed else 0
        dim = out_dim if mode == "column" else 1 - out_dim
        self.weight = _cut(layer.weight, dim, tp, rank, chunks)
        self.bias = layer.bias
        if self.bias is not None and mode == "column":
            self.bias = _cut(self.bias, 0, tp, rank, chunks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        comm = comm_for(self.topology)
        if self.mode == "column":
            return self._matmul(_enter(x, comm), self.bias)
        y = reduce_from_tp(self._matmul(x, None), comm)
        return y if self.bias is None else y + self.bias

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.transposed:
            return F.linear(x, self.weight, bias)
        y = x.reshape(-1, x.shape[-1])
        y = y @ self.weight if bias is None else torch.addmm(bias, y, self.weight)
        return y.view(*x.shape[:-1], self.weight.shape[1])

    def extra_repr(self) -> str:
        return f"{self.mode}, weight={tuple(self.weight.shape)}, tp={self.topology.tp}"


# id(an input) -> (it, weakly; (its version, the comm, grad mode); its entry into the tp
# region): an entry lasts while the caller holds the input's Python object
_ENTERED: dict[int, tuple] = {}


def _enter(x: torch.Tensor, comm) -> torch.Tensor:
    """``copy_to_tp(x)``, once for every column layer that reads the same ``x``: a Hugging Face
    block hands one tensor to q, k and v (and to gate and up), and sharing one entry lets
    autograd sum their input gradients before the all-reduce, so backward all-reduces once per
    tensor, not once per layer (Megatron fuses those layers into one matrix for the same
    reason). Always exact: the all-reduce is linear."""
    key, state = id(x), (x._version, comm, torch.is_grad_enabled())
    last = _ENTERED.get(key)
    if last is not None and last[0]() is x and last[1] == state:
        return last[2]
    y = copy_to_tp(x, comm)
    _ENTERED[key] = (weakref.ref(x, lambda _: _ENTERED.pop(key, None)), state, y)
    return y


def _cut(p: nn.Parameter, dim: int, tp: int, rank: int, chunks: int) -> nn.Parameter:
    p.data = split_tensor(p.data, parts=tp, rank=rank, dim=dim, chunks=chunks)
    return mark_split(p, dim=dim, chunks=chunks)


def parallelize(model: nn.Module, topology: Topology, specs=None) -> nn.Module:
    """Split ``model``'s linear layers over ``topology``'s tp ranks by its architecture's policy,
    or by ``specs`` (``tensor_parallel.partition_config``, see :func:`parallelize_by_specs`)."""
    from ..zero.stage3.params import is_sharded

    tp = topology.tp
    if any(is_sharded(p) for p in model.parameters()):
        raise ValueError(
            "tensor_parallel.autotp_size: the model's parameters are already stage-3 pieces "
            "(zero.Init); build it outside zero.Init: stage 3 shards it at initialize, after "
            "the tensor-parallel split"
        )
    if specs is not None:
        return parallelize_by_specs(model, topology, specs)
    policy = policy_for(model)
    for name, size in policy.divisible(model.config).items():
        if size % tp:
            raise ValueError(
                f"tensor_parallel.autotp_size: {model_type(model)} config.{name} = {size} does "
                f"not split into {tp} tp ranks"
            )
    found = 0
    for qualified, module in list(model.named_modules()):
        mode = _mode(policy, qualified)
        if mode is None:
            continue
        parent_name, _, attr = qualified.rpartition(".")
        parent = model.get_submodule(parent_name)
        chunks = next((c for s, c in policy.chunks.items() if qualified.endswith(s)), 1)
        setattr(parent, attr, TPLinear(module, mode=mode, topology=topology, chunks=chunks))
        found += 1
    if not found:
        raise ValueError(
            f"tensor_parallel.autotp_size: none of {model_type(model)}'s policy layers "
            f"({', '.join(policy.column + policy.row)}) is in the model"
        )
    if policy.adjust is not None:
        policy.adjust(model, tp)
    return model


def _mode(policy: Policy, qualified: str) -> str | None:
    if any(qualified.endswith(s) for s in policy.column):
        return "column"
    if any(qualified.endswith(s) for s in policy.row):
        return "row"
    return None


# DeepSpeed's AutoTP divides these attributes by tp on every module holding a split parameter
# (its update_mp_params), so a model's own head counts match its split projections
SHARDED_ATTRIBUTES = (
    "n_heads",
    "inner_dim",
    "num_heads",
    "num_kv",
    "num_attention_heads",
    "num_attn_heads",
    "all_head_size",
    "embed_dim",
    "hidden_size",
    "num_key_value_heads",
    "num_kv_heads",
    "kv_n_heads",
    "d_model",
    "num_attention_heads_per_partition",
    "num_multi_query_groups_per_partition",
    "hidden_size_per_partition",
)


def parallelize_by_specs(model: nn.Module, topology: Topology, specs) -> nn.Module:
    """Split the linear layers (``nn.Linear``, transformers' ``Conv1D``) whose
    ``<name>.weight`` a spec of ``specs`` matches (DeepSpeed's rule: the first that matches; a
    spec's ``model_types`` must hold the model's); a layer none matches stays whole, or is
    refused under ``strict_mode``; an embedding a spec would split is refused. Then, as
    DeepSpeed's AutoTP, every module (the root excepted) holding a split parameter, with no
    weight of 3 or more dimensions of its own or its children's, has the attributes in
    :data:`SHARDED_ATTRIBUTES` divided by tp."""
    kind, tp = model_type(model), topology.tp
    split: list[str] = []
    for qualified, module in list(model.named_modules()):
        if isinstance(module, nn.Embedding):
            spec = specs.spec_for(f"{qualified}.weight", kind)
            if spec is not None and spec.partition_type != "skip":
                raise ValueError(
                    f"tensor_parallel.partition_config: {qualified}.weight is an embedding; "
                    "zerostack keeps embeddings whole (give it partition_type skip)"
                )
        if not (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"):
            continue
        spec = specs.spec_for(f"{qualified}.weight", kind)
        if spec is None and specs.strict_mode:
            raise ValueError(
                f"tensor_parallel.partition_config: no layer_spec matches {qualified}.weight "
                "(strict_mode)"
            )
        if spec is None or spec.partition_type == "skip":
            continue
        parent_name, _, attr = qualified.rpartition(".")
        layer = TPLinear(module, mode=spec.partition_type, topology=topology, chunks=spec.chunks)
        setattr(model.get_submodule(parent_name), attr, layer)
        split.append(qualified)
    if not split:
        raise ValueError("tensor_parallel.partition_config: no layer_spec matches a linear layer")
    holders = {a for n in split for a in _ancestors(n.rpartition(".")[0])}
    for name in sorted(holders):
        module = model.get_submodule(name)
        near = [module, *module.children()]  # its own weights and its children's
        if any(p.dim() >= 3 for m in near for p in m.parameters(recurse=False)):
            continue  # DeepSpeed keeps a module with a high-dimensional weight whole
        for attr in SHARDED_ATTRIBUTES:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                if value % tp:
                    raise ValueError(
                        f"tensor_parallel.partition_config: {name}.{attr} = {value} does not "
                        f"split into {tp} tp ranks"
                    )
                setattr(module, attr, value // tp)
    return model


def _ancestors(name: str) -> list[str]:
    """``name`` and the modules above it, the root left out (``a.b.c``: a, a.b, a.b.c)."""
    parts = name.split(".") if name else []
    return [".".join(parts[: i + 1]) for i in range(len(parts))]
