"""Ulysses for Hugging Face Transformers: DeepSpeed ALST's ``UlyssesSPAttentionHF`` and
``UlyssesSPDataLoaderAdapter`` (``deepspeed.runtime.sequence_parallel.ulysses_sp``, 0.19.x), with
DeepSpeed's names, signatures and defaults, over zerostack's grid and collectives::

    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa",
        sequence_parallel_size=2, micro_batch_size=1)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, mpu=mpu)   # sp from the mpu
    group = mpu.get_sequence_parallel_group()
    loader = UlyssesSPDataLoaderAdapter(loader, mpu.get_sequence_parallel_rank(), group,
                                        mpu.get_sequence_parallel_world_size(), engine.device)
    for batch in loader:   # this rank's shard: input_ids, position_ids, shift_labels
        loss = ulysses_sp_loss(engine(**batch).logits, batch["shift_labels"], group)
        engine.backward(loss)
        engine.step()

Registering replaces the core implementation's entry in transformers' ``ALL_ATTENTION_FUNCTIONS``
by a wrapper, as DeepSpeed does (Transformers' ``if attn_implementation == "sdpa"`` branches still
run). The wrapper takes q [b, heads, s/sp, d] and k, v [b, kv_heads, s/sp, d], trades sequence
shards for head shards over the sp group (all-to-alls: q, k, v in, the output back) and calls the
core attention on the whole sequence and heads/sp.

Supported: ``sdpa``, and the flash-attention entries (they read ``position_ids`` themselves).
Refused: ``eager`` (as DeepSpeed: an O(s^2) mask) and ``flex_attention`` (its BlockMask is not
rebuilt here). The model's ``attention_mask`` is dropped, as DeepSpeed does: batches are
padding-free with ``position_ids`` (pad with ``-100`` labels). The positions, gathered over the sp
ranks, give the mask: a row that is one running sequence gets plain causal attention; under
``sdpa`` a row packing documents (positions restarting) gets causal attention inside each. GQA:
kv heads divisible by sp split like the query heads; fewer kv heads than ranks (sp divisible by
them) are repeated to sp, as DeepSpeed does; anything else is a ``ValueError``.

Ring attention (zerostack's; ``register_with_transformers(..., ring_parallel_size=r)``): the
``sequence_parallel_size`` ranks are ``r`` ring groups of ``sp / r`` Ulysses neighbours. The
all-to-alls run over the Ulysses ranks (heads then divide by ``sp / r`` only), and in place of
the core attention :func:`~zerostack.sequence.ring_attention` passes keys and values around the
ring; each rank holds :func:`~zerostack.sequence.sequence_piece` of the sequence (the adapter
cuts so), packed documents are told apart by the positions, and attention dropout, sliding
windows and logit soft-capping are refused.

The loss: the ranks' label shards hold different numbers of ignored tokens. :func:`ulysses_sp_loss`
is the mean over the whole sequence's labelled tokens on every rank. DeepSpeed's tutorial form
(per-rank means all-gathered with ``torch.distributed.nn.functional.all_gather`` and weighted by
token counts) gives the same gradients under zerostack, but NaN when a shard has no label.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import functional as cf
from ..config import ConfigError
from ..topology import Topology
from .hf_data import (  # DeepSpeed's module has them
    RINGS,
    UlyssesSPDataLoaderAdapter,
    ulysses_sp_loss,
)
from .ring import ring_attention, zigzag_shard, zigzag_unshard

logger = logging.getLogger("zerostack")

_MASK = "it needs a 4D attention_mask (O(s^2) memory) and DeepSpeed refuses it too"
UNSUPPORTED = {
    "eager": _MASK,
    "paged|eager": _MASK,
    "flex_attention": "zerostack does not rebuild its BlockMask for the whole sequence",
}


class SequenceParallelState:
    """The ``mpu`` ``register_with_transformers`` returns: DeepSpeed's ``parallel_state_sp``
    getters over a :class:`Topology` with ``sp`` neighbouring ranks per group (as DeepSpeed's),
    on which ``initialize(mpu=...)`` builds the engine. Model-parallel getters: the sp ones."""

    def __init__(self, sequence_parallel_size: int, ring_parallel_size: int = 1) -> None:
        self.topology = Topology.build(sp=sequence_parallel_size, ring=ring_parallel_size)
        RINGS[self.get_sequence_parallel_group()] = ring_parallel_size  # the adapter's cut

    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:
        if sequence_parallel_size != self.topology.sp:
            raise ConfigError(
                f"sequence_parallel_size: {sequence_parallel_size}, but this mpu "
                f"was built with {self.topology.sp}"
            )

    def get_sequence_parallel_group(self) -> dist.ProcessGroup:
        return self.topology.group("sp")

    def get_sequence_parallel_world_size(self) -> int:
        return self.topology.sp

    def get_sequence_parallel_rank(self) -> int:
        return self.topology.rank("sp")

    def get_sequence_data_parallel_group(self) -> dist.ProcessGroup:
        return self.topology.group("dp")  # the dp axis counts the sp ranks

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.topology.dp

    def get_sequence_data_parallel_rank(self) -> int:
        return self.topology.dp_rank

    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank


def _check_heads(heads: int, kv_heads: int, sp: int) -> None:
    if heads % sp:
        raise ValueError(
            f"Ulysses: attention head count {heads} is not divisible by sequence_parallel_size {sp}"
        )
    if kv_heads % sp and sp % kv_heads:
        raise ValueError(
            f"Ulysses: kv head count {kv_heads} is not divisible by "
            f"sequence_parallel_size {sp}, nor sp by it"
        )


def _ring_documents(positions: torch.Tensor, ring: cf.Axis) -> torch.Tensor | None:
    """This ring rank's tokens' document numbers ([b, s/ring], for ring_attention), or None
    when every row is one running sequence. From the positions of every ring rank's zigzag
    shard, put back in order: a position that does not follow its predecessor starts one."""
    every = cf.gather(positions.contiguous(), 1, ring).chunk(ring.size, dim=1)
    whole = zigzag_unshard(list(every), ring.size, 1)
    starts = torch.zeros_like(whole, dtype=torch.bool)
    starts[:, 1:] = whole[:, 1:] != whole[:, :-1] + 1
    if not starts.any():
        return None
    return zigzag_shard(starts.long().cumsum(1), ring.rank, ring.size, 1)


def _document_mask(positions: torch.Tensor) -> torch.Tensor | None:
    """None when every row is one running sequence (plain causal attention); else the boolean
    [b, 1, s, s] mask of causal attention inside each document (a position that does not
    follow its predecessor starts one)."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    if not starts[:, 1:].any():
        return None
    doc = starts.cumsum(1)
    s = positions.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=positions.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


class UlyssesSPAttentionHF(nn.Module):
    """Attention over a sequence split across the sp ranks, called as a Hugging Face attention
    function (DeepSpeed's class of this name, with its constructor): ``attn`` is the core
    attention from ``ALL_ATTENTION_FUNCTIONS``; ``forward(module, q, k, v, attention_mask,
    **kwargs)`` takes ``[b, heads, s/sp, d]`` and returns ``([b, s/sp, heads, d], weights)``.
    Build it with :meth:`register_with_transformers`."""

    def __init__(
        self,
        attn,
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group: dist.ProcessGroup,
        seq_length_is_variable: bool = False,
        local_seq_length: int = None,
        global_seq_length: int = None,
        disable_in_eval: bool = False,
        ring_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.attn = attn
        # with a ring (zerostack's ring_group), process_group holds the Ulysses ranks, None
        # when there is one; sequence_group is every sp rank (register_with_transformers')
        self.process_group = process_group
        self.sequence_group = process_group if ring_group is None else None
        self.axis = None if process_group is None else cf.on_group(process_group, "sp")
        self.ring = None if ring_group is None else cf.on_group(ring_group, "ring")
        self.world_size = 1 if self.axis is None else self.axis.size
        self.sp_rank = 0 if self.axis is None else self.axis.rank
        self.batch_size = batch_size
        self.attn_head_count = attn_head_count
        self.attn_head_size = attn_head_size
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length = local_seq_length
        self.global_seq_length = global_seq_length
        self.disable_in_eval = disable_in_eval
        self.core_attn_implementation = None  # set by register_with_transformers
        sp = self.world_size
        _check_heads(attn_head_count, kv_head_count, sp)
        # fewer kv heads than ranks: each is repeated so that every rank gets one (DeepSpeed)
        self.kv_replication_factor = max(1, sp // kv_head_count)
        self.local_q_head_count = attn_head_count // sp
        self.local_kv_head_count = max(1, kv_head_count // sp)

    def _check(self, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> None:
        h, s = query.shape[1:3]
        if h != self.attn_head_count or key.shape[1] != self.global_kv_head_count:
            raise ValueError(
                f"Ulysses: query/key heads {h}/{key.shape[1]}, registered for "
                f"{self.attn_head_count}/{self.global_kv_head_count}"
            )
        if not self.seq_length_is_variable and s != self.local_seq_length:
            raise ValueError(
                f"Ulysses: a shard of {s} tokens; registered with seq_length "
                f"{self.global_seq_length} and seq_length_is_variable=False"
            )
        if kwargs.get("position_ids") is None:
            raise ValueError(
                "Ulysses: called without position_ids, each rank would number its "
                "shard from 0; pass the shards' global positions (the adapter's)"
            )

    def forward(self, module, query, key, value, attention_mask, *args: Any, **kwargs: Any):
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        self._check(query, key, kwargs)
        groups = getattr(module, "num_key_value_groups", None)
        if self.kv_replication_factor > 1:  # every rank gets one (repeated) kv head
            key, value = (
                t.repeat_interleave(self.kv_replication_factor, dim=1) for t in (key, value)
            )
            module.num_key_value_groups = self.local_q_head_count
        # [b, heads, s/sp, d] -> [b, heads/sp, s, d]
        q, k, v = (self._heads(t, 1, 2) for t in (query, key, value))
        with torch.no_grad():
            positions = kwargs["position_ids"].contiguous()
            positions = positions if self.axis is None else cf.gather(positions, 1, self.axis)
        kwargs["position_ids"] = positions
        attention_mask = None  # built for the shard; the positions say what the whole needs
        try:
            if self.ring is not None:
                out, weights = self._ring_attention(module, q, k, v, positions, kwargs), None
            else:
                if self.core_attn_implementation == "sdpa":
                    attention_mask = _document_mask(positions.expand(q.shape[0], -1))
                out, weights = self.attn(module, q, k, v, attention_mask, *args, **kwargs)
        finally:
            if self.kv_replication_factor > 1:  # as it was, for a call without Ulysses
                module.num_key_value_groups = groups
        # [b, s, heads/sp, d] -> [b, s/sp, heads, d]
        return self._heads(out, 1, 2), weights

    def _heads(self, t: torch.Tensor, scatter: int, gather: int) -> torch.Tensor:
        return t if self.axis is None else cf.all_to_all(t, self.axis, scatter, gather)

    def _ring_attention(self, module, q, k, v, positions, kwargs) -> torch.Tensor:
        """Attention over the whole sequence, around the ring: q [b, heads/u, s/ring, d] of
        this ring rank's zigzag shard; returns [b, s/ring, heads/u, d] as the core would."""
        for name in ("dropout", "sliding_window", "softcap"):
            if kwargs.get(name):
                raise ValueError(
                    f"ring attention: {name}={kwargs[name]!r} is not supported; "
                    "it needs 0 or None (the model's config sets it)"
                )
        with torch.no_grad():
            docs = _ring_documents(positions.expand(q.shape[0], -1), self.ring)
        out = ring_attention(
            q,
            k,
            v,
            self.ring,
            causal=getattr(module, "is_causal", True),
            scale=kwargs.get("scaling"),
            document_ids=docs,
        )
        return out.transpose(1, 2).contiguous()

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path,
        core_attn_implementation,
        sequence_parallel_size,
        micro_batch_size,
        seq_length=None,
        seq_length_is_variable=True,
        disable_in_eval=False,
        # deprecated
        max_length=None,
        ring_parallel_size=1,  # zerostack's: ring groups among the sequence_parallel_size ranks
    ):
        """Register Ulysses over ``core_attn_implementation`` in ``ALL_ATTENTION_FUNCTIONS``
        and return the ``mpu`` for ``initialize(mpu=...)`` (None, nothing registered, at sp 1).
        It builds the grid (a collective). ``model_name_or_path``: a model (anything with a
        ``config``), a config, or a name for ``AutoConfig``; its attn_implementation must be the
        core one (one without is set to it). ``seq_length``: the fixed global length, needed
        when ``seq_length_is_variable`` is False (``max_length``: its deprecated name).
        ``ring_parallel_size`` (zerostack's): that many ring groups among the sp ranks."""
        if sequence_parallel_size == 1:
            return None
        if max_length is not None:
            logger.warning("register_with_transformers: max_length is deprecated, use seq_length")
            seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError(
                "register_with_transformers: seq_length_is_variable=False needs seq_length"
            )
        sp, ring = sequence_parallel_size, ring_parallel_size
        if sp % ring:
            raise ValueError(
                f"register_with_transformers: ring_parallel_size {ring} does not "
                f"divide sequence_parallel_size {sp}"
            )
        if seq_length is not None and (seq_length % sp or ring > 1 and seq_length % (2 * ring)):
            raise ValueError(
                f"register_with_transformers: seq_length {seq_length} is not "
                f"divisible by sequence_parallel_size {sp}"
                + (f" and 2 * ring_parallel_size {2 * ring}" if ring > 1 else "")
            )
        from transformers import AutoConfig, PretrainedConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        impl = core_attn_implementation
        if impl in UNSUPPORTED:
            raise ValueError(
                f"core_attn_implementation={impl!r} is not supported by Ulysses: "
                f"{UNSUPPORTED[impl]}; use 'sdpa' or a flash attention"
            )
        if impl not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(
                f"{impl!r} is not a valid attn_implementation: the choices are "
                f"{ALL_ATTENTION_FUNCTIONS.valid_keys()}"
            )
        if isinstance(model_name_or_path, PretrainedConfig):
            config = model_name_or_path
        elif hasattr(model_name_or_path, "config"):
            config = model_name_or_path.config
        else:
            config = AutoConfig.from_pretrained(model_name_or_path)
        have = getattr(config, "_attn_implementation", None)
        if have is None:
            config._attn_implementation = impl
        elif have != impl:
            raise ValueError(
                f"core_attn_implementation={impl!r} does not match model config "
                f"attn_implementation={have!r}: set both to the same value"
            )
        arch = config.get_text_config()
        heads = arch.num_attention_heads
        kv_heads = getattr(arch, "num_key_value_heads", None) or heads
        _check_heads(heads, kv_heads, sp // ring)  # before the grid's collectives
        mpu = SequenceParallelState(sp, ring)
        topo = mpu.topology
        core = ALL_ATTENTION_FUNCTIONS[impl]
        core = getattr(core, "core", core)  # registered before: wrap the original again
        uattn = cls(
            attn=core,
            batch_size=micro_batch_size,
            attn_head_count=heads,
            attn_head_size=getattr(arch, "head_dim", None) or arch.hidden_size // heads,
            kv_head_count=kv_heads,
            num_hidden_layers=arch.num_hidden_layers,
            process_group=topo.group("ulysses") if topo.ulysses > 1 else None,
            seq_length_is_variable=seq_length_is_variable,
            local_seq_length=None if seq_length is None else seq_length // sequence_parallel_size,
            global_seq_length=seq_length,
            disable_in_eval=disable_in_eval,
            ring_group=topo.group("ring") if ring > 1 else None,
        )
        uattn.core_attn_implementation = impl
        uattn.sequence_group = mpu.get_sequence_parallel_group()

        def uattn_wrapper(module, query, key, value, attention_mask, *args, **kwargs):
            return uattn(module, query, key, value, attention_mask, *args, **kwargs)

        uattn_wrapper.ulysses, uattn_wrapper.core = uattn, core
        ALL_ATTENTION_FUNCTIONS[impl] = uattn_wrapper
        return mpu


def registered_ulysses(model: nn.Module) -> UlyssesSPAttentionHF | None:
    """The Ulysses attention registered over ``model``'s attn_implementation, or None."""
    if "transformers" not in sys.modules:
        return None
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not isinstance(impl, str):
        return None
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    fn = ALL_ATTENTION_FUNCTIONS.get(impl)
    return getattr(fn, "ulysses", None)


__all__ = [
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "registered_ulysses",
    "ulysses_sp_loss",
]
