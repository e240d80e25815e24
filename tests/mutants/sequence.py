"""The mutants of src/zerostack/sequence/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "ring attention: a row with no key seen yet takes exp(-inf + inf) (nan)",
        "sequence/ring.py",
        '                safe = new.masked_fill(new == float("-inf"), 0.0)',
        "                safe = new",
        ("tests/test_ring.py::test_packed_documents_attend_only_within_themselves[True-2-3]",),
    ),
    Mutant(
        "ring attention computes the tiles wholly above the causal diagonal",
        "sequence/ring.py",
        "                if masked and c.start > r.stop - 1:",
        "                if False:",
        (
            "tests/test_ring.py::"
            "test_causal_blocks_cover_exactly_the_causal_mask_and_balance_the_work[2-3]",
        ),
    ),
    Mutant(
        "ring attention: a tile straddling the diagonal is taken for wholly past (unmasked)",
        "sequence/ring.py",
        "                yield r, c, masked and c.stop - 1 > r.start",
        "                yield r, c, masked and c.stop - 1 > r.stop",
        (
            "tests/test_ring.py::"
            "test_causal_blocks_cover_exactly_the_causal_mask_and_balance_the_work[2-3]",
        ),
    ),
    Mutant(
        "the tiled logits loss leaves ZeRO-3's compute_params released while the tiles run",
        "sequence/tiled.py",
        "        with GatheredParameters(list(compute_params or ())):",
        "        with GatheredParameters([]):",
        (
            "tests/test_hf_long.py::"
            "test_tiled_mlp_tiled_loss_and_cpu_checkpoints_match_single_process[2-2-3]",
        ),
    ),
    Mutant(
        "HF ring: packed rows are taken for one running sequence (no document ids)",
        "sequence/hf_ulysses.py",
        "    if not starts.any():\n        return None\n",
        "    return None\n",
        (
            "tests/test_hf_ring.py::test_alst_with_ring_matches_single_process_training_at_zero_3"
            "[2-2-True]",
        ),
    ),
    Mutant(
        "HF ring: the adapter cuts consecutive shards, not the ring's zigzag pieces",
        "sequence/hf_data.py",
        "        self.ring = RINGS.get(sp_group, 1)",
        "        self.ring = 1",
        (
            "tests/test_hf_ring.py::test_alst_with_ring_matches_single_process_training_at_zero_3"
            "[2-2-False]",
        ),
    ),
    Mutant(
        "HF ring: the core attention runs on the ring shard alone",
        "sequence/hf_ulysses.py",
        "            if self.ring is not None:\n",
        "            if False:\n",
        (
            "tests/test_hf_ring.py::test_alst_with_ring_matches_single_process_training_at_zero_3"
            "[2-2-False]",
        ),
    ),
    Mutant(
        "HF Ulysses x ring: the all-to-alls run over every sp rank, not the Ulysses group",
        "sequence/hf_ulysses.py",
        '            process_group=topo.group("ulysses") if topo.ulysses > 1 else None,',
        '            process_group=topo.group("sp"),',
        (
            "tests/test_hf_ring.py::test_alst_with_ring_matches_single_process_training_at_zero_3"
            "[4-2-False]",
        ),
    ),
    Mutant(
        "ring attention: the keys' document ids stay home (each step masks with the queries')",
        "sequence/ring.py",
        "apart = (docs[0][:, rows, None] != docs[1][:, None, cols])",
        "apart = (docs[0][:, rows, None] != docs[0][:, None, cols])",
        ("tests/test_ring.py::test_packed_documents_attend_only_within_themselves",),
    ),
    Mutant(
        "sequence_piece: a rank's ring shard is picked by rank % ring, not rank // ulysses",
        "sequence/ring.py",
        "return zigzag_shard(x, rank // u, ring, dim).chunk(u, dim=dim)[rank % u]",
        "return zigzag_shard(x, rank % ring, ring, dim).chunk(u, dim=dim)[rank % u]",
        (
            "tests/test_ring_grid.py::test_gpt_under_ring_attention_matches_single_process"
            "[4-4-2-3-False]",
        ),
    ),
    Mutant(
        "Ulysses under a ring exchanges over the whole sp group",
        "sequence/layer.py",
        'return cf.on_axis(comm_for(group), "sp" if group.ring == 1 else "ulysses")',
        'return cf.on_axis(comm_for(group), "sp")',
        (
            "tests/test_ring_grid.py::test_gpt_under_ring_attention_matches_single_process"
            "[4-4-2-2-True]",
        ),
    ),
    Mutant(
        "a model wired for ring attention alone is refused as unwired",
        "sequence/check.py",
        "    if rings and topo.ulysses == 1:\n        return False\n",
        "",
        (
            "tests/test_ring_grid.py::test_gpt_under_ring_attention_matches_single_process"
            "[2-2-2-3-False]",
        ),
    ),
    Mutant(
        "HF Ulysses: the all-to-all scatters the sequence and gathers the heads (swapped)",
        "sequence/hf_ulysses.py",
        "        q, k, v = (self._heads(t, 1, 2) for t in (query, key, value))",
        "        q, k, v = (self._heads(t, 2, 1) for t in (query, key, value))",
        ("tests/test_hf_ulysses.py::test_alst_script_matches_single_process_training[3]",),
    ),
    Mutant(
        "HF Ulysses: the data loader adapter gives every sp rank the first shard",
        "sequence/hf_data.py",
        "v = sequence_piece(v, 1, self.sp_rank, sp, ring).cpu().contiguous()",
        "v = sequence_piece(v, 1, 0, sp, ring).cpu().contiguous()",
        ("tests/test_hf_ulysses.py::test_alst_script_matches_single_process_training[1]",),
    ),
    Mutant(
        "HF Ulysses: the loss is each shard's own mean, averaged (not the tokens' mean)",
        "sequence/hf_data.py",
        "    count = cf.reduce(count, axis)\n"
        "    total = cf.reduce(cf.copy(total, axis), axis)\n"
        "    return total / count.clamp_min(1)",
        "    mean = total / count.clamp_min(1)\n"
        "    return cf.reduce(cf.copy(mean, axis), axis) / axis.size",
        ("tests/test_hf_ulysses.py::test_loss_is_the_mean_over_every_shards_labelled_tokens",),
    ),
    Mutant(
        "HF Ulysses: packed documents attend across their boundaries",
        "sequence/hf_ulysses.py",
        "            attention_mask = _document_mask(positions.expand(q.shape[0], -1))",
        "            attention_mask = None",
        ("tests/test_hf_ulysses.py::test_mqa_and_packed_documents_match_whole_sequence_attention",),
    ),
    Mutant(
        "tiled compute: a tile's parameter gradient written over the others', not summed",
        "sequence/tiled.py",
        "self.acc[j] = self.acc[j].add_(g) if self.owned[j] else self.acc[j] + g",
        "self.acc[j] = g",
        ("tests/test_tiled.py::test_tiled_mlp_matches_untiled[True-4]",),
    ),
    Mutant(
        "tiled logits loss: the mean over tiles, not over the counted tokens",
        "sequence/tiled.py",
        'w = count / total if reduction == "mean" else 1.0',
        'w = 1 / len(tiles) if reduction == "mean" else 1.0',
        ("tests/test_tiled.py::test_fused_logits_loss_mean_is_over_labels_not_tiles",),
    ),
    Mutant(
        "tiled compute: backward recomputes every tile from the first tile's input",
        "sequence/tiled.py",
        "xt = x.narrow(-2, start, size).detach().requires_grad_(need_x)",
        "xt = x.narrow(-2, 0, size).detach().requires_grad_(need_x)",
        ("tests/test_tiled.py::test_tiled_mlp_matches_untiled[True-5]",),
    ),
    Mutant(
        "tiled compute: the positions of an uneven split's remainder dropped",
        "sequence/tiled.py",
        "    sizes = [step + (1 if i < extra else 0) for i in range(shards)]",
        "    sizes = [step for i in range(shards)]",
        ("tests/test_tiled.py::test_tiled_mlp_matches_untiled[True-5]",),
    ),
    Mutant(
        "ring attention: partial results merged without rescaling to the running maximum",
        "sequence/ring.py",
        "acc[..., rows, :] = acc[..., rows, :] * alpha.unsqueeze(-1) + p @ vf[..., cols, :]",
        "acc[..., rows, :] = acc[..., rows, :] + p @ vf[..., cols, :]",
        ("tests/test_ring.py::test_ring_attention_is_attention_over_the_whole_sequence[2-comm]",),
    ),
    Mutant(
        "ring attention: the zigzag chunks in the other order (late chunk first)",
        "sequence/ring.py",
        "    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)",
        "    return torch.cat([chunks[2 * world - 1 - rank], chunks[rank]], dim=dim)",
        ("tests/test_ring.py::test_zigzag_chunk_order_for_two_and_four_ranks",),
    ),
    Mutant(
        "ring attention: the diagonal blocks unmasked (queries see later keys)",
        "sequence/ring.py",
        "        return [(early, early, True), (late, every, True)]",
        "        return [(early, early, False), (late, every, False)]",
        (
            "tests/test_ring.py::"
            "test_causal_blocks_cover_exactly_the_causal_mask_and_balance_the_work[2-None]",
        ),
    ),
    Mutant(
        "ring attention: the keys' and values' gradients not sent home at the end",
        "sequence/ring.py",
        "        dk, dv = axis.ring_shift([dk, dv])",
        "        dk, dv = dk, dv",
        ("tests/test_ring.py::test_ring_attention_is_attention_over_the_whole_sequence[2-group]",),
    ),
    Mutant(
        "every sp rank takes the first sequence shard",
        "sequence/layer.py",
        "return sequence_piece(t, dim, rank, sp, topology.ring).contiguous()",
        "return sequence_piece(t, dim, 0, sp, topology.ring).contiguous()",
        (
            "tests/test_ulysses.py::"
            "test_the_loader_hands_each_sp_rank_its_shard_of_the_same_samples",
        ),
    ),
    Mutant(
        "a model whose attention cannot exchange shards is accepted under sp",
        "sequence/check.py",
        '    if built is None and callable(getattr(model, "parallelize", None)):\n'
        "        return True\n",
        '    if built is None and callable(getattr(model, "parallelize", None)):\n'
        "        return True\n"
        "    return False\n",
        ("tests/test_ulysses.py::test_bad_grids_are_refused_naming_the_key",),
    ),
]
