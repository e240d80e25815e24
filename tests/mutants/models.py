"""The mutants of src/zerostack/models/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "the GPT attends within its ring shard (ring attention never called)",
        "models/gpt.py",
        "        if self.ring is not None:  # over the ring's zigzag shards",
        "        if False:  # over the ring's zigzag shards",
        (
            "tests/test_ring_grid.py::test_gpt_under_ring_attention_matches_single_process"
            "[2-2-2-0-True]",
        ),
    ),
    Mutant(
        "the GPT's heads must split over all sp ranks, ring ones too",
        "models/gpt_tp.py",
        "    tp, sp = topology.tp, topology.ulysses  # the ring ranks keep every head",
        "    tp, sp = topology.tp, topology.sp  # the ring ranks keep every head",
        ("tests/test_ring_grid.py::test_bad_ring_grids_are_refused_naming_the_keys",),
    ),
    Mutant(
        "GPT dropout is accepted under ring attention (and silently not applied)",
        "models/gpt_tp.py",
        "    if topology.ring > 1 and cfg.dropout > 0:",
        "    if False:",
        ("tests/test_ring_grid.py::test_bad_ring_grids_are_refused_naming_the_keys",),
    ),
    Mutant(
        "Megatron SP beside experts: the gate's and experts' gradients not summed over tp",
        "models/gpt_tp.py",
        "        sum_grads_over_tp(mlp, topology)",
        "        pass",
        (
            "tests/test_moe.py::"
            "test_expert_parallel_gpt_beside_tensor_parallelism_matches_single_process[1-True]",
        ),
    ),
    Mutant(
        "Megatron SP beside experts: the tp parts' auxiliary losses summed, not averaged",
        "models/gpt.py",
        "                aux = aux / topo.tp",
        "                aux = aux",
        (
            "tests/test_moe.py::"
            "test_expert_parallel_gpt_beside_tensor_parallelism_matches_single_process[1-True]",
        ),
    ),
    Mutant(
        "Megatron SP beside experts under a pipeline: a block's side loss not divided by tp",
        "models/gpt_pipe.py",
        "            self.coef /= topology.tp",
        "            self.coef /= 1",
        ("tests/test_moe.py::test_megatron_sp_beside_experts_under_a_pipeline_on_8_ranks[1f1b-1]",),
    ),
    Mutant(
        "a pipeline stage at ep > 1 loads the first experts, not its own",
        "models/gpt_pipe.py",
        "            if found and topo.ep > 1:",
        "            if False:",
        (
            "tests/test_moe.py::test_expert_parallel_gpt_under_a_pipeline_matches_single_process"
            "[1f1b-1]",
        ),
    ),
    Mutant(
        "the GPT's loss leaves the MoE auxiliary loss out under tensor parallelism",
        "models/gpt.py",
        "        if self.cfg.moe_every:  # the load-balancing losses of this forward's MoE blocks",
        "        if self.cfg.moe_every and topo is None:",
        (
            "tests/test_moe.py::"
            "test_expert_parallel_gpt_beside_tensor_parallelism_matches_single_process[2-False]",
        ),
    ),
    Mutant(
        "Ulysses positions start at 0 on every sp rank",
        "models/gpt.py",
        'pos = sequence_piece(whole, 0, topo.rank("sp"), sp, topo.ring)',
        "pos = whole[:t]",
        ("tests/test_ulysses.py::test_gpt_matches_single_process[2-2-1-0-False]",),
    ),
    Mutant(
        "the GPT's attention is left unwired under sp",
        "models/gpt_tp.py",
        "    if topology.ulysses > 1:  # [b, t, heads",
        "    if False:  # [b, t, heads",
        ("tests/test_ulysses.py::test_gpt_matches_single_process[2-2-1-0-False]",),
    ),
    Mutant(
        "a pipeline stage's positions start at 0 on every Ulysses shard",
        "models/gpt_pipe.py",
        'pos = sequence_piece(whole, 0, topo.rank("sp"), topo.sp, topo.ring)',
        "pos = whole[:n]",
        ("tests/test_ulysses.py::test_gpt_under_a_pipeline_matches_single_process[1f1b]",),
    ),
    Mutant(
        "a pipeline's blocks are built without the Ulysses grid (each attends within its shard)",
        "models/gpt_pipe.py",
        "    grid = (topology if topology is not None and topology.sp > 1 else tp, extra[1])",
        "    grid = extra",
        ("tests/test_ulysses.py::test_gpt_under_a_pipeline_matches_single_process[1f1b]",),
    ),
    Mutant(
        "the MoE GPT's loss leaves the auxiliary loss out",
        "models/gpt.py",
        "loss = loss + self.cfg.moe_aux_loss_coef * aux",
        "loss = loss + 0.0 * aux",
        (
            "tests/test_moe.py::"
            "test_the_loss_carries_the_auxiliary_loss_and_drops_happen_where_asked",
        ),
    ),
    Mutant(
        "pre-LN BERT layer normalises its input with the pre-MLP norm",
        "models/bert_layer.py",
        'mid = x + attention_block(norm(x, "norm_w", "norm_b"))',
        'mid = x + attention_block(norm(x, "attn_nw", "attn_nb"))',
        (
            "tests/test_bert_layer.py::"
            "test_pre_ln_matches_modelingpreln_bert_layer_forward_and_gradients[False]",
        ),
    ),
    Mutant(
        "BERT layer attention takes the k rows for q",
        "models/bert_layer.py",
        "    q, k, v = F.linear(x, qkvw, qkvb)",
        "    k, q, v = F.linear(x, qkvw, qkvb)",
        (
            "tests/test_bert_layer.py::"
            "test_post_ln_matches_hugging_face_bert_layer_forward_and_gradients[False]",
        ),
    ),
    Mutant(
        "BERT layer adjusts the output init std on every rank",
        "models/bert_layer.py",
        "if adjust_init_range and c.local_rank == 0:",
        "if adjust_init_range:",
        ("tests/test_bert_layer.py::test_default_initialisation_is_deepspeeds[-1-True-False]",),
    ),
    Mutant(
        "BERT layer drops out under no_grad in training mode",
        "models/bert_layer.py",
        "dropout = self.training and torch.is_grad_enabled()",
        "dropout = self.training",
        (
            "tests/test_bert_layer.py::test_dropout_in_training_only_while_autograd_records"
            "[attn_dropout_ratio-False]",
        ),
    ),
    Mutant(
        "evoformer: Q and K swapped",
        "models/evoformer.py",
        "heads_first(q),\n        heads_first(k),",
        "heads_first(k),\n        heads_first(q),",
        ("tests/test_evoformer.py::test_msa_row_attention_with_mask_and_pair_bias",),
    ),
    Mutant(
        "evoformer: the sum of two biases drops bias1",
        "models/evoformer.py",
        "full = bias2 if bias1 is None else bias1 + bias2",
        "full = bias2",
        ("tests/test_evoformer.py::test_msa_row_attention_with_mask_and_pair_bias",),
    ),
    Mutant(
        "evoformer: a lone bias1 broadcast over queries, not keys",
        "models/evoformer.py",
        "return bias1.reshape(b * n, 1, 1, seq)",
        "return bias1.reshape(b * n, 1, seq, 1)",
        ("tests/test_evoformer.py::test_one_bias_or_none[bias1]",),
    ),
]
