"""The mutation gate: plant each known bug in a copy of src/ and check that the tests catch it.

    python scripts/mutants.py                # every mutant; ends with "N killed, 0 survived"
    python scripts/mutants.py --check        # seconds: every mutant's text and tests still exist
    python scripts/mutants.py --budget 1500  # as many as 1500 s allow, from a rotation set by
                                             # the commit, so successive commits cover others
    python scripts/mutants.py --changed REV  # every mutant whose file or tests changed since REV
    python scripts/mutants.py --list         # the mutants and the tests meant to catch each
    python scripts/mutants.py -k norm        # only mutants whose name contains "norm"
    python scripts/mutants.py --baseline     # first check those tests pass on the real source

A mutant is one exact text replacement in one file under src/zerostack (the text must occur
exactly once, so a refactor that moves it makes the gate fail loudly instead of testing nothing).
The copy is put first on PYTHONPATH, so the test processes (forkserver ranks, torchrun workers)
import the mutated package. A mutant is killed when its tests fail; it survives when they pass.
Exit status: 0 when every mutant run is killed, 1 otherwise (a survivor fails every mode).

Every new feature adds the bugs its tests exist to catch here, and the gate stays at 0 survivors.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # under src/zerostack
    old: str
    new: str
    tests: tuple[str, ...]


P = "tests/test_parity.py::test_matches_single_process_at_every_step"
M = "tests/test_mixed_precision.py"
C = "tests/test_checkpoint.py"
E = "tests/test_stage3_edges.py::test_stage3_matches_single_process"
T = "tests/test_memory.py::test_live_storage_census_matches_the_zero_formulas"
T_CENSUS2 = f"{T}[2]"
T_COMPILE = "tests/test_compile.py::test_compiled_blocks_train_as_eager_bit_for_bit"
T_COMPILE_VARIANTS = (
    "tests/test_compile.py::test_compiled_parallel_checkpointed_and_llama_blocks_train_as_eager"
)
S = "tests/test_pipeline_schedule.py::test_the_executor_runs_exactly_what_the_simulator_accepts"
CD = "tests/test_comm_dtype.py"
HF = "tests/test_hf.py"
LIVE = "tests/test_stage3_live.py"
U = "tests/test_ulysses.py"
MOE = "tests/test_moe.py"
RING = "tests/test_ring.py"
TILED = "tests/test_tiled.py"
HFU = "tests/test_hf_ulysses.py"
RG = "tests/test_ring_grid.py"
HFL = "tests/test_hf_long.py::test_tiled_mlp_tiled_loss_and_cpu_checkpoints_match_single_process"
HFR = "tests/test_hf_ring.py::test_alst_with_ring_matches_single_process_training_at_zero_3"
PIPE = "tests/test_pipeline.py"
SPECS = "tests/test_autotp_specs.py::"
DA = "tests/test_data_analyzer.py::"
TA = "tests/test_torch_autocast.py::"
OC = "tests/test_one_cycle.py::"
LTD = "tests/test_token_drop.py::"
SPIKE = "tests/test_loss_spike.py::test_a_spike_rolls_back_to_the_last_good_checkpoint_and_skips_it"
CUDA = "tests/test_cuda_path.py::test_the_cuda_path_runs_and_matches_the_cpu_run"
CUDA_RNG = "tests/test_cuda_path.py::test_with_dropout_on_the_device_generator"
SPIKE_ERR = "tests/test_loss_spike.py::test_a_spike_that_cannot_roll_back_is_every_ranks_error"

LEAF = "tests/test_leaf_modules.py::test_a_leaf_moe_block_is_one_gather_and_trains_as_one_process"
EXTERNAL = (
    "tests/test_leaf_modules.py::test_a_registered_external_parameter_is_gathered_with_its_user"
)
T_OFFLOAD_ROUND = (
    "tests/test_offload_states.py::"
    "test_offloaded_states_leave_the_device_and_training_continues_bit_for_bit"
)
T_OFFLOAD_INPUTS = (
    "tests/test_offload_activations.py::"
    "test_hidden_states_leave_the_device_and_gradients_are_unchanged"
)
T_DS_RESUME = (
    "tests/test_deepspeed_checkpoints.py::test_a_deepspeed_folder_resumes_with_deepspeeds_next_losses"
)
T_ACCESSORS = "tests/test_ds_runtime_helpers.py::test_engine_accessors_answer_as_deepspeeds"
TRL_HOOKS = "tests/test_trl.py::test_hooks_taken_off_and_put_back_with_trls_functions"
T_FACADE_KEYS = (
    "tests/test_config_keys.py::test_deepspeed_initialize_warns_and_zerostack_initialize_refuses"
)
T_RAISED = (
    "tests/test_watchdog.py::test_the_verdict_and_the_traceback_reach_the_log_when_a_rank_raises"
)

T_APART = "tests/test_cuda_path.py::test_device_and_host_bytes_are_reported_apart"
T_CONTROLS = (
    "tests/test_engine_surface.py::test_no_sync_and_manual_boundary_accumulate_like_one_batch"
)

T_QWZ_PARITY = (
    "tests/test_zeropp.py::test_qwz_trains_at_the_quantized_weights_and_keeps_exact_masters"
)
T_QWZ_BYTES = "tests/test_zeropp.py::test_qwz_gathers_under_a_third_of_the_bytes"
T_QWZ_ROUND = "tests/test_zeropp.py::test_a_round_trip_is_within_half_a_step_of_the_block_scale"
T_QWZ_PACK = "tests/test_zeropp.py::test_a_payload_holds_every_piece_and_its_size_is_the_formula"
T_QGZ = (
    "tests/test_zeropp.py::"
    "test_qgz_trains_at_the_quantized_gradients_and_moves_under_a_third_of_the_bytes"
)
T_QWZ_REFUSED = "tests/test_zeropp.py::test_zeropp_is_refused_outside_stage_3"
T_HPZ_REFUSED = (
    "tests/test_zeropp.py::test_an_hpz_size_that_does_not_divide_dp_is_refused_at_initialize"
)
T_HPZ = "tests/test_zeropp.py::test_hpz_gathers_the_backward_within_pairs_and_changes_no_bit"

T_WAITS = "tests/test_cuda_path.py::test_a_step_on_the_device_waits_only_for_its_norm"
T_SGD_CLIP = "tests/test_data_parallel.py::test_clipping_with_sgd"
T_SIDE = "tests/test_cuda_path.py::test_offloaded_pieces_go_up_on_a_side_stream"
T_SCRATCH = "tests/test_scratch.py::test_stage3_gathers_gradients_and_staging_are_outside_the_heap"
T_READ_AHEAD = "tests/test_offload.py::test_nvme_pieces_are_read_ahead_off_the_training_thread"
T_DOWN_SIDE = "tests/test_cuda_path.py::test_offloaded_gradients_come_down_on_a_side_stream"
T_ALIGN = "tests/test_cuda_path.py::test_every_collective_buffer_starts_16_byte_aligned"
T_ALIGNED_LAYOUT = "tests/test_partition.py::test_engine_layouts_align_every_piece_to_16_bytes"
T_LAYERS = "tests/test_architecture.py::test_the_layers_contract_is_kept"
T_NO_CYCLE = (
    "tests/test_architecture.py::test_no_import_cycle_even_through_imports_inside_functions"
)
T_STAGING = "tests/test_cuda_path.py::test_a_staging_buffer_is_written_again_only_after_its_copy"
T_OFFLOAD_WAITS = (
    "tests/test_cuda_path.py::test_offloading_queues_its_uploads_and_waits_only_for_the_gradients"
)
T_SHUTDOWN = "tests/test_topology.py::test_shutdown_ends_the_gloo_threads_while_the_engine_lives"
T_INT4 = (
    "tests/test_zeropp.py::"
    "test_int4_qgz_trains_at_its_coarser_gradients_and_moves_seven_times_fewer_bytes"
)
T_INT4_WIRE = "tests/test_zeropp.py::test_an_int4_payload_holds_two_values_to_a_byte"
T_INT4_ROUND = (
    "tests/test_zeropp.py::test_an_int4_round_trip_is_within_half_a_step_of_the_block_scale"
)
T_ODD = "tests/test_zero_models.py::test_odd_sizes_and_an_unused_parameter[2-2-AdamW]"
T_BY_BUCKET = "tests/test_stage2_live.py::test_each_bucket_is_gathered_as_soon_as_it_is_stepped"
T_POISON = "tests/test_zero_models.py::test_stage2_reuses_buffers_without_their_old_values"
T_ALIKE = "tests/test_initialize.py::test_every_rank_starts_from_dp_rank_0s_weights"
T_PEAK = "tests/test_cuda_path.py::test_the_start_peaks_near_the_steady_state"
T_SCALE_WRT_GAS = (
    "tests/test_engine_surface.py::"
    "test_backward_scale_wrt_gas_false_leaves_the_division_to_the_caller"
)
T_CONFIG_VIEW = (
    "tests/test_engine_surface.py::"
    "test_engine_config_reads_as_deepspeeds_dict_and_as_the_typed_config"
)
DSN = "tests/test_deepspeed_name.py"
T_SERVED = f"{DSN}::test_the_runner_serves_deepspeed_to_the_libraries_and_nothing_else"
T_ZERO_TO_FP32 = f"{DSN}::test_zero_to_fp32_gives_the_engines_weights"
T_HF_TRAINER = "tests/test_hf_trainer.py::test_trainer_losses_and_reload_equal_deepspeeds"
LT = "tests/test_lightning.py"
T_LT_DDP = f"{LT}::test_native_strategy_steps_as_ddp[3]"
T_LT_RESUME = f"{LT}::test_native_strategy_resumes_and_validates_its_checkpoints"
T_LT_DS = f"{LT}::test_deepspeed_strategy_under_the_runner_equals_deepspeed[stage3_gas2_sgd]"
T_PICKLED = f"{C}::test_pickled_client_state_is_opt_in_and_verified"
T_FORWARD_ONLY = "tests/test_initialize.py::test_no_optimizer_is_a_forward_only_engine"
DW = "tests/test_deepspeed_write.py"
T_QFROZEN = (
    "tests/test_quantized_frozen.py::test_frozen_pieces_are_int8_blocks_and_training_is_the_"
    "quantized_models[0]"
)
T_DS_SURFACE = (
    "tests/test_engine_surface.py::test_deepspeed_optimizer_backward_throughput_timer_and_ds_tensor"
)
T_DS_WRITE = f"{DW}::test_a_deepspeed_folder_saved_again_is_deepspeeds_bit_for_bit"

MUTANTS = [
    Mutant(
        "deepspeed.utils.groups answers sp 1 after an sp engine is built",
        "compat/deepspeed/utils/groups.py",
        "    return _sp().sp if _sp() is not None else 1",
        "    return 1",
        (f"{HFR}[2-2-False]",),
    ),
    Mutant(
        "ring attention: a row with no key seen yet takes exp(-inf + inf) (nan)",
        "sequence/ring.py",
        '                safe = new.masked_fill(new == float("-inf"), 0.0)',
        "                safe = new",
        (f"{RING}::test_packed_documents_attend_only_within_themselves[True-2-3]",),
    ),
    Mutant(
        "ring attention computes the tiles wholly above the causal diagonal",
        "sequence/ring.py",
        "                if masked and c.start > r.stop - 1:",
        "                if False:",
        (f"{RING}::test_causal_blocks_cover_exactly_the_causal_mask_and_balance_the_work[2-3]",),
    ),
    Mutant(
        "ring attention: a tile straddling the diagonal is taken for wholly past (unmasked)",
        "sequence/ring.py",
        "                yield r, c, masked and c.stop - 1 > r.start",
        "                yield r, c, masked and c.stop - 1 > r.stop",
        (f"{RING}::test_causal_blocks_cover_exactly_the_causal_mask_and_balance_the_work[2-3]",),
    ),
    Mutant(
        "the tiled logits loss leaves ZeRO-3's compute_params released while the tiles run",
        "sequence/tiled.py",
        "        with GatheredParameters(list(compute_params or ())):",
        "        with GatheredParameters([]):",
        (f"{HFL}[2-2-3]",),
    ),
    Mutant(
        "ZeRO-3 hooks only modules with parameters of their own (an MLP called alone borrows none)",
        "zero/coordinator.py",
        "        out.append(m)\n",
        "        if list(m.parameters(recurse=False)) or m is root:\n            out.append(m)\n",
        (f"{HFL}[2-2-3]",),
    ),
    Mutant(
        "a Hugging Face model's checkpointed layers keep torch's checkpoint (no CPU copies)",
        "compose.py",
        "        activation_checkpointing.adopt_model_checkpointing(model)  #",
        "        pass  #",
        (f"{HFL}[2-2-1]",),
    ),
    Mutant(
        "cpu_checkpointing on a model that checkpoints nothing is accepted",
        "validate.py",
        "            and not model_checkpointed_layers(model)):  # fmt: skip",
        "            and False):  # fmt: skip",
        (
            "tests/test_hf_long.py::test_cpu_checkpointing_on_a_model_that_checkpoints_nothing_is_"
            "refused",
        ),
    ),
    Mutant(
        "HF ring: packed rows are taken for one running sequence (no document ids)",
        "sequence/hf_ulysses.py",
        "    if not starts.any():\n        return None\n",
        "    return None\n",
        (f"{HFR}[2-2-True]",),
    ),
    Mutant(
        "HF ring: the adapter cuts consecutive shards, not the ring's zigzag pieces",
        "sequence/hf_data.py",
        "        self.ring = RINGS.get(sp_group, 1)",
        "        self.ring = 1",
        (f"{HFR}[2-2-False]",),
    ),
    Mutant(
        "HF ring: the core attention runs on the ring shard alone",
        "sequence/hf_ulysses.py",
        "            if self.ring is not None:\n",
        "            if False:\n",
        (f"{HFR}[2-2-False]",),
    ),
    Mutant(
        "HF Ulysses x ring: the all-to-alls run over every sp rank, not the Ulysses group",
        "sequence/hf_ulysses.py",
        '            process_group=topo.group("ulysses") if topo.ulysses > 1 else None,',
        '            process_group=topo.group("sp"),',
        (f"{HFR}[4-2-False]",),
    ),
    Mutant(
        "ring attention: the keys' document ids stay home (each step masks with the queries')",
        "sequence/ring.py",
        "apart = (docs[0][:, rows, None] != docs[1][:, None, cols])",
        "apart = (docs[0][:, rows, None] != docs[0][:, None, cols])",
        (f"{RING}::test_packed_documents_attend_only_within_themselves",),
    ),
    Mutant(
        "sequence_piece: a rank's ring shard is picked by rank % ring, not rank // ulysses",
        "sequence/ring.py",
        "return zigzag_shard(x, rank // u, ring, dim).chunk(u, dim=dim)[rank % u]",
        "return zigzag_shard(x, rank % ring, ring, dim).chunk(u, dim=dim)[rank % u]",
        (f"{RG}::test_gpt_under_ring_attention_matches_single_process[4-4-2-3-False]",),
    ),
    Mutant(
        "the ring groups are the Ulysses neighbours (stride ring, not ulysses)",
        "topology.py",
        "ranks = [int(mesh[p, run * self.sp + g * u + j, e, t]) for g in range(self.ring)]",
        "ranks = [int(mesh[p, run * self.sp + g + j * self.ring, e, t]) for g in range(self.ring)]",
        ("tests/test_topology.py::test_ring_and_ulysses_axes_split_the_sp_ranks",),
    ),
    Mutant(
        "a rank's ring coordinate is its sp rank modulo ring",
        "topology.py",
        '            return self.rank("sp") // self.ulysses',
        '            return self.rank("sp") % self.ring',
        ("tests/test_topology.py::test_ring_and_ulysses_axes_split_the_sp_ranks",),
    ),
    Mutant(
        "the GPT attends within its ring shard (ring attention never called)",
        "models/gpt.py",
        "        if self.ring is not None:  # over the ring's zigzag shards",
        "        if False:  # over the ring's zigzag shards",
        (f"{RG}::test_gpt_under_ring_attention_matches_single_process[2-2-2-0-True]",),
    ),
    Mutant(
        "Ulysses under a ring exchanges over the whole sp group",
        "sequence/layer.py",
        'return cf.on_axis(comm_for(group), "sp" if group.ring == 1 else "ulysses")',
        'return cf.on_axis(comm_for(group), "sp")',
        (f"{RG}::test_gpt_under_ring_attention_matches_single_process[4-4-2-2-True]",),
    ),
    Mutant(
        "the GPT's heads must split over all sp ranks, ring ones too",
        "models/gpt_tp.py",
        "    tp, sp = topology.tp, topology.ulysses  # the ring ranks keep every head",
        "    tp, sp = topology.tp, topology.sp  # the ring ranks keep every head",
        (f"{RG}::test_bad_ring_grids_are_refused_naming_the_keys",),
    ),
    Mutant(
        "ring_parallel_size that disagrees with the given topology is accepted",
        "compose.py",
        '    if ring != topo.ring and ("ring_parallel_size" in cfg.model_fields_set or ring > 1):',
        "    if False:",
        (f"{RG}::test_bad_ring_grids_are_refused_naming_the_keys",),
    ),
    Mutant(
        "a model wired for ring attention alone is refused as unwired",
        "sequence/check.py",
        "    if rings and topo.ulysses == 1:\n        return False\n",
        "",
        (f"{RG}::test_gpt_under_ring_attention_matches_single_process[2-2-2-3-False]",),
    ),
    Mutant(
        "GPT dropout is accepted under ring attention (and silently not applied)",
        "models/gpt_tp.py",
        "    if topology.ring > 1 and cfg.dropout > 0:",
        "    if False:",
        (f"{RG}::test_bad_ring_grids_are_refused_naming_the_keys",),
    ),
    Mutant(
        "HF Ulysses: the all-to-all scatters the sequence and gathers the heads (swapped)",
        "sequence/hf_ulysses.py",
        "        q, k, v = (self._heads(t, 1, 2) for t in (query, key, value))",
        "        q, k, v = (self._heads(t, 2, 1) for t in (query, key, value))",
        (f"{HFU}::test_alst_script_matches_single_process_training[3]",),
    ),
    Mutant(
        "HF Ulysses: the data loader adapter gives every sp rank the first shard",
        "sequence/hf_data.py",
        "v = sequence_piece(v, 1, self.sp_rank, sp, ring).cpu().contiguous()",
        "v = sequence_piece(v, 1, 0, sp, ring).cpu().contiguous()",
        (f"{HFU}::test_alst_script_matches_single_process_training[1]",),
    ),
    Mutant(
        "HF Ulysses: the loss is each shard's own mean, averaged (not the tokens' mean)",
        "sequence/hf_data.py",
        "    count = cf.reduce(count, axis)\n    total = cf.reduce(cf.copy(total, axis), axis)\n"
        "    return total / count.clamp_min(1)",
        "    mean = total / count.clamp_min(1)\n"
        "    return cf.reduce(cf.copy(mean, axis), axis) / axis.size",
        (f"{HFU}::test_loss_is_the_mean_over_every_shards_labelled_tokens",),
    ),
    Mutant(
        "HF Ulysses: packed documents attend across their boundaries",
        "sequence/hf_ulysses.py",
        "            attention_mask = _document_mask(positions.expand(q.shape[0], -1))",
        "            attention_mask = None",
        (f"{HFU}::test_mqa_and_packed_documents_match_whole_sequence_attention",),
    ),
    Mutant(
        "the scratch pool hands a buffer back in the shape it was given (a matrix for a row)",
        "core/scratch.py",
        "            t = t.view(-1)  # taken back flat, whatever shape it was given in (a matrix)",
        "            pass",
        ("tests/test_scratch.py::test_a_buffer_given_back_as_a_matrix_is_taken_flat",),
    ),
    Mutant(
        "tiled compute: a tile's parameter gradient written over the others', not summed",
        "sequence/tiled.py",
        "self.acc[j] = self.acc[j].add_(g) if self.owned[j] else self.acc[j] + g",
        "self.acc[j] = g",
        (f"{TILED}::test_tiled_mlp_matches_untiled[True-4]",),
    ),
    Mutant(
        "tiled logits loss: the mean over tiles, not over the counted tokens",
        "sequence/tiled.py",
        'w = count / total if reduction == "mean" else 1.0',
        'w = 1 / len(tiles) if reduction == "mean" else 1.0',
        (f"{TILED}::test_fused_logits_loss_mean_is_over_labels_not_tiles",),
    ),
    Mutant(
        "tiled compute: backward recomputes every tile from the first tile's input",
        "sequence/tiled.py",
        "xt = x.narrow(-2, start, size).detach().requires_grad_(need_x)",
        "xt = x.narrow(-2, 0, size).detach().requires_grad_(need_x)",
        (f"{TILED}::test_tiled_mlp_matches_untiled[True-5]",),
    ),
    Mutant(
        "tiled compute: the positions of an uneven split's remainder dropped",
        "sequence/tiled.py",
        "    sizes = [step + (1 if i < extra else 0) for i in range(shards)]",
        "    sizes = [step for i in range(shards)]",
        (f"{TILED}::test_tiled_mlp_matches_untiled[True-5]",),
    ),
    Mutant(
        "a refusal on one rank is not handed to the others (they wait in the engine)",
        "validate.py",
        '    refusals = [r for r in _posted(str(mine) if mine else "", grid) if r]',
        "    refusals = [str(mine)] if mine else []",
        (f"{PIPE}::test_a_refusal_on_one_stage_is_every_stages",),
    ),
    Mutant(
        "ring attention: partial results merged without rescaling to the running maximum",
        "sequence/ring.py",
        "acc[..., rows, :] = acc[..., rows, :] * alpha.unsqueeze(-1) + p @ vf[..., cols, :]",
        "acc[..., rows, :] = acc[..., rows, :] + p @ vf[..., cols, :]",
        (f"{RING}::test_ring_attention_is_attention_over_the_whole_sequence[2-comm]",),
    ),
    Mutant(
        "ring attention: the zigzag chunks in the other order (late chunk first)",
        "sequence/ring.py",
        "    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)",
        "    return torch.cat([chunks[2 * world - 1 - rank], chunks[rank]], dim=dim)",
        (f"{RING}::test_zigzag_chunk_order_for_two_and_four_ranks",),
    ),
    Mutant(
        "ring attention: the diagonal blocks unmasked (queries see later keys)",
        "sequence/ring.py",
        "        return [(early, early, True), (late, every, True)]",
        "        return [(early, early, False), (late, every, False)]",
        (f"{RING}::test_causal_blocks_cover_exactly_the_causal_mask_and_balance_the_work[2-None]",),
    ),
    Mutant(
        "ring attention: the keys' and values' gradients not sent home at the end",
        "sequence/ring.py",
        "        dk, dv = axis.ring_shift([dk, dv])",
        "        dk, dv = dk, dv",
        (f"{RING}::test_ring_attention_is_attention_over_the_whole_sequence[2-group]",),
    ),
    Mutant(
        "Megatron SP beside experts: the gate's and experts' gradients not summed over tp",
        "models/gpt_tp.py",
        "        sum_grads_over_tp(mlp, topology)",
        "        pass",
        (
            f"{MOE}::test_expert_parallel_gpt_beside_tensor_parallelism_matches_single_process[1-True]",
        ),
    ),
    Mutant(
        "Megatron SP beside experts: the tp parts' auxiliary losses summed, not averaged",
        "models/gpt.py",
        "                aux = aux / topo.tp",
        "                aux = aux",
        (
            f"{MOE}::test_expert_parallel_gpt_beside_tensor_parallelism_matches_single_process[1-True]",
        ),
    ),
    Mutant(
        "Megatron SP beside experts under a pipeline: a block's side loss not divided by tp",
        "models/gpt_pipe.py",
        "            self.coef /= topology.tp",
        "            self.coef /= 1",
        (f"{MOE}::test_megatron_sp_beside_experts_under_a_pipeline_on_8_ranks[1f1b-1]",),
    ),
    Mutant(
        "estimate --sp: the activations of the whole sequence on every Ulysses rank",
        "estimate/report.py",
        "    if sp == 1:\n        return model",
        "    if True:\n        return model",
        ("tests/test_estimate.py::test_ulysses_holds_the_activations_of_its_sequence_shard",),
    ),
    Mutant(
        "estimate --ep: every rank holds all the experts",
        "estimate/report.py",
        "    own_experts = _ceil_div(int(experts), layout.ep * layout.pp)",
        "    own_experts = _ceil_div(int(experts), layout.pp)",
        ("tests/test_estimate.py::test_expert_parallel_layouts_through_the_command_line",),
    ),
    Mutant(
        "the norm skips the shared pieces off ep rank 0 (at stages 1-3 each rank holds its own)",
        "engine/replicas.py",
        "            held = held | (self._ep_replicas - cut_over_ep)",
        "            held = held | self._ep_replicas",
        (f"{MOE}::test_expert_parallel_gpt_matches_single_process[dp2xep2-top1-drops-stage1]",),
    ),
    Mutant(
        "the dp_ep axis ranks this rank ep-major (its pieces in another rank's place)",
        "topology.py",
        '            return self.dp_rank * self.ep + self.rank("ep")',
        '            return self.rank("ep") * self.dp + self.dp_rank',
        (f"{MOE}::test_expert_parallel_gpt_matches_single_process[dp2xep2-top1-drops-stage1]",),
    ),
    Mutant(
        "stage 3: parameters cut over two axes gathered in one collective over the first",
        "zero/gathers.py",
        "    if len(set(keys)) > 1:  # one collective per axis and kind, in one order on all ranks",
        "    if False:",
        (f"{MOE}::test_expert_parallel_gpt_matches_single_process[dp2xep2-top2-drops-stage3]",),
    ),
    Mutant(
        "stage 3: a piece's record for a gather loses its cut (gathered over dp)",
        "zero/params.py",
        '        cut = {"axis": self.axis, "world": self.world, "rank": self.rank}',
        "        cut = {}",
        (f"{MOE}::test_expert_parallel_gpt_matches_single_process[dp2xep2-top2-drops-stage3]",),
    ),
    Mutant(
        "stage 3: every gradient staged in the dp axis's reducer",
        "zero/stage3.py",
        "        reducer = self.reducers[p._zs.axis]",
        "        reducer = self.reduce",
        (f"{MOE}::test_expert_parallel_gpt_matches_single_process[dp2xep2-top2-drops-stage3]",),
    ),
    Mutant(
        "stages 1-2: a bucket's update gathered over dp, not its own cut's axis",
        "zero/write_back.py",
        "        handle = self.comm.all_gather(full, src, axis=fg.cut.axis, async_op=True)",
        '        handle = self.comm.all_gather(full, src, axis="dp", async_op=True)',
        (f"{MOE}::test_expert_parallel_gpt_matches_single_process[dp2xep2-top1-drops-stage1]",),
    ),
    Mutant(
        "estimate at ep > 1: the shared state cut over dp only",
        "estimate/memory.py",
        "        shared = model_states(trained - experts, replace(own, dp=layout.dp * layout.ep))",
        "        shared = model_states(trained - experts, own)",
        ("tests/test_estimate.py::test_estimate_matches_live_engines",),
    ),
    Mutant(
        "a MoE model built under zero.Init accepted (its first forward fails)",
        "validate.py",
        "    if any(is_sharded(p) for p in params) and any(is_moe_param(p) for p in params):",
        "    if False:",
        (f"{MOE}::test_a_moe_model_built_under_zero_init_is_refused",),
    ),
    Mutant(
        "zero.Init's pieces kept though cut over other ranks than the grid's",
        "zero/params.py",
        "        elif (p._zs.world, p._zs.rank) != (topo.size(axis), topo.rank(axis)):",
        "        elif False:",
        (f"{MOE}::test_pieces_cut_over_other_ranks_than_the_grids_are_refused",),
    ),
    Mutant(
        "hpZ beside expert parallelism accepted (its partitions were never built for it)",
        "validate.py",
        "    if topo.ep > 1 and cfg.zero_optimization.zero_hpz_partition_size > 1:",
        "    if False:",
        (f"{MOE}::test_hpz_beside_expert_parallelism_is_refused",),
    ),
    Mutant(
        "stage 2 under a pipeline reduces once per batch, as stage 1 (no backward bracketed)",
        "zero/sharded_optimizer.py",
        "        self.reduces_each_backward = self.grads.every_micro_step",
        "        self.reduces_each_backward = False",
        (
            "tests/test_stage2_live.py::"
            "test_stage_2_under_a_pipeline_holds_a_shard_of_the_gradients",
        ),
    ),
    Mutant(
        "stage 2 under a pipeline: the tied weight's gradient is not summed between the stages",
        "pipeline/runner.py",
        "(a gather over dp)\n"
        '                    self.comm.all_reduce(grad, axis="tied", group=tie.group)\n',
        "(a gather over dp)\n",
        (f"{P}[pp2xdp2]",),
    ),
    Mutant(
        "the watchdog's stop leaves its wake sockets open (two descriptors an engine)",
        "watchdog/__init__.py",
        "            self._selector.close()\n            self._wake_r.close()\n",
        "            self._selector.close()\n",
        (
            "tests/test_watchdog.py::"
            "test_sigusr1_is_heard_above_descriptor_1023_and_stop_closes_what_it_opened",
        ),
    ),
    Mutant(
        "a pipeline stage before the last drops its MoE blocks' auxiliary loss",
        "pipeline/executor.py",
        "        elif side is None:\n            torch.autograd.backward(out,",
        "        elif True:\n            torch.autograd.backward(out,",
        (f"{MOE}::test_expert_parallel_gpt_under_a_pipeline_matches_single_process[1f1b-1]",),
    ),
    Mutant(
        "the last pipeline stage drops its MoE blocks' auxiliary loss",
        "pipeline/executor.py",
        "            loss = out.float() if side is None else out.float() + side.float()",
        "            loss = out.float()",
        (
            f"{MOE}::test_expert_parallel_gpt_under_a_pipeline_matches_single_process[interleaved-3]",
        ),
    ),
    Mutant(
        "a pipeline stage at ep > 1 loads the first experts, not its own",
        "models/gpt_pipe.py",
        "            if found and topo.ep > 1:",
        "            if False:",
        (f"{MOE}::test_expert_parallel_gpt_under_a_pipeline_matches_single_process[1f1b-1]",),
    ),
    Mutant(
        "with ep and Ulysses, the sp ranks of a batch read different batches",
        "topology.py",
        '        return self.dp_rank // self.sp * self.ep + self.rank("ep")',
        '        return self.dp_rank * self.ep + self.rank("ep")',
        (f"{MOE}::test_expert_parallel_gpt_with_ulysses_matches_single_process[1]",),
    ),
    Mutant(
        "MoE at stage 3: what every ep rank holds is cut and reduced over dp only",
        "zero/params.py",
        '        axis = "dp_ep" if p in wide else "dp"',
        '        axis = "dp"',
        (f"{MOE}::test_expert_parallel_gpt_matches_single_process[dp2xep2-top2-drops-stage3]",),
    ),
    Mutant(
        "MoE at stage 3: the shared pieces' sum over dp x ep is not divided by ep",
        "zero/stage3_reduce.py",
        "            prescale=prescale * comm.topo.dp / comm.topo.size(axis),",
        "            prescale=prescale,",
        (f"{MOE}::test_expert_parallel_gpt_matches_single_process[dp2xep2-top2-drops-stage3]",),
    ),
    Mutant(
        "ZeRO-3 under a pipeline: the tied weight's pieces are not summed between the stages",
        "pipeline/runner.py",
        '                    self.comm.all_reduce(piece, axis="tied", group=tie.group)',
        "                    pass",
        (f"{PIPE}::test_gpt_pipeline_under_zero3_matches_single_process[1f1b]",),
    ),
    Mutant(
        "ZeRO-3 under a pipeline: a backward's gradients are not reduced as it ends",
        "pipeline/runner.py",
        "            around = (zero.begin_backward, zero.end_backward)",
        "            zero.begin_backward(False)",
        (f"{PIPE}::test_gpt_pipeline_under_zero3_matches_single_process[1f1b]",),
    ),
    Mutant(
        "the pipeline executor calls a chunk past its module's hooks (ZeRO-3 cannot gather)",
        "pipeline/executor.py",
        "        out = self.module(x, chunk)\n        side = ",
        "        out = self.module.forward_chunk(chunk, x)\n        side = ",
        (f"{PIPE}::test_gpt_pipeline_under_zero3_matches_single_process[1f1b]",),
    ),
    Mutant(
        "ZeRO-3 under a pipeline: no backward is its chunk's last (NVMe gradients lose their norm)",
        "pipeline/executor.py",
        "            self.around_backward[0](self.last_backward[chunk] == (mb, chunk))",
        "            self.around_backward[0](False)",
        (f"{P}[pp2xdp2-offload-nvme]",),
    ),
    Mutant(
        "the GPT's loss leaves the MoE auxiliary loss out under tensor parallelism",
        "models/gpt.py",
        "        if self.cfg.moe_every:  # the load-balancing losses of this forward's MoE blocks",
        "        if self.cfg.moe_every and topo is None:",
        (
            f"{MOE}::test_expert_parallel_gpt_beside_tensor_parallelism_matches_single_process[2-False]",
        ),
    ),
    Mutant(
        "the deepspeed distribution is not found (the libraries think DeepSpeed is absent)",
        "compat/serve.py",
        '        if wanted is None or wanted.lower().replace("-", "_") == self.name:',
        "        if wanted is None:",
        (T_SERVED,),
    ),
    Mutant(
        "deepspeed.zero is a second copy, not zerostack.zero (aliases ignored)",
        "compat/serve.py",
        "                return self.aliases[prefix] + fullname[len(prefix) :]",
        "                break",
        (T_SERVED,),
    ),
    Mutant(
        "a real DeepSpeed in the environment is shadowed silently",
        "compat/serve.py",
        "    if real is not None:\n        raise ServeError(",
        "    if False:\n        raise ServeError(",
        (f"{DSN}::test_a_real_deepspeed_is_never_shadowed",),
    ),
    Mutant(
        "install() after transformers is imported is not refused",
        "compat/serve.py",
        "    if early:\n",
        "    if False:\n",
        (f"{DSN}::test_install_after_the_libraries_is_refused",),
    ),
    Mutant(
        "the runner leaves the process groups to interpreter exit",
        "as_deepspeed.py",
        "        _tear_down()\n        raise\n    _tear_down()\n",
        "        raise\n",
        (f"{DSN}::test_the_runner_tears_the_groups_down_when_the_script_ends_well",),
    ),
    Mutant(
        "zero_to_fp32 leaves out the tied weight's second name",
        "checkpoint/consolidate.py",
        "        if name in out:\n            out[alias] = out[name]",
        "        pass",
        (T_ZERO_TO_FP32,),
    ),
    Mutant(
        "zero_to_fp32 keeps frozen parameters when asked to leave them out",
        "checkpoint/consolidate.py",
        'skip = set(manifest.get("frozen", [])) if exclude_frozen else set()',
        "skip = set()",
        (T_ZERO_TO_FP32,),
    ),
    Mutant(
        "FusedAdam(adam_w_mode=False) decays decoupled (AdamW), not L2",
        "compat/deepspeed/ops/adam.py",
        "decoupled_weight_decay=adam_w_mode,",
        "decoupled_weight_decay=True,",
        (f"{DSN}::test_fused_adam_is_torch_adam_with_deepspeeds_arguments",),
    ),
    Mutant(
        "clone_tensors_for_torch_save keeps views of the whole storage",
        "compat/deepspeed/checkpoint/utils.py",
        "return item.detach().clone().to(device)",
        "return item.detach().to(device)",
        (f"{DSN}::test_small_modules",),
    ),
    Mutant(
        "tp_model_init accepts a config without the tp size",
        "compat/deepspeed/__init__.py",
        "    if size != tp_size:",
        "    if False:",
        (f"{DSN}::test_small_modules",),
    ),
    Mutant(
        "gradient_clipping defaults to 0 (DeepSpeed clips at 1.0)",
        "config/top.py",
        "    gradient_clipping: NonNegFloat = 1.0",
        "    gradient_clipping: NonNegFloat = 0.0",
        (
            "tests/test_deepspeed_defaults.py::test_defaults_equal_deepspeeds_but_the_named_differences",
        ),
    ),
    Mutant(
        "WarmupLR without warmup_max_lr warms up to 0.001, not the optimizer's lr",
        "optim/lr_schedules.py",
        'warmup_max_lr = [group["lr"] for group in optimizer.param_groups]',
        "warmup_max_lr = 0.001",
        (
            "tests/test_lr_schedules.py::test_warmup_lr_without_a_max_warms_up_to_each_groups_own_lr",
        ),
    ),
    Mutant(
        "stage 1-2 grad norm over whole buckets (another sum order than DeepSpeed's)",
        "zero/sharded_optimizer.py",
        "            st.master.grad[lo:hi]\n            for st in self.buckets\n"
        "            for lo, hi, p in st.segments\n            if hi > lo and p not in skip\n",
        "            st.master.grad\n            for st in self.buckets\n",
        (f"{T_HF_TRAINER}[zero2_gas2]",),
    ),
    Mutant(
        "load_checkpoint leaves the optimizer state out (Accelerate load_state, Trainer resume)",
        "checkpoint/restore.py",
        "with_state = load_optimizer_states and not load_module_only",
        "with_state = False",
        (
            "tests/test_hf_trainer.py::"
            "test_accelerate_save_state_then_load_state_continues_bit_for_bit",
            "tests/test_hf_trainer.py::test_resume_from_checkpoint_continues_bit_for_bit",
        ),
    ),
    Mutant(
        "the Trainer's loss divided twice at accumulation 2 (scale_wrt_gas ignored)",
        "engine/__init__.py",
        "gas = self.window.gas if scale_wrt_gas else 1",
        "gas = self.window.gas",
        (f"{T_HF_TRAINER}[zero3_gas2]",),
    ),
    Mutant(
        "engine.config's dict leaves out the resolved batch sizes",
        "config/view.py",
        "            data.update(zip(_BATCH_KEYS, batch, strict=True))",
        "            pass",
        (T_CONFIG_VIEW,),
    ),
    Mutant(
        "engine.config hands out its own nested dicts (a write sticks, silently)",
        "config/view.py",
        "return copy.deepcopy(self._dict[key])",
        "return self._dict[key]",
        (T_CONFIG_VIEW,),
    ),
    Mutant(
        "loss not divided by gradient_accumulation_steps",
        "engine/__init__.py",
        "gas = self.window.gas if scale_wrt_gas else 1",
        "gas = 1",
        (f"{P}[dp2]",),
    ),
    Mutant(
        "backward's scale_wrt_gas=False ignored (the Trainer's loss divided twice)",
        "engine/__init__.py",
        "gas = self.window.gas if scale_wrt_gas else 1",
        "gas = self.window.gas",
        (T_SCALE_WRT_GAS,),
    ),
    Mutant(
        "steps_per_print inf prints at every step",
        "monitor/progress.py",
        "if self.rank != 0 or self.every is None or report.step % self.every:",
        "if self.rank != 0 or (self.every is not None and report.step % self.every):",
        (T_SCALE_WRT_GAS,),
    ),
    Mutant(
        "fp16 unscale drops the loss scale (stages 0-2)",
        "zero/sharded_optimizer.py",
        "return 1.0 / (loss_scale * self.prescale * self.dp) if self.dp > 1 else 1.0 / loss_scale",
        "return 1.0 / (self.prescale * self.dp) if self.dp > 1 else 1.0",
        (f"{M}::test_matches_mixed_precision_reference[fp16-dp2]",),
    ),
    Mutant(
        "fp16 unscale drops the loss scale (stage 3)",
        "zero/stage3.py",
        "return 1.0 / (loss_scale * self.prescale * self.dp)",
        "return 1.0 / (self.prescale * self.dp)",
        (f"{M}::test_matches_mixed_precision_reference[fp16-dp2]",),
    ),
    Mutant(
        "dp gradients summed, not averaged (stages 0-2)",
        "zero/sharded_optimizer.py",
        "return 1.0 / (loss_scale * self.prescale * self.dp) if self.dp > 1 else 1.0 / loss_scale",
        "return 1.0 / (loss_scale * self.prescale) if self.dp > 1 else 1.0 / loss_scale",
        (f"{P}[dp2]",),
    ),
    Mutant(
        "dp gradients summed, not averaged (stage 3)",
        "zero/stage3.py",
        "return 1.0 / (loss_scale * self.prescale * self.dp)",
        "return 1.0 / (loss_scale * self.prescale)",
        (f"{P}[dp2]",),
    ),
    Mutant(
        "tp replica counted on every tp rank in the gradient norm",
        "engine/replicas.py",
        'held = self._tp_replicas if topo.tp > 1 and topo.rank("tp") != 0 else set()',
        "held = set()",
        (f"{P}[tp2]",),
    ),
    Mutant(
        "shard offset off by one element",
        "zero/partition.py",
        "lo = bucket.start + rank * bucket.piece_numel",
        "lo = bucket.start + rank * bucket.piece_numel - (rank > 0)",
        (f"{P}[dp2]",),
    ),
    Mutant(
        "pieces padded to whole elements only, not to 16 bytes",
        "zero/partition.py",
        "ALIGN_NUMEL = 8\n",
        "ALIGN_NUMEL = 1\n",
        (f"{T_ALIGN}[1]", f"{T_ALIGN}[3]", T_ALIGNED_LAYOUT),
    ),
    Mutant(
        "stage 1-2 buckets padded to whole elements only",
        "zero/partition.py",
        "            piece = piece_numel(offset - start, world, align)",
        "            piece = piece_numel(offset - start, world, 1)",
        (f"{T_ALIGN}[1]", T_ALIGNED_LAYOUT),
    ),
    Mutant(
        "stage 3 pieces padded to whole elements only",
        "zero/params.py",
        "    piece_numel = partition.piece_numel(n, world)",
        "    piece_numel = max(1, -(-n // world))",
        (f"{T_ALIGN}[3]",),
    ),
    Mutant(
        "frozen parameters written in cuts other than stage 3's pieces",
        "checkpoint/shard.py",
        "        c = piece_numel(math.prod(full_shape_of(p, 1)), dp)",
        "        c = max(1, -(-math.prod(full_shape_of(p, 1)) // dp))",
        ("tests/test_frozen.py",),
    ),
    Mutant(
        "estimate: stage 3 pieces not padded to 16 bytes",
        "estimate/memory.py",
        "        shard = sum(piece_numel(n, dp) for n in sizes)",
        "        shard = sum(-(-n // dp) for n in sizes)",
        ("tests/test_estimate.py::test_stage3_padding_is_estimated_as_the_engine_pads",),
    ),
    Mutant(
        "comm reaches up into the engine from inside a function (an import cycle)",
        "comm/summary.py",
        "        print_progress(line)\n",
        "        from ..engine import Engine  # noqa: F401\n\n        print_progress(line)\n",
        (T_NO_CYCLE, T_LAYERS),
    ),
    Mutant(
        "zero reaches up into the watchdog (an upward import, no cycle)",
        "zero/partition.py",
        "from dataclasses import dataclass\n",
        "from dataclasses import dataclass\n\nfrom ..watchdog import default_store  # noqa: F401\n",
        (T_LAYERS,),
    ),
    Mutant(
        "Megatron's f: the gradient of a tp region's input is not summed over tp",
        "comm/functional.py",
        "        return _all_reduce(grad, ctx.axis), None",
        "        return grad, None",
        (f"{P}[tp2]",),
    ),
    Mutant(
        "sequence parallelism: partial gradients of a gathered input split, not summed",
        "comm/functional.py",
        "        if ctx.grad_is_partial:",
        "        if False:",
        ("tests/test_tp_layers.py::test_layers_match_unsplit_torch_layers[2]",),
    ),
    Mutant(
        "NaN guard removed (bf16 and fp32 apply non-finite steps)",
        "engine/update.py",
        "overflow = not math.isfinite(value)",
        'overflow = self.precision.name == "fp16" and not math.isfinite(value)',
        ("tests/test_nonfinite.py",),
    ),
    Mutant(
        "loss scaler not restored on load",
        "engine/train_state.py",
        'self.loss_scaler.load_state_dict(state["loss_scaler"])',
        "pass",
        (f"{C}::test_exact_resume_whole",),
    ),
    Mutant(
        "RNG state not restored on load",
        "checkpoint/restore.py",
        'torch.set_rng_state(reader.get(mine, "rng/cpu"))',
        'reader.get(mine, "rng/cpu")',
        (f"{C}::test_exact_resume_whole",),
    ),
    Mutant(
        "sampler position not restored on load",
        "engine/train_state.py",
        'sampler.load_state_dict(state["data_sampler"])',
        "pass",
        (f"{C}::test_exact_resume_whole",),
    ),
    Mutant(
        "data loader draws its shuffle seed from the global RNG",
        "compose.py",
        "generator=torch.Generator().manual_seed(cfg.seed),",
        "generator=None,",
        (f"{C}::test_exact_resume_whole",),
    ),
    Mutant(
        "pipeline data iterator not reset on load",
        "engine/train_state.py",
        "            self.data_iter = None\n",
        "",
        (f"{C}::test_exact_resume_whole",),
    ),
    Mutant(
        "NVMe optimizer state loaded but not written to its files",
        "zero/offload.py",
        'self.store.write(self.key[p], [values["master"], *(values[k] for k in names)])',
        "pass",
        (f"{C}::test_exact_resume_with_offload",),
    ),
    Mutant(
        "stage-3 NVMe load not written into the parameter pieces",
        "zero/stage3_state.py",
        'self._write_pieces(self._group_of[master], values["master"])',
        "pass",
        (f"{C}::test_exact_resume_with_offload",),
    ),
    Mutant(
        "frozen parameters not written to checkpoints",
        "checkpoint/shard.py",
        "if x >= y or p in elsewhere or p not in names:",
        "if True:",
        ("tests/test_frozen.py",),
    ),
    Mutant(
        "frozen parameters not loaded",
        "checkpoint/restore.py",
        'read(held, p, "master", lo, hi, 0)',
        "pass",
        ("tests/test_frozen.py",),
    ),
    Mutant(
        "a checkpoint missing part of a value loads silently",
        "checkpoint/restore.py",
        'if kind == "master" and covered != hi - lo:',
        "if False:",
        ("tests/test_frozen.py",),
    ),
    Mutant(
        "stage-3 parameter released before its last use",
        "zero/coordinator.py",
        "            if st.gathered:\n                continue\n",
        "            if False:\n                continue\n",
        (f"{E}[2-foreign]",),
    ),
    Mutant(
        "stage-3 parameter read by a module that does not own it is not kept by that unit",
        "zero/coordinator.py",
        "if u not in self._units_of[p]:",
        "if False:",
        (f"{E}[2-foreign]",),
    ),
    Mutant(
        "stage-3 root module not a unit",
        "zero/coordinator.py",
        "        out.append(m)\n",
        "        if m is not root:\n            out.append(m)\n",
        (f"{E}[2-root]",),
    ),
    Mutant(
        "stage-3 no_grad pass recorded as the prefetch order",
        "zero/coordinator.py",
        "            if training:\n                self.recording.append(u)",
        "            if True:\n                self.recording.append(u)",
        ("tests/test_stage3_edges.py::test_prefetch_survives_eval_passes",),
    ),
    Mutant(
        "a bucket some of whose parameters got no gradient is never reduced",
        "zero/reducer.py",
        "        while self._next < len(self._sizes):\n            self._start(self._next)\n",
        "",
        (f"{E}[2-unused]",),
    ),
    Mutant(
        "stage-3 reduced rows held until backward ends, a gradient shard's worth",
        "zero/reducer.py",
        "            while len(self._handles) - self._waited > self._in_flight:",
        "            while False:",
        (f"{LIVE}::test_reduced_rows_are_delivered_during_backward",),
    ),
    Mutant(
        "stage-3 row delivered before its reduce-scatter completes",
        "zero/reducer.py",
        "        if handle is not None:\n            handle.wait()\n"
        "        self._handles[self._waited]",
        "        self._handles[self._waited]",
        (f"{P}[dp2]",),
    ),
    Mutant(
        "stage-3 row never delivered",
        "zero/stage3_reduce.py",
        "self._deliver(b, self._summed(b, out) if self.quantized and self.dp > 1 else out)",
        "None",
        (f"{P}[dp2]",),
    ),
    Mutant(
        "scratch: large CPU buffers from malloc's heap",
        "core/scratch.py",
        'return torch.device(device).type == "cpu" and numel * dtype.itemsize >= MIN_BYTES',
        "return False",
        (
            "tests/test_scratch.py::test_a_large_buffer_has_a_mapping_of_its_own_that_goes_when_freed",
        ),
    ),
    Mutant(
        "scratch: a mapping never unmapped (a leak)",
        "core/scratch.py",
        "    return torch.frombuffer(buf, dtype=dtype, count=numel)",
        '    globals().setdefault("_kept", []).append(buf)\n'
        "    return torch.frombuffer(buf, dtype=dtype, count=numel)",
        (
            "tests/test_scratch.py::test_a_large_buffer_has_a_mapping_of_its_own_that_goes_when_freed",
        ),
    ),
    Mutant(
        "stage-3 gathered copies from the heap",
        "zero/gathers.py",
        "fulls = [scratch.empty(world * pc.numel(), pc.dtype, pc.device) for pc in pieces]",
        "fulls = [torch.empty(world * pc.numel(), dtype=pc.dtype) for pc in pieces]",
        (T_SCRATCH,),
    ),
    Mutant(
        "weight gradient from the heap",
        "zero/linear.py",
        "            if flat.dtype == x2.dtype:",
        "            if False:",
        (T_SCRATCH,),
    ),
    Mutant(
        "stage-3 staging matrices from the heap",
        "zero/stage3_reduce.py",
        "return self.buffers.take(self.dp * self.width[b], self.dtype, device).view(self.dp, -1)",
        "return torch.empty(self.dp, self.width[b], dtype=self.dtype, device=device)",
        (T_SCRATCH,),
    ),
    Mutant(
        "a bucket launched before all its gradients arrived",
        "zero/reducer.py",
        "and self._arrived[self._next] >= self._sizes[self._next]",
        "and True",
        (f"{P}[dp2]",),
    ),
    Mutant(
        "stage-3 tied weight reduced by both modules holding it",
        "zero/stage3.py",
        "[p for p in ps if owner[p] == u and p in self._trainable]",
        "[p for p in ps if p in self._trainable]",
        (f"{E}[2-tied]",),
    ),
    Mutant(
        "pipeline loss not divided by the number of micro-batches",
        "pipeline/executor.py",
        "loss_scale / micro_batches, on_tied",
        "loss_scale, on_tied",
        (f"{S}[2]",),
    ),
    Mutant(
        "pipeline shape probe reads micro-batch 0 twice",
        "pipeline/executor.py",
        "if mb in self.batches:  # read ahead by learn_shapes",
        "if False:  # read ahead by learn_shapes",
        (f"{S}[2]",),
    ),
    Mutant(
        "initialize skips the pipeline simulator's check",
        "validate.py",
        "check_schedule(pcfg.schedule, module.num_stages, gas, module.virtual_stages)",
        "pcfg.schedule",
        (
            "tests/test_pipeline_schedule.py::"
            "test_a_schedule_the_simulator_refuses_is_a_config_error_at_initialize",
        ),
    ),
    Mutant(
        "simulator ignores the order of a pair's messages",
        "pipeline/simulate.py",
        "if key != other:",
        "if False:",
        (
            "tests/test_pipeline_schedule.py::"
            "test_two_ranks_must_post_the_messages_between_them_in_the_same_order",
        ),
    ),
    Mutant(
        "CLI drops the default micro-batch with --grad-accum",
        "cli.py",
        'elif "train_batch_size" not in cfg:',
        'elif not args.grad_accum and "train_batch_size" not in cfg:',
        ("tests/test_cli.py::test_batch_options_fill_in_the_default_micro_batch",),
    ),
    Mutant(
        "zerostack train: --zero-stage 3 trains at stage 2",
        "cli.py",
        'cfg.setdefault("zero_optimization", {})["stage"] = args.zero_stage',
        'cfg.setdefault("zero_optimization", {})["stage"] = min(args.zero_stage, 2)',
        ("tests/test_cli.py::test_every_grid_trains_and_its_loss_falls",),
    ),
    Mutant(
        "stage-2 full-size gradient kept after its bucket (a leak)",
        "zero/grad_buffers.py",
        "p.grad = None  # the full-size gradient does not outlive its bucket",
        "pass",
        (f"{T}[2]",),
    ),
    Mutant(
        "stage-3 full gradient kept after its hook (a leak)",
        "zero/stage3_reduce.py",
        "p.grad = None  # the full gradient does not outlive this hook",
        "pass",
        (f"{T}[2]",),
    ),
    Mutant(
        "stage-3 gathered copy kept on the parameter (a leak)",
        "zero/unit_gather.py",
        "hold(p, full, self.meter, p._zs.world > 1)",
        "hold(p, full, self.meter, p._zs.world > 1); p._zs_stale = full",
        (f"{T}[2]",),
    ),
    Mutant(
        "stage-1 reduced piece kept after the step (a leak)",
        "zero/sharded_optimizer.py",
        "st.piece = None\n",
        "pass\n",
        (f"{T}[2]",),
    ),
    Mutant(
        "a frozen piece in host memory (offload_param) not written back after a load",
        "zero/stage3_state.py",
        "self.param_swapper.update(p, p._zs.piece)",
        "pass",
        ("tests/test_frozen.py",),
    ),
    Mutant(
        "stage-3 reduce buckets: every piece placed at the start of its bucket's row",
        "zero/partition.py",
        "bucket[i], at[i] = len(items) - 1, width[-1]",
        "bucket[i], at[i] = len(items) - 1, 0",
        (f"{P}[dp2]",),
    ),
    Mutant(
        "estimate: stage-2/3 gradient shard counted in the compute dtype, not fp32",
        "estimate/memory.py",
        "out.grads = c * trained if stage < 2 else 4 * shard",
        "out.grads = c * trained if stage < 2 else c * shard",
        ("tests/test_estimate.py::test_the_zero_papers_figure_1",),
    ),
    Mutant(
        "estimate: tensor-split activations divided by the sequence-parallel factor",
        "estimate/activations.py",
        "split = ((2 + 2 * kv) * d + mlp * d) * sbh / t",
        "split = ((2 + 2 * kv) * d + mlp * d) * sbh / sp",
        ("tests/test_estimate.py::test_korthikanti_table_2",),
    ),
    Mutant(
        "estimate: offloaded stage-2 gradient piece left on the device too",
        "estimate/memory.py",
        "            out.grads = 0  # stages 2-3 keep it only there",
        "            pass",
        ("tests/test_estimate.py::test_estimate_matches_live_engines",),
    ),
    Mutant(
        "plan: the pipeline bubble left out of the step time",
        "plan/cost.py",
        "bubble = compute * pipeline(c.pp, c.gas, c.chunks)[0]",
        "bubble = 0.0",
        ("tests/test_plan.py::test_the_published_1t_layout",),
    ),
    Mutant(
        "transformer flops: full recompute costs no second forward",
        "profiling/flops.py",
        "layers * layer * (passes + (1 if recompute else 0))",
        "layers * layer * passes",
        ("tests/test_plan.py::test_flops_are_narayanans_formula",),
    ),
    Mutant(
        "plan: tensor parallelism allowed across nodes",
        "plan/search.py",
        "        if tp > hw.gpus_per_node:",
        "        if False:",
        ("tests/test_plan.py::test_the_planner_on_the_published_case",),
    ),
    Mutant(
        "transformer flops drop the backward",
        "profiling/flops.py",
        "passes = 1 + (2 if backward else 0)",
        "passes = 1",
        ("tests/test_flops_profiler.py::test_narayanan_formula_for_the_1t_model",),
    ),
    Mutant(
        "flops profiler counts a tied parameter twice",
        "profiling/flops_profiler/profiler.py",
        "for p in module.parameters())",
        "for p in module.parameters(remove_duplicate=False))",
        ("tests/test_flops_profiler.py::test_shared_parameters_are_counted_once",),
    ),
    Mutant(
        "flops profiler: step flops without the backward",
        "profiling/flops_profiler/profiler.py",
        "round(fwd * (3 + self.recompute_fwd_factor))",
        "round(fwd * (1 + self.recompute_fwd_factor))",
        (
            "tests/test_flops_profiler.py::test_backward_and_recomputation_before_stop_are_not_counted",
        ),
    ),
    Mutant(
        "flops_profiler block: the profiled step is never printed",
        "profiling/flops_profiler/step.py",
        "        if self.active:\n            self._end()",
        "        if False:\n            self._end()",
        ("tests/test_flops_profiler.py::test_the_engine_profiles_the_configured_step",),
    ),
    Mutant(
        "estimate: stage-3 persistent parameters not counted whole",
        "estimate/memory.py",
        "        out.params += c * persistent",
        "        pass",
        ("tests/test_estimate.py::test_estimate_from_the_model_description_matches_every_rank",),
    ),
    Mutant(
        "estimate: the tied output layer left off the last pipeline stage",
        "estimate/activations.py",
        "out += norm + ([self.vocab * h // t] if pp > 1 else [])",
        "out += norm",
        ("tests/test_estimate.py::test_estimate_from_the_model_description_matches_every_rank",),
    ),
    Mutant(
        "auto stage: the highest stage that fits, not the lowest",
        "plan/auto.py",
        "stage = fits[0]",
        "stage = fits[-1]",
        ("tests/test_auto.py::test_the_lowest_stage_that_fits",),
    ),
    Mutant(
        "recomputation hands autograd the saved tensor itself (the graph leaks every step)",
        "activation_checkpointing/recompute.py",
        "            return len(out) - 1",
        "            return x",
        (
            "tests/test_activation_checkpointing.py"
            "::test_the_recomputed_graph_is_freed_after_backward",
        ),
    ),
    Mutant(
        "estimate: a gated MLP counted with two matrices",
        "estimate/activations.py",
        "mats = 3 if self.gated else 2",
        "mats = 2",
        ("tests/test_estimate.py::test_llama_style_configs_count_their_published_parameters",),
    ),
    Mutant(
        "sequence parallelism: the column layer saves its gathered input",
        "tensor_parallel/mappings.py",
        "        return torch.nn.functional.linear(_all_gather(x, SEQ_DIM, ctx.axis), weight, b",
        "        x = _all_gather(x, SEQ_DIM, ctx.axis)\n        ctx.save_for_backward(x, weight)\n"
        "        return torch.nn.functional.linear(x, weight, b",
        (
            "tests/test_tensor_parallel.py::"
            "test_sequence_parallel_layer_keeps_one_tp_th_of_its_activations",
        ),
    ),
    Mutant(
        "plan: the column layers' backward re-gather left out of the tp cost",
        "plan/cost.py",
        'big = layers * (10 + (4 if recompute == "full" else 0)) + 5',
        'big = layers * (8 + (4 if recompute == "full" else 0)) + 4',
        ("tests/test_tensor_parallel.py::test_comm_per_layer",),
    ),
    Mutant(
        "plan: the gradient norm's all-reduce left out of stages 1-3",
        "plan/cost.py",
        "norm = _ring(4, c.dp, bw, lat, passes=2) if c.stage else 0.0",
        "norm = 0.0",
        ("tests/test_plan.py::test_the_dp_collectives_are_what_the_engine_issues",),
    ),
    Mutant(
        "plan: stage 2 reduces once per step, not per micro-batch",
        "plan/cost.py",
        "dp_s = c.gas * _ring(grads, c.dp, bw, lat) + _ring(grads, c.dp, bw, lat)",
        "dp_s = _ring(grads, c.dp, bw, lat) + _ring(grads, c.dp, bw, lat)",
        ("tests/test_plan.py::test_the_dp_collectives_are_what_the_engine_issues",),
    ),
    Mutant(
        "watchdog: a silent peer is given ten times the bound",
        "watchdog/heartbeats.py",
        "if quiet_for > self.timeout]",
        "if quiet_for > 10 * self.timeout]",
        (
            "tests/test_watchdog.py::test_a_silent_peer_is_named_with_its_last_position",
            "tests/test_watchdog.py::test_a_frozen_rank_ends_the_job_within_the_bound",
        ),
    ),
    Mutant(
        "watchdog: a peer that missed its beats does not hold back the rival verdict",
        "watchdog/heartbeats.py",
        "now - pending.started > self.timeout and not quiet:",
        "now - pending.started > self.timeout:",
        (
            "tests/test_watchdog.py::test_a_peer_that_froze_as_this_rank_began_waiting_is_named_stopped",
        ),
    ),
    Mutant(
        "watchdog: its exit skips the removal of the rank's swap files",
        "watchdog/__init__.py",
        "exit: Callable[[int], None] = hard_exit,",
        "exit: Callable[[int], None] = os._exit,",
        ("tests/test_disk_faults.py::test_the_watchdogs_exit_removes_the_ranks_swap_files",),
    ),
    Mutant(
        "an NVMe store is not removed when the watchdog ends the rank",
        "zero/nvme.py",
        "        before_hard_exit(self._remove_on_hard_exit)  # the watchdog's exit skips atexit\n",
        "",
        ("tests/test_disk_faults.py::test_the_watchdogs_exit_removes_the_ranks_swap_files",),
    ),
    Mutant(
        "hard_exit runs no removal",
        "core/exit.py",
        "        try:\n            cleanup()\n",
        "        try:\n            pass\n",
        ("tests/test_disk_faults.py::test_the_watchdogs_exit_removes_the_ranks_swap_files",),
    ),
    Mutant(
        "watchdog: an error raised as the job ends prints its traceback as if it were the cause",
        "watchdog/__init__.py",
        "        if self._ending.is_set():\n            # raised",
        "        if False:\n            # raised",
        (
            "tests/test_watchdog.py::"
            "test_an_error_raised_as_the_job_ends_is_not_printed_as_its_cause",
        ),
    ),
    Mutant(
        "watchdog: a posted verdict is not read by the other ranks",
        "watchdog/heartbeats.py",
        "        if self.store.check([key]):\n            return self.store.get(key).decode()\n",
        "",
        (
            "tests/test_watchdog.py::test_a_posted_verdict_ends_every_rank",
            "tests/test_watchdog.py::test_a_frozen_rank_ends_the_job_within_the_bound",
        ),
    ),
    Mutant(
        "watchdog: an async collective stays in flight after its wait",
        "comm/grid.py",
        "        self._log.end(self._record, _behind() if self._on_device else None)",
        "        pass",
        ("tests/test_watchdog.py::test_a_frozen_rank_ends_the_job_within_the_bound",),
    ),
    Mutant(
        "watchdog: stop waits out the interval",
        "watchdog/__init__.py",
        '            self._wake_w.send(b"\\0")',
        "            pass",
        ("tests/test_watchdog.py::test_stop_returns_at_once",),
    ),
    Mutant(
        "watchdog: a failed collective does not say why the job is ending",
        "comm/records.py",
        "verdict = self.explain() if self.explain is not None else None",
        "verdict = None",
        ("tests/test_watchdog.py::test_a_failed_collective_carries_the_posted_verdict",),
    ),
    Mutant(
        "watchdog: an exception is not posted as the verdict",
        "watchdog/__init__.py",
        "        sys.excepthook = self._excepthook\n",
        "",
        ("tests/test_watchdog.py::test_a_rank_that_raises_is_named_by_every_rank",),
    ),
    Mutant(
        "watchdog: the verdict printed into whatever sys.stderr is at the time",
        "watchdog/__init__.py",
        "        print(text, file=self._out, flush=True)",
        "        print(text, file=sys.stderr, flush=True)",
        (T_RAISED,),
    ),
    Mutant(
        "watchdog: the rank ends while its traceback is being printed",
        "watchdog/__init__.py",
        "            if self._tracing.is_set():",
        "            if False:",
        (T_RAISED,),
    ),
    Mutant(
        "memory by device: stages 0-2 put every buffer on the compute device",
        "zero/flat_state.py",
        "            yield kind, t.device.type, t.nbytes",
        "            yield kind, self.comm.topo.device.type, t.nbytes",
        (T_APART,),
    ),
    Mutant(
        "memory by device: stage 3's masters counted where the parameters compute",
        "zero/stage3_state.py",
        "            yield kind, t.device.type, t.nbytes\n        for p in self._owner:",
        '            yield kind, device if kind == "master" else t.device.type, t.nbytes\n'
        "        for p in self._owner:",
        (T_APART,),
    ),
    Mutant(
        "shutdown: the mesh keeps its groups past destroy_process_group",
        "topology.py",
        "        hold_groups(topo)\n",
        "",
        (T_SHUTDOWN,),
    ),
    Mutant(
        "shutdown: torch.distributed.nn.functional's defaults keep the world group",
        "world.py",
        "    _release_default_arguments()\n    dist.destroy_process_group()",
        "    dist.destroy_process_group()",
        (T_SHUTDOWN,),
    ),
    Mutant(
        "shutdown: a pipeline's tied-weight groups are kept",
        "pipeline/module.py",
        "        hold_groups(self)  # the ties' groups",
        "        pass  # the ties' groups",
        (T_SHUTDOWN,),
    ),
    Mutant(
        "qwZ: the config's flag never reaches stage 3 (plain gathers)",
        "zero/build.py",
        "            quantized_weights=zcfg.zero_quantized_weights,",
        "            quantized_weights=False,",
        (T_QWZ_PARITY, T_QWZ_BYTES),
    ),
    Mutant(
        "qwZ: values truncated toward zero instead of rounded",
        "zero/quantize.py",
        "    q = torch.round(x.div_(divisor[:, None]))",
        "    q = torch.trunc(x.div_(divisor[:, None]))",
        (T_QWZ_ROUND,),
    ),
    Mutant(
        "qwZ: block scales rounded to the nearest bf16, not up (values clamped at 127)",
        "zero/quantize.py",
        "    scale = _bf16_up(x.abs().amax(dim=1) / top)",
        "    scale = (x.abs().amax(dim=1) / top).to(SCALE).float()",
        (T_QWZ_ROUND,),
    ),
    Mutant(
        "qwZ: a piece's blocks start where the last full block of the one before ends",
        "zero/quantize.py",
        "        at += blocks(n)",
        "        at += n // BLOCK",
        (T_QWZ_PACK, T_QWZ_PARITY),
    ),
    Mutant(
        "qwZ: accepted below stage 3, where it would do nothing",
        "config/zero.py",
        "        if self.zero_quantized_weights and self.stage != 3:",
        "        if False:",
        (T_QWZ_REFUSED,),
    ),
    Mutant(
        "qgZ: the config's flag never reaches stage 3 (plain reduce-scatter)",
        "zero/build.py",
        "            quantized_gradients=zcfg.zero_quantized_gradients,",
        "            quantized_gradients=False,",
        (T_QGZ,),
    ),
    Mutant(
        "qgZ: only this rank's own contribution summed",
        "zero/stage3_reduce.py",
        "            for r in range(1, self.dp):",
        "            for r in range(1, 1):",
        (T_QGZ,),
    ),
    Mutant(
        "qgZ: each row sent to the wrong rank",
        "zero/stage3_reduce.py",
        "for row in staging])",
        "for row in staging.flip(0)])",
        (T_QGZ,),
    ),
    Mutant(
        "qgZ: accepted below stage 3, where it would do nothing",
        "config/zero.py",
        "        if self.zero_quantized_gradients and self.stage != 3:",
        "        if False:",
        (T_QWZ_REFUSED,),
    ),
    Mutant(
        "hpZ: the secondary piece cut at the dp rank, not the rank within the pair",
        "zero/gathers.py",
        "        return cls(size, topo.dp_rank % size, topo.dp_subgroup(size))",
        "        return cls(size, topo.dp_rank // size, topo.dp_subgroup(size))",
        (T_HPZ,),
    ),
    Mutant(
        "hpZ: secondary pieces held past the backward (memory until the next forward)",
        "zero/coordinator.py",
        "        self._bwd_held = {}\n        self._drop_inflight()\n        self._drop_kept()\n"
        "        self.gathers.drop_secondaries()\n",
        "        self._bwd_held = {}\n        self._drop_inflight()\n        self._drop_kept()\n",
        (T_HPZ,),
    ),
    Mutant(
        "hpZ: the backward gathers over dp as before (the secondaries unused)",
        "zero/unit_gather.py",
        "        from_secondary = all(p._zs.secondary is not None for p in params)",
        "        from_secondary = False",
        (T_HPZ,),
    ),
    Mutant(
        "hpZ: a size that does not divide dp reaches the grid (no ConfigError naming the key)",
        "zero/gathers.py",
        "        if topo.dp % size:\n            raise ConfigError(",
        "        if False:\n            raise ConfigError(",
        (T_HPZ_REFUSED,),
    ),
    Mutant(
        "monitor: the train loss not averaged over the accumulation window",
        "monitor/training.py",
        "mean = self._sum / self._count",
        "mean = self._sum",
        ("tests/test_monitor.py::test_tensorboard_and_csv_hold_what_the_loop_saw",),
    ),
    Mutant(
        "monitor: events at x = optimizer steps, not DeepSpeed's global_samples",
        "monitor/training.py",
        "x = report.samples",
        "x = report.step",
        ("tests/test_monitor.py::test_tensorboard_and_csv_hold_what_the_loop_saw",),
    ),
    Mutant(
        "monitor: steps_per_print unseen without a logging set-up",
        "core/progress.py",
        "        print(text, flush=True)",
        "        log.info(text)",
        ("tests/test_monitor.py::test_steps_per_print_is_seen_on_stdout_once",),
    ),
    Mutant(
        "safe_get_full_grad: the summed gradient not averaged over dp",
        "engine/full_params.py",
        "grad = zero.window_grad(p).mul(post)",
        "grad = zero.window_grad(p)",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s1]",),
    ),
    Mutant(
        "safe_get_full_grad mid-window at stages 0-1: the local gradients not summed over dp",
        "zero/grad_buffers.py",
        "f.comm.all_reduce(grad, axis=cut.axis)",
        "pass",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s1]",),
    ),
    Mutant(
        "safe_set_full_fp32_param: the compute-dtype parameter keeps its old value",
        "engine/full_params.py",
        "            zero.write_param(p, flat)",
        "            pass",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s3_cpu]",),
    ),
    Mutant(
        "save_checkpoint ignores exclude_frozen_parameters",
        "checkpoint/shard.py",
        "excluded = _frozen_names(run) if exclude_frozen else set()",
        "excluded = set()",
        ("tests/test_engine_surface.py::test_load_checkpoint_keywords_and_excluded_frozen[1]",),
    ),
    Mutant(
        "load_module_strict=False still refuses a parameter the checkpoint lacks",
        "checkpoint/restore.py",
        "        if load_module_strict:\n            raise CheckpointError(",
        "        if True:\n            raise CheckpointError(",
        ("tests/test_engine_surface.py::test_load_checkpoint_keywords_and_excluded_frozen[1]",),
    ),
    Mutant(
        "communication_data_type ignored: gradients reduced in the compute dtype",
        "core/precision.py",
        "return self.comm_dtype or self.compute_dtype",
        "return self.compute_dtype",
        (f"{CD}::test_fp32_reduction_sends_fp32_and_sums_exactly",),
    ),
    Mutant(
        "communication_data_type at stage 0: the all-reduced copy not written back",
        "zero/grad_buffers.py",
        "return handle if sent is chunk else CastBack(handle, sent, chunk)",
        "return handle",
        (f"{CD}::test_fp32_reduction_sends_fp32_and_sums_exactly",),
    ),
    Mutant(
        "communication_data_type at stage 3: buckets staged in the compute dtype",
        "zero/stage3.py",
        "dtype=precision.reduce_dtype,",
        "dtype=dtype,",
        (f"{CD}::test_fp32_reduction_sends_fp32_and_sums_exactly",),
    ),
    Mutant(
        "grad_accum_dtype at stages 0-1: a micro-batch's .grad kept after it is summed",
        "zero/grad_buffers.py",
        "p.grad = view if view.dtype == p.grad.dtype else None",
        "p.grad = view if view.dtype == p.grad.dtype else p.grad",
        (f"{CD}::test_fp32_accumulation_buffer_across_micro_batches",),
    ),
    Mutant(
        "grad_accum_dtype at stage 3: the gradient shard always fp32",
        "zero/masters.py",
        "return torch.zeros_like(master, dtype=self.dtype)",
        "return torch.zeros_like(master)",
        (f"{CD}::test_fp32_accumulation_buffer_across_micro_batches",),
    ),
    Mutant(
        "grad_accum_dtype under a pipeline: tied copies summed in .grad, not the fp32 buffer",
        "pipeline/runner.py",
        "grad = zero.accumulated_grad(p)",
        "grad = p.grad",
        (f"{CD}::test_training_matches_mixed_precision_reference",),
    ),
    Mutant(
        "grad_accum_dtype other than the model's accepted at stage 0",
        "config/zero.py",
        "    if stage == 0 and accum != model:  # DeepSpeed",
        "    if False:  # DeepSpeed",
        (f"{CD}::test_bad_values_and_combinations_fail_in_one_line",),
    ),
    Mutant(
        "comms logger: all_reduce busbw without its 2 (n - 1) / n factor",
        "comm/summary.py",
        "algbw, busbw = 2 * size / ms, size / ms * (2 * (n - 1) / n)",
        "algbw, busbw = 2 * size / ms, size / ms",
        ("tests/test_ds_comm.py::test_log_summary_prints_deepspeeds_table",),
    ),
    Mutant(
        "comms logger: an all-gather's bandwidth misses the other ranks' pieces",
        "comm/summary.py",
        "algbw = size * n / ms",
        "algbw = size / ms",
        ("tests/test_ds_comm.py::test_log_summary_prints_deepspeeds_table",),
    ),
    Mutant(
        "comms logger: an all-gather's message size is its whole output",
        "comm/summary.py",
        "return nbytes // max(ranks, 1) if op in _GATHERS else nbytes",
        "return nbytes",
        ("tests/test_ds_comm.py::test_log_summary_prints_deepspeeds_table",),
    ),
    Mutant(
        "comms logger: prof_ops ignored, every op recorded",
        "comm/summary.py",
        "return self.enabled and (prof or self.prof_all or name in self.prof_ops)",
        "return self.enabled",
        ("tests/test_ds_comm.py::test_prof_ops_and_debug",),
    ),
    Mutant(
        "comms_logger block: the engine's collectives are not summarised",
        "compose.py",
        "    comms_logger.follow(comm_for(topo).log)\n",
        "",
        ("tests/test_ds_comm.py::test_comms_logger_block_summarises_the_engines_collectives",),
    ),
    Mutant(
        "fp16.auto_cast ignored: no input is cast",
        "engine/micro_batches.py",
        "    if not auto_cast:\n        return inputs",
        "    if True:\n        return inputs",
        ("tests/test_input_cast.py::test_inputs_are_cast_as_deepspeed_casts_them",),
    ),
    Mutant(
        "auto_cast casts keyword arguments too",
        "engine/__init__.py",
        "out = self.module(*cast_inputs(args, self.config.fp16.auto_cast), **kwargs)",
        "out = self.module(*cast_inputs(args, self.config.fp16.auto_cast), "
        "**cast_inputs(kwargs, self.config.fp16.auto_cast))",
        ("tests/test_input_cast.py::test_inputs_are_cast_as_deepspeed_casts_them",),
    ),
    Mutant(
        "pipeline: the first stage's input is not cast with auto_cast",
        "pipeline/executor.py",
        "return cast_inputs(x, self.auto_cast)",
        "return x",
        (
            "tests/test_input_cast.py::test_pipeline_casts_the_first_stage_input_with_auto_cast_and_never_the_labels",
        ),
    ),
    Mutant(
        "an unsupported DeepSpeed key loads silently",
        "config/top.py",
        "elif entry.status == UNSUPPORTED and entry.asks(value):",
        "elif False:",
        ("tests/test_config_keys.py::test_unsupported_messages",),
    ),
    Mutant(
        "an unsupported DeepSpeed key is refused at its default too",
        "config/top.py",
        "elif entry.status == UNSUPPORTED and entry.asks(value):",
        "elif entry.status == UNSUPPORTED:",
        ("tests/test_config_keys.py::test_an_unsupported_key_is_refused_naming_it_and_why",),
    ),
    Mutant(
        "no-effect keys: the warning on every rank",
        "config/keys.py",
        "if settings and rank == 0:",
        "if settings:",
        ("tests/test_config_keys.py::test_at_initialize_warning_level_and_memory_line",),
    ),
    Mutant(
        "no-effect keys: a nested key named at its default",
        "config/keys.py",
        "if found is not None and found[0] != found[1]:",
        "if found is not None:",
        ("tests/test_config_keys.py::test_at_initialize_warning_level_and_memory_line",),
    ),
    Mutant(
        "torch_adam ignored: CPUAdam with the optimizer offloaded",
        "optim/__init__.py",
        "if offload and not p.torch_adam:",
        "if offload:",
        ("tests/test_config_keys.py::test_torch_adam_is_torch_optims_plain_adam_also_offloaded",),
    ),
    Mutant(
        "memory_breakdown: no memory line",
        "monitor/progress.py",
        "        if self.memory:\n",
        "        if False:\n",
        ("tests/test_config_keys.py::test_at_initialize_warning_level_and_memory_line",),
    ),
    Mutant(
        "log_level not applied",
        "compose.py",
        "    if cfg.log_level is not None:",
        "    if False:",
        ("tests/test_config_keys.py::test_at_initialize_warning_level_and_memory_line",),
    ),
    # Hugging Face models (tests/test_hf.py)
    Mutant(
        "autotp splits GPT-2's fused q, k, v as one block",
        "tensor_parallel/autotp.py",
        'chunks={"attn.c_attn": 3},',
        'chunks={"attn.c_attn": 1},',
        (f"{HF}::test_hf_model_matches_single_process_training[gpt2]",),
    ),
    Mutant(
        "autotp row-parallel outputs not all-reduced",
        "tensor_parallel/autotp.py",
        "y = reduce_from_tp(self._matmul(x, None), comm)",
        "y = self._matmul(x, None)",
        (f"{HF}::test_hf_model_matches_single_process_training[llama]",),
    ),
    Mutant(
        "autotp size check skipped",
        "tensor_parallel/autotp.py",
        "        if size % tp:",
        "        if False:",
        (f"{HF}::test_autotp_refuses_what_it_cannot_split",),
    ),
    Mutant(
        "zero.Init leaves Hugging Face's initialisation to empty pieces",
        "zero/init.py",
        "self._undo_hf = patch_init_weights(_gathered_pieces)",
        "self._undo_hf = None",
        (f"{HF}::test_hf_model_matches_single_process_training[llama]",),
    ),
    Mutant(
        "Hugging Face initialisation not written back into the pieces",
        "zero/init.py",
        "GatheredParameters([p for p in params if is_sharded(p)], modifier_rank=0)",
        "GatheredParameters([p for p in params if is_sharded(p)], modifier_rank=None)",
        (f"{HF}::test_hf_model_matches_single_process_training[gpt2]",),
    ),
    Mutant(
        "zero.Init(module=) ignored",
        "zero/init.py",
        "            for m in module.modules():",
        "            for m in []:",
        (f"{HF}::test_hf_model_matches_single_process_training[llama]",),
    ),
    Mutant(
        "ds_status not AVAILABLE while gathered",
        "zero/params.py",
        "    p.ds_status = ZeroParamStatus.AVAILABLE\n",
        "",
        (f"{HF}::test_stage3_parameters_carry_deepspeeds_attributes",),
    ),
    Mutant(
        "save_16bit_model writes safetensors under a .bin name",
        "checkpoint/model_files.py",
        'if save_filename.endswith(".safetensors"):',
        "if True:",
        (f"{HF}::test_16bit_model_files_load_in_torch_and_transformers[1]",),
    ),
    # the launcher and rank discovery (tests/test_launch.py)
    Mutant(
        "launch: static rendezvous without --node_rank",
        "launcher/commands.py",
        '            f"--node_rank={node_rank}",\n',
        "",
        ("tests/test_launch.py::test_torchrun_per_node_static_has_the_node_rank",),
    ),
    Mutant(
        "launch: c10d agents each told they are the only node",
        "launcher/commands.py",
        '            f"--nnodes={len(hosts)}",\n            "--rdzv_backend=c10d",',
        '            "--nnodes=1",\n            "--rdzv_backend=c10d",',
        ("tests/test_launch.py::test_torchrun_per_node_c10d",),
    ),
    Mutant(
        "launch: --include slot list ignored (whole host taken)",
        "launcher/hostfile.py",
        "chosen[host] = slots or full[host]",
        "chosen[host] = full[host]",
        ("tests/test_launch.py::test_include_and_exclude_as_deepspeed_reads_them",),
    ),
    Mutant(
        "discovery: Slurm node list loses its zero padding",
        "launcher/discovery.py",
        'yield from _expand_one(f"{head}{n:0{width}d}{tail}")',
        'yield from _expand_one(f"{head}{n}{tail}")',
        ("tests/test_launch.py::test_slurm_node_lists", "tests/test_launch.py::test_discovery"),
    ),
    Mutant(
        "discovery: MPI and Slurm variables ignored",
        "launcher/discovery.py",
        "        found = _from_launcher(env, default_port)",
        "        found = None",
        (
            "tests/test_launch.py::test_discovery",
            "tests/test_launch.py::test_init_distributed_refuses_instead_of_a_world_of_one",
        ),
    ),
    Mutant(
        "discovery: a world with no MASTER_ADDR is not refused",
        "launcher/discovery.py",
        "    if found.world_size > 1 and found.master_addr is None:",
        "    if False:",
        (
            "tests/test_launch.py::test_a_world_with_no_address_is_refused",
            "tests/test_launch.py::test_init_distributed_refuses_instead_of_a_world_of_one",
        ),
    ),
    Mutant(
        "init_distributed: discovered ranks not applied (a world of one each)",
        "world.py",
        "            os.environ.update(found.env())",
        "            pass",
        ("tests/test_launch.py::test_open_mpi_variables_alone_form_one_world",),
    ),
    # Checkpoints with offload, disk faults (tests/test_offload_checkpoint.py, test_disk_faults.py)
    Mutant(
        "streaming save skips the last sub-group",
        "checkpoint/shard.py",
        "    for m, cuts in shard.owned.items():\n        values = zero.read_master(m, opt)",
        "    for m, cuts in list(shard.owned.items())[:-1]:\n        values = "
        "zero.read_master(m, opt)",
        (
            "tests/test_offload_checkpoint.py::test_exact_resume_in_fresh_processes_and_without_offload",
        ),
    ),
    Mutant(
        "a save keeps every sub-group it read in memory",
        "checkpoint/shard.py",
        "        del values\n",
        '        engine.__dict__.setdefault("_held", []).append(values)\n',
        ("tests/test_offload_checkpoint.py::test_a_save_holds_one_sub_group_at_a_time",),
    ),
    Mutant(
        "an NVMe load restores the masters but not their optimizer state",
        "zero/offload.py",
        'names = [k for k in values if k != "master"]',
        "names = []",
        (
            "tests/test_offload_checkpoint.py::test_exact_resume_in_fresh_processes_and_without_offload",
        ),
    ),
    Mutant(
        "a failed checkpoint write is not shared with the other ranks",
        "checkpoint/state.py",
        "    errors = _gather_errors(run.comm, error)\n    if not errors:\n        return\n",
        "    errors = [(run.global_rank, error)] if error else []\n"
        "    if not errors:\n        return\n",
        ("tests/test_disk_faults.py::test_a_failed_checkpoint_write_fails_every_rank",),
    ),
    Mutant(
        "an NVMe swap write error is swallowed",
        "zero/nvme.py",
        '            raise self._failed("writing", key, exc) from exc',
        "            pass",
        ("tests/test_disk_faults.py::test_a_failed_swap_write_ends_every_rank[1]",),
    ),
    Mutant(
        "nvme space check off by the dtype size (stages 1-2)",
        "zero/sharded_optimizer.py",
        "need = sum(st.master.numel() for st in self.buckets) * 4 * 3",
        "need = sum(st.master.numel() for st in self.buckets) * 3",
        ("tests/test_disk_faults.py::test_an_nvme_path_too_small_is_refused",),
    ),
    Mutant(
        "nvme space check: two offloads on one disk checked apart",
        "zero/nvme.py",
        "mine = need = self.need + sum(s.need for s in list(_LIVE) if s.dev == self.dev)",
        "mine = need = self.need",
        ("tests/test_disk_faults.py::test_what_shares_a_disk_is_counted_together",),
    ),
    Mutant(
        "nvme space check: the other ranks on this host not counted",
        "zero/nvme.py",
        "        need *= local\n",
        "",
        ("tests/test_disk_faults.py::test_what_shares_a_disk_is_counted_together",),
    ),
    Mutant(
        "resumed sampler starts its epoch over",
        "data/sampler.py",
        "        self._resume = True",
        "        self._resume = False",
        (
            "tests/test_auto_resume.py::test_a_killed_rank_restarts_and_resumes_exactly[stage2-forward]",
        ),
    ),
    Mutant(
        "cuda: stage 3 sums the gradient norm into a host scalar",
        "zero/stage3.py",
        "        return self.grads.norms_sq(params).sum()",
        "        return self.grads.norms_sq(params).sum().cpu()",
        ("tests/test_cuda_path.py::test_a_step_on_the_device_waits_only_for_its_norm",),
    ),
    Mutant(
        "cuda: offloaded stage 2 adds a device piece into the host shard",
        "zero/grad_buffers.py",
        "            if shard.device == st.piece.device:",
        "            if True:",
        (f"{CUDA}[stage2-offload]",),
    ),
    Mutant(
        "cuda: zero.Init broadcasts the host parameter",
        "zero/params.py",
        "full = p.data.to(comm.topo.device).contiguous()",
        "full = p.data.contiguous()",
        (f"{CUDA}[stage3-zero-init]",),
    ),
    Mutant(
        "cuda: pipeline shape header in host memory",
        "pipeline/executor.py",
        "return torch.tensor(h, dtype=torch.int64, device=t.device)",
        "return torch.tensor(h, dtype=torch.int64)",
        (f"{CUDA}[pipeline-1f1b]",),
    ),
    Mutant(
        "cuda: tied weights broadcast from host memory",
        "pipeline/module.py",
        "data = p.data.to(self.topology.device)",
        "data = p.data",
        (f"{CUDA}[pipeline-1f1b]",),
    ),
    Mutant(
        "cuda: the NVMe store writes a device tensor through numpy",
        "zero/nvme.py",
        'view = t.detach().to("cpu").contiguous().view(torch.uint8).numpy()',
        "view = t.detach().contiguous().view(torch.uint8).numpy()",
        (f"{CUDA}[stage3-offload-param-nvme]",),
    ),
    Mutant(
        "cuda: checkpoints leave the device generator out",
        "checkpoint/shard.py",
        'if run.device.type == "cuda":  # the device\'s generator draws its dropout masks',
        "if False:",
        (f"{CUDA_RNG}[resume-dropout]",),
    ),
    Mutant(
        "cuda: activation checkpointing replays the host generator only",
        "activation_checkpointing/recompute.py",
        "self.rng = _RNG(any(torch.is_tensor(a) and a.is_cuda for a in args))",
        "self.rng = _RNG(False)",
        (f"{CUDA_RNG}[activation-checkpointing-dropout]",),
    ),
    Mutant(
        "cuda: the NCCL group is not bound to LOCAL_RANK's device",
        "world.py",
        'bound = {"device_id": device}',
        "bound = {}",
        ("tests/test_cuda_path.py::test_nccl_init_binds_the_local_rank_device",),
    ),
    Mutant(
        "cuda: a group made elsewhere binds a device that is not visible",
        "world.py",
        "    index = local_device_index(int(local), torch.cuda.device_count())",
        "    index = int(local)",
        ("tests/test_cuda_path.py::test_a_group_made_elsewhere_gets_the_local_rank_device",),
    ),
    Mutant(
        "cuda: resumed fused Adam gets a host step",
        "checkpoint/restore.py",
        "device=master.device if on_device else",
        "device=None if on_device else",
        (f"{CUDA}[stage2-resume]",),
    ),
    Mutant(
        "cuda: a user's CPUAdam is bound to device masters",
        "compose.py",
        "if isinstance(optimizer, CPUAdam) and on_device:",
        "if False:",
        (
            "tests/test_cuda_path.py::test_a_users_cpu_adam_without_offload_is_refused_on_the_device",
        ),
    ),
    Mutant(
        "fp16 at dp 1 (stages 0-2): the update is not unscaled",
        "zero/sharded_optimizer.py",
        "if self.dp > 1 else 1.0 / loss_scale",
        "if self.dp > 1 else 1.0",
        ("tests/test_cuda_path.py::test_the_gpu_check_script_runs_its_checks_on_the_cpu",),
    ),
    Mutant(
        "cuda: wall_clock_breakdown times the launch, not the work",
        "engine/__init__.py",
        "self.clock = device_clock(device, config.wall_clock_breakdown)",
        "self.clock = device_clock(device, False)",
        ("tests/test_cuda_path.py::test_gpu_seconds_wait_for_the_device_only_when_asked_for",),
    ),
    Mutant(
        "cuda: the comms logger times the launch, not the collective",
        "engine/__init__.py",
        "device, config.wall_clock_breakdown or config.comms_logger.enabled",
        "device, config.wall_clock_breakdown",
        ("tests/test_cuda_path.py::test_gpu_seconds_wait_for_the_device_only_when_asked_for",),
    ),
    Mutant(
        "cuda: an offloaded optimizer keeps torchrun's one thread",
        "compose.py",
        "share = max(1, (os.cpu_count() or 1) // local)",
        "share = 1",
        ("tests/test_cuda_path.py::test_an_offloaded_optimizer_gets_the_cores_on_a_gpu_node",),
    ),
    Mutant(
        "cuda: the monitors leave the allocator's figures out",
        "monitor/training.py",
        "for kind, nbytes in report.device_memory().items():",
        "for kind, nbytes in {}.items():",
        (
            "tests/test_cuda_path.py::test_the_cuda_allocator_figures_are_reported_beside_the_census",
        ),
    ),
    Mutant(
        "start: a whole gradient buffer made before the parameters' own storage goes",
        "zero/flat_params.py",
        "        params_flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)\n",
        "        params_flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)\n"
        "        _early = torch.zeros(layout.padded_numel, dtype=grad_dtype, device=device)\n",
        ("tests/test_cuda_path.py::test_the_start_peaks_near_the_steady_state",),
    ),
    Mutant(
        "loss spike rollback rewinds the data with the weights",
        "checkpoint/loss_spike.py",
        "            vars(sampler).update(position)\n",
        "            pass\n",
        (SPIKE,),
    ),
    Mutant(
        "loss spike rollback starts the engine loader over",
        "checkpoint/loss_spike.py",
        "        run.state.data_iter = data_iter\n",
        "",
        (SPIKE,),
    ),
    Mutant(
        "loss spike does not hold the automatic save back",
        "checkpoint/loss_spike.py",
        "report.hold_save = report.hold_save or not self._judge(report)",
        "report.hold_save = report.hold_save or not (self._judge(report) or True)",
        (SPIKE,),
    ),
    Mutant(
        "loss spike patience ignored",
        "checkpoint/loss_spike.py",
        "if self.suspects >= self.cfg.patience:",
        "if self.suspects >= 1:",
        (SPIKE,),
    ),
    Mutant(
        "loss spike max_rollbacks off by one",
        "checkpoint/loss_spike.py",
        "if len(self.rollbacks) >= self.cfg.max_rollbacks:",
        "if len(self.rollbacks) > self.cfg.max_rollbacks:",
        (SPIKE_ERR,),
    ),
    Mutant(
        "sampler position saved per rank, not over all ranks",
        "data/sampler.py",
        '"consumed_samples": self.position * self.num_replicas,',
        '"consumed_samples": self.position,',
        (
            "tests/test_auto_resume.py::test_a_relaunch_on_fewer_ranks_resumes_on_the_new_layout",
            "tests/test_auto_resume.py::test_an_elastic_job_that_loses_a_node_resumes_on_the_one_left",
        ),
    ),
    Mutant(
        "automatic save before the micro-step is counted",
        "engine/__init__.py",
        "        self.micro_steps += 1  # before the count: an automatic save keeps whole windows\n"
        "        if boundary:\n"
        "            self.after_step.count(self.outcome)",
        "        if boundary:\n            self.after_step.count(self.outcome)\n"
        "        self.micro_steps += 1",
        (
            "tests/test_auto_resume.py::test_a_killed_rank_restarts_and_resumes_exactly[stage2-forward]",
        ),
    ),
    Mutant(
        "async save: rank 0 moves latest without the other ranks' writes",
        "checkpoint/async_save.py",
        '[f"{job.key}/rank{r}" for r in range(job.world)]',
        '[f"{job.key}/rank{r}" for r in range(1)]',
        (
            "tests/test_async_save.py::test_a_failed_write_on_one_rank_leaves_latest_and_fails_every_rank",
        ),
    ),
    Mutant(
        "async save snapshot aliases the live masters",
        "checkpoint/shard.py",
        'tensors = {k: t.detach().to("cpu", copy=True) for k, t in produce(run, shard)}',
        'tensors = {k: t.detach().to("cpu") for k, t in produce(run, shard)}',
        ("tests/test_async_save.py::test_async_save_is_a_snapshot_and_resumes_exactly[2]",),
    ),
    Mutant(
        "keep_last removes the tag latest names",
        "checkpoint/tags.py",
        "        if tag == latest:",
        "        if False:",
        ("tests/test_async_save.py::test_keep_last_never_removes_latest_nor_other_tags",),
    ),
    Mutant(
        "a failed background write is not raised by step()",
        "checkpoint/checkpointer.py",
        "        self.poll()\n        every = self.cfg.save_interval",
        "        every = self.cfg.save_interval",
        (
            "tests/test_async_save.py::test_a_failed_write_on_one_rank_leaves_latest_and_fails_every_rank",
        ),
    ),
    Mutant(
        "safe_set_full_grad mid-window at stages 0-1: each rank's share not divided by dp",
        "zero/grad_buffers.py",
        "grads_flat[rng].copy_(value / (cut.prescale * cut.size))",
        "grads_flat[rng].copy_(value)",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s1]",),
    ),
    Mutant(
        "safe_set_full_grad at stage 1: written before the boundary's reduction is waited for",
        "zero/grad_buffers.py",
        "        reduced = f.reduces and f.reducer.settle()\n"
        "        if cut.size > 1 and not reduced:  # every rank",
        "        reduced = False\n        if cut.size > 1 and not reduced:  # every rank",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s1]",),
    ),
    Mutant(
        "safe_set_full_grad: the mean stored as is, not summed over dp and scaled",
        "engine/full_params.py",
        "return mean / self.engine.zero.grad_post(self.engine.loss_scaler.loss_scale)",
        "return mean",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s2]",),
    ),
    Mutant(
        "safe_set_full_grad on NVMe (stage 3): the step's norm keeps the old gradient",
        "zero/masters.py",
        "        self.sq[p] = torch.linalg.vector_norm(value, dtype=torch.float32).square()\n",
        "",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s3_nvme]",),
    ),
    Mutant(
        "safe_set_local_fp32_param: the other ranks' pieces not gathered",
        "engine/full_params.py",
        "flat = gather_full([st.like(piece)], self.engine.comm)[0]",
        "flat = piece.repeat(st.world)[: st.numel]",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s3]",),
    ),
    Mutant(
        "safe_update_full_grad_vectorized: the updated gradient not written back",
        "utils.py",
        "            safe_set_full_grad(p, update_func(grad, p))",
        "            update_func(grad, p)",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s0]",),
    ),
    Mutant(
        "api table: a name it says works renamed in zerostack",
        "utils.py",
        "def safe_get_local_grad(param",
        "def safe_get_local_gradient(param",
        (
            "tests/test_api_surface.py::test_names_that_work_or_differ_resolve_and_unsupported_ones_do_not",
        ),
    ),
    Mutant(
        "api table: zerostack grows a name the table says is not supported",
        "utils.py",
        "from .engine.full_params import engine_of\n",
        "from .engine.full_params import engine_of\n\nOnDevice = None\n",
        (
            "tests/test_api_surface.py::test_names_that_work_or_differ_resolve_and_unsupported_ones_do_not",
        ),
    ),
    Mutant(
        "api table: an engine method zerostack lacks marked works",
        "compat/deepspeed/_api/engine.py",
        'f"{ENGINE}.set_train_batch_size": _no(',
        'f"{ENGINE}.set_train_batch_size": _works(',
        ("tests/test_api_surface.py::test_engine_methods_and_attributes_on_a_real_engine",),
    ),
    Mutant(
        "api table: an entry edited without regenerating the reference page",
        "compat/deepspeed/_api/modules.py",
        '_no("no kernel injection")',
        '_no("no kernels injected")',
        ("tests/test_api_surface.py::test_the_reference_table_is_the_generated_one",),
    ),
    # stage 3's gather budget (tests/test_stage3_live.py)
    Mutant(
        "stage-3 prefetch ignores stage3_max_live_parameters",
        "zero/coordinator.py",
        "room = min(self.prefetch_numel - inflight, self.max_live_numel - self.live_numel)",
        "room = self.prefetch_numel - inflight",
        (LIVE,),
    ),
    Mutant(
        "stage-3 default prefetch is DeepSpeed's 5e7 (a small model gathered whole)",
        "config/zero.py",
        "return self.stage3_prefetch_bucket_size if given else None",
        "return self.stage3_prefetch_bucket_size",
        (LIVE,),
    ),
    Mutant(
        "stage3_max_reuse_distance ignored",
        "zero/coordinator.py",
        "            if p in reused:",
        "            if False:",
        (LIVE,),
    ),
    Mutant(
        "a resolved gather keeps its receive buffer alive",
        "zero/unit_gather.py",
        "        self._finish = None  # the receive buffer: the parameters hold their own copies",
        "",
        (LIVE,),
    ),
    Mutant(
        "the watchdog leaves a stopped peer on its host to the launcher",
        "watchdog/__init__.py",
        "            self._end_stopped_peers()\n",
        "",
        (
            "tests/test_watchdog.py::test_a_frozen_rank_ends_the_job_within_the_bound[step-2-all_reduce]",
        ),
    ),
    Mutant(
        "empty_partition_cache releases nothing",
        "zero/coordinator.py",
        "        self._drop_inflight()\n        self._drop_kept()\n"
        "        self.gathers.drop_secondaries()\n\n    @eager\n    def _begin_pass",
        "        pass\n\n    @eager\n    def _begin_pass",
        (LIVE,),
    ),
    Mutant(
        "client_state tensors come back as their markers",
        "checkpoint/client_state.py",
        "                return tensors[value[MARK]]",
        "                return value",
        (f"{C}::test_exact_resume[0-1-False]",),
    ),
    Mutant(
        "client_state tensors loaded unverified",
        "checkpoint/client_state.py",
        "            if sha256(t) != want:",
        "            if False:",
        (f"{C}::test_client_state_is_json_and_tensors_checked",),
    ),
    Mutant(
        "Ulysses all-to-all joins the shards in reverse rank order",
        "comm/functional.py",
        "return torch.cat(received.unbind(0), dim=gather)",
        "return torch.cat(received.unbind(0)[::-1], dim=gather)",
        (f"{U}::test_all_to_all_trades_sequence_shards_for_head_shards_and_back[2]",),
    ),
    Mutant(
        "Ulysses all-to-all backward repeats the forward exchange",
        "comm/functional.py",
        "_all_to_all(grad.contiguous(), gather, scatter, axis)",
        "_all_to_all(grad.contiguous(), scatter, gather, axis)",
        (f"{U}::test_distributed_attention_is_attention_over_the_whole_sequence[2-False]",),
    ),
    Mutant(
        "Ulysses positions start at 0 on every sp rank",
        "models/gpt.py",
        'pos = sequence_piece(whole, 0, topo.rank("sp"), sp, topo.ring)',
        "pos = whole[:t]",
        (f"{U}::test_gpt_matches_single_process[2-2-1-0-False]",),
    ),
    Mutant(
        "the GPT's attention is left unwired under sp",
        "models/gpt_tp.py",
        "    if topology.ulysses > 1:  # [b, t, heads",
        "    if False:  # [b, t, heads",
        (f"{U}::test_gpt_matches_single_process[2-2-1-0-False]",),
    ),
    Mutant(
        "a rank's sp coordinate is its data replica",
        "topology.py",
        'return self.mesh.get_local_rank("dp") % self.sp',
        'return self.mesh.get_local_rank("dp") // self.sp',
        (f"{U}::test_gpt_matches_single_process[4-2-1-3-False]",),
    ),
    Mutant(
        "the sp ranks of a batch read different samples",
        "compose.py",
        "        num_replicas=topo.data_parallel_size,",
        "        num_replicas=topo.dp,",
        (f"{U}::test_the_loader_hands_each_sp_rank_its_shard_of_the_same_samples",),
    ),
    Mutant(
        "every sp rank takes the first sequence shard",
        "sequence/layer.py",
        "return sequence_piece(t, dim, rank, sp, topology.ring).contiguous()",
        "return sequence_piece(t, dim, 0, sp, topology.ring).contiguous()",
        (f"{U}::test_the_loader_hands_each_sp_rank_its_shard_of_the_same_samples",),
    ),
    Mutant(
        "the engine's batch counts sp ranks as replicas",
        "validate.py",
        "cfg.resolve_batch(topo.data_parallel_size)",
        "cfg.resolve_batch(topo.dp)",
        (f"{U}::test_the_loader_hands_each_sp_rank_its_shard_of_the_same_samples",),
    ),
    Mutant(
        "sequence_parallel_size does not wire a plain model",
        "compose.py",
        "wire_ulysses = topo.sp > 1 and wires_sequence(model, topo, built)",
        "wire_ulysses = topo.sp > 1 and wires_sequence(model, topo, built) and False",
        (f"{U}::test_gpt_matches_single_process[4-4-1-2-True]",),
    ),
    Mutant(
        "a pipeline stage's positions start at 0 on every Ulysses shard",
        "models/gpt_pipe.py",
        'pos = sequence_piece(whole, 0, topo.rank("sp"), topo.sp, topo.ring)',
        "pos = whole[:n]",
        (f"{U}::test_gpt_under_a_pipeline_matches_single_process[1f1b]",),
    ),
    Mutant(
        "a pipeline's blocks are built without the Ulysses grid (each attends within its shard)",
        "models/gpt_pipe.py",
        "    grid = (topology if topology is not None and topology.sp > 1 else tp, extra[1])",
        "    grid = extra",
        (f"{U}::test_gpt_under_a_pipeline_matches_single_process[1f1b]",),
    ),
    Mutant(
        "a model whose attention cannot exchange shards is accepted under sp",
        "sequence/check.py",
        '    if built is None and callable(getattr(model, "parallelize", None)):\n'
        "        return True\n",
        '    if built is None and callable(getattr(model, "parallelize", None)):\n'
        "        return True\n    return False\n",
        (f"{U}::test_bad_grids_are_refused_naming_the_key",),
    ),
    Mutant(
        "the MoE GPT's loss leaves the auxiliary loss out",
        "models/gpt.py",
        "loss = loss + self.cfg.moe_aux_loss_coef * aux",
        "loss = loss + 0.0 * aux",
        # not the parity test: its reference is the same GPT, so it loses the term too
        (f"{MOE}::test_the_loss_carries_the_auxiliary_loss_and_drops_happen_where_asked",),
    ),
    Mutant(
        "top-2's second choices do not queue behind the first choices",
        "moe/sharded_moe.py",
        "locations2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)",
        "locations2 = torch.cumsum(mask2, dim=0) - 1",
        (f"{MOE}::test_gates_route_drop_and_weigh_as_the_spec[2-0.5-1-True]",),
    ),
    Mutant(
        "top-2's capacity is not doubled",
        "moe/sharded_moe.py",
        "_capacity(num_tokens, num_experts, 2 * capacity_factor, min_capacity)",
        "_capacity(num_tokens, num_experts, capacity_factor, min_capacity)",
        (f"{MOE}::test_gates_route_drop_and_weigh_as_the_spec[2-4.0-4-True]",),
    ),
    Mutant(
        "top-2's weights are not renormalised over the kept choices",
        "moe/sharded_moe.py",
        "gates1 = (gates1_s / denom_s)[:, None] * mask1_f",
        "gates1 = gates1_s[:, None] * mask1_f",
        (f"{MOE}::test_gates_route_drop_and_weigh_as_the_spec[2-4.0-4-True]",),
    ),
    Mutant(
        "an expert keeps one token past its capacity",
        "moe/sharded_moe.py",
        "mask = mask * torch.lt(locations, capacity)",
        "mask = mask * torch.le(locations, capacity)",
        (f"{MOE}::test_gates_route_drop_and_weigh_as_the_spec[1-1.0-2-True]",),
    ),
    Mutant(
        "top-1's auxiliary loss misses its factor of num_experts",
        "moe/sharded_moe.py",
        "l_aux = torch.sum(me * ce) * num_experts",
        "l_aux = torch.sum(me * ce)",
        (f"{MOE}::test_gates_route_drop_and_weigh_as_the_spec[1-8.0-4-True]",),
    ),
    Mutant(
        "tokens are dispatched scaled by their gate weights (applied twice)",
        "moe/sharded_moe.py",
        'torch.einsum("sec,sm->ecm", dispatch_mask.type_as(hidden), tokens)',
        'torch.einsum("sec,sm->ecm", combine_weights.type_as(hidden), tokens)',
        (f"{MOE}::test_the_layer_is_a_weighted_sum_of_each_tokens_experts[1-False]",),
    ),
    Mutant(
        "expert gradients are not divided by ep",
        "moe/sync.py",
        "        return grad / ep",
        "        return grad",
        (f"{MOE}::test_expert_parallel_gpt_matches_single_process[ep2-top1-drops-stage0]",),
    ),
    Mutant(
        "the ep ranks' tokens never reach the other ranks' experts",
        "comm/functional.py",
        "        axis.all_to_all(out, x)\n        return out",
        "        out.copy_(x)\n        return out",
        (f"{MOE}::test_expert_parallel_gpt_matches_single_process[ep2-top1-drops-stage0]",),
    ),
    Mutant(
        "the norm counts the shared parameters on every ep rank",
        "engine/replicas.py",
        "            held = held | (self._ep_replicas - cut_over_ep)",
        "            held = held",
        (f"{MOE}::test_expert_parallel_gpt_matches_single_process[ep2-top1-drops-stage0]",),
    ),
    Mutant(
        "the ep ranks of a dp rank read the same batch",
        "topology.py",
        'return self.dp_rank // self.sp * self.ep + self.rank("ep")',
        "return self.dp_rank // self.sp * self.ep",
        (f"{MOE}::test_expert_parallel_gpt_matches_single_process[ep2-top1-drops-stage0]",),
    ),
    Mutant(
        "checkpoints key experts by their local index",
        "moe/utils.py",
        "            first = ep_rank * m.num_local_experts",
        "            first = 0",
        (f"{MOE}::test_an_ep_checkpoint_resumes_and_loads_at_ep_1_and_4",),
    ),
    Mutant(
        "expert gradients reduced over all data-parallel ranks, like the shared ones",
        "engine/replicas.py",
        "            {p for p in module.parameters() if not is_moe_param(p)} if topology.ep > 1",
        "            set(module.parameters()) if topology.ep > 1",
        (f"{MOE}::test_expert_parallel_gpt_matches_single_process[ep2-top1-drops-stage0]",),
    ),
    Mutant(
        "stages 0-2 keep each rank's own initial weights",
        "zero/flat_params.py",
        "            if cut.size > 1:\n"
        "                comm.broadcast(value, src=0, axis=cut.axis)\n"
        "            if value is not dst:",
        "            if False:\n"
        "                comm.broadcast(value, src=0, axis=cut.axis)\n"
        "            if value is not dst:",
        (T_ALIKE,),
    ),
    Mutant(
        "stage 3 keeps each rank's own initial weights",
        "zero/params.py",
        "    if world > 1:\n        comm.broadcast(full, src=0, axis=axis)",
        "    if False:\n        comm.broadcast(full, src=0, axis=axis)",
        (T_ALIKE,),
    ),
    Mutant(
        "fp32 stages 0-2 broadcast the parameter's own storage at the start",
        "zero/flat_params.py",
        "            if dtype == torch.float32:\n                value = dst.copy_(",
        "            if False:\n                value = dst.copy_(",
        (f"{T_PEAK}[1-None-8-8]",),
    ),
    Mutant(
        "the comm log keeps every record of a long run",
        "comm/records.py",
        "            del self.records[: max(0, drop)]\n",
        "            pass\n",
        (
            "tests/test_comm_log.py::test_a_long_run_holds_a_bounded_log",
            "tests/test_comm_log.py::test_an_engine_run_holds_the_last_64_steps_of_its_log",
        ),
    ),
    Mutant(
        "a collective's seq counts only the held records",
        "comm/records.py",
        "self.step, self.count, ranks=ranks)",
        "self.step, len(self.records), ranks=ranks)",
        ("tests/test_comm_log.py::test_a_long_run_holds_a_bounded_log",),
    ),
    Mutant(
        "int4 qgZ: the bits key never reaches the reducer (int8 sent)",
        "zero/stage3.py",
        "            bits=gradient_bits,\n",
        "",
        (T_INT4,),
    ),
    Mutant(
        "int4 qgZ: values scaled to int8's 127 levels, then clamped at 7",
        "zero/quantize.py",
        "    return LEVELS if bits == 8 else 7",
        "    return LEVELS",
        (T_INT4_ROUND,),
    ),
    Mutant(
        "int4 qgZ: the pair's nibbles swapped",
        "zero/quantize.py",
        "    return pairs[:, 0] | (pairs[:, 1] << 4)",
        "    return pairs[:, 1] | (pairs[:, 0] << 4)",
        (T_INT4_WIRE,),
    ),
    Mutant(
        "int4 qgZ: negative values unpacked without the offset",
        "zero/quantize.py",
        "    low = (packed & 15).to(torch.int8) - 8",
        "    low = (packed & 15).to(torch.int8)",
        (T_INT4_ROUND,),
    ),
    Mutant(
        "int4 qgZ: a byte a value, as int8 (the bytes ratio)",
        "zero/quantize.py",
        "    return numel if bits == 8 else -(-numel // 2)",
        "    return numel",
        (T_INT4_WIRE,),
    ),
    Mutant(
        "int4 qgZ: the receiver unpacks as int8",
        "zero/stage3_reduce.py",
        "            quantize.unpack(received, numels, torch.float32, self.bits),",
        "            quantize.unpack(received, numels, torch.float32),",
        (T_INT4,),
    ),
    Mutant(
        "found_inf never set: a non-finite step updates the weights on the device",
        "engine/update.py",
        "opt.found_inf = torch.isfinite(norm).logical_not().to(torch.float32)",
        "opt.found_inf = torch.zeros((), device=norm.device)",
        ("tests/test_nonfinite.py",),
    ),
    Mutant(
        "the host reads the norm before the step is queued (the GPU idles meanwhile)",
        "engine/update.py",
        "        self._norm_reader.start(norm)\n",
        "        self._norm_reader.start(norm)\n        self._norm_reader.value()\n",
        (T_WAITS,),
    ),
    Mutant(
        "the norm reaches the host through a blocking copy (drains the stream)",
        "core/clock.py",
        "self.host.copy_(t.detach(), non_blocking=self.event is not None)",
        "self.host.copy_(t.detach())",
        (T_WAITS,),
    ),
    Mutant(
        "a fused optimizer still waits for the norm before its step",
        "engine/update.py",
        "self._skips_on_device = fused and self._masters_on_device",
        "self._skips_on_device = False",
        (T_WAITS,),
    ),
    Mutant(
        "the clipping factor is not capped at 1 (a small norm scales gradients up)",
        "engine/update.py",
        "return (clip / (norm + 1e-6)).clamp(max=1.0) * post",
        "return (clip / (norm + 1e-6)) * post",
        (T_SGD_CLIP,),
    ),
    Mutant(
        "the clipping factor leaves out the mean over dp",
        "engine/update.py",
        "return (clip / (norm + 1e-6)).clamp(max=1.0) * post",
        "return (clip / (norm + 1e-6)).clamp(max=1.0)",
        (T_SGD_CLIP,),
    ),
    Mutant(
        "the norm's host copy is read before its event (a value the GPU may not have written)",
        "core/clock.py",
        "            self.event.synchronize()\n",
        "            pass\n",
        (T_WAITS,),
    ),
    Mutant(
        "a staging buffer is rewritten while its last copy to the device may still read it",
        "zero/offload.py",
        "            event.synchronize()  # its last copy may still be reading it\n",
        "",
        (T_STAGING,),
    ),
    Mutant(
        "the offloaded write-back waits for its copy to the device",
        "zero/offload.py",
        "        dst.copy_(buf, non_blocking=True)",
        "        dst.copy_(buf)",
        (T_OFFLOAD_WAITS,),
    ),
    Mutant(
        "offloaded pieces in host memory go up for a gather in a blocking copy",
        "zero/offload.py",
        'src.clone() if device.type == "cpu" else src.to(device, non_blocking=True)',
        'src.clone() if device.type == "cpu" else src.to(device)',
        (T_OFFLOAD_WAITS,),
    ),
    Mutant(
        "offloaded pieces read from their files go up in a blocking copy",
        "zero/param_swap.py",
        "                p._zs.piece = host.to(self.device, non_blocking=True)",
        "                p._zs.piece = host.to(self.device)",
        (T_OFFLOAD_WAITS,),
    ),
    Mutant(
        "NVMe pieces are read at their gather, not ahead of it",
        "zero/coordinator.py",
        "        if not self.param_swapper.reads_ahead or not self.order.following:",
        "        if True:",
        (T_READ_AHEAD,),
    ),
    Mutant(
        "NVMe pieces are read on the training thread",
        "zero/param_swap.py",
        "        self.reads_ahead = isinstance(store, NVMeStore)",
        "        self.reads_ahead = False",
        (T_READ_AHEAD,),
    ),
    Mutant(
        "the reads ahead a pass did not use are kept past it",
        "zero/coordinator.py",
        "        self._inflight.clear()\n        self.param_swapper.forget_reads()\n",
        "        self._inflight.clear()\n",
        (T_READ_AHEAD,),
    ),
    Mutant(
        "offloaded gradients come down on the compute stream (the compute waits for the copy)",
        "zero/offload.py",
        "        with torch.cuda.stream(side):\n            host.copy_(t.reshape(-1), non_block",
        "        with torch.cuda.stream(None):\n            host.copy_(t.reshape(-1), non_block",
        (T_DOWN_SIDE,),
    ),
    Mutant(
        "a gradient's copy down starts before the collective that made it",
        "zero/offload.py",
        "        side.wait_stream(torch.cuda.current_stream())\n        with torch.cuda.stream(s",
        "        with torch.cuda.stream(s",
        (T_DOWN_SIDE,),
    ),
    Mutant(
        "a gradient piece is freed while its copy down may still read it",
        "zero/offload.py",
        "        t.record_stream(side)\n",
        "",
        (T_DOWN_SIDE,),
    ),
    Mutant(
        "offloaded pieces go up on the compute stream (no overlap)",
        "zero/param_swap.py",
        '        if self.device.type != "cuda":\n            return None\n        if self._stream',
        "        if True:\n            return None\n        if self._stream",
        (T_SIDE,),
    ),
    Mutant(
        "the gathered pieces are read without waiting for the side stream",
        "zero/unit_gather.py",
        "            torch.cuda.current_stream().wait_event(self._ready)",
        "            pass",
        (T_SIDE,),
    ),
    Mutant(
        "a gathered parameter made on the side stream is freed without record_stream",
        "zero/unit_gather.py",
        "                full.record_stream(torch.cuda.current_stream())",
        "                pass",
        (T_SIDE,),
    ),
    Mutant(
        "the side stream's receive buffer is freed without record_stream",
        "zero/gathers.py",
        "        if record:\n            out.record_stream(torch.cuda.current_stream())\n"
        "        rows = out.view(world, width)",
        "        rows = out.view(world, width)",
        (T_SIDE,),
    ),
    Mutant(
        "reduce_scatter false: every rank keeps rank 0's slice of the all-reduced bucket",
        "zero/grad_buffers.py",
        "piece = self._sent[self._rank * n : (self._rank + 1) * n]",
        "piece = self._sent[:n]",
        (f"{P}[dp4-all-reduce]",),
    ),
    Mutant(
        "stage 2: staged buckets held to the end of backward",
        "zero/sharded_optimizer.py",
        "self.reducer = GradReducer(sizes, self.grads.launch, done)",
        "self.reducer = GradReducer(sizes, self.grads.launch, done, in_flight=1 << 30)",
        ("tests/test_stage2_live.py::test_staged_buckets_go_during_backward[True]",),
    ),
    Mutant(
        "builder: stage 1 keeps the whole masters and optimizer state (stage 0's)",
        "zero/build.py",
        "sharded_state=stage > 0,",
        "sharded_state=stage > 1,",
        ("tests/test_memory.py::test_live_storage_census_matches_the_zero_formulas[2]",),
    ),
    Mutant(
        "builder: stage 2 holds the full gradient buffer (stage 1's)",
        "zero/build.py",
        "grads=ShardedGrads if stage == 2 else FullGrads,",
        "grads=FullGrads,",
        ("tests/test_memory.py::test_live_storage_census_matches_the_zero_formulas[2]",),
    ),
    Mutant(
        "a sharded state's bucket all-reduced in place: no piece for the step",
        "zero/grad_buffers.py",
        "        if cut.world > 1:\n            return self._reduce(st, chunk)\n",
        "",
        ("tests/test_comm_log.py::test_stages_1_2_move_two_psi[2-1-1-None]",),
    ),
    Mutant(
        "a checkpoint of stage 1 written by dp rank 0 alone",
        "zero/flat_state.py",
        "return self.sharded_state or self.rank == 0",
        "return self.rank == 0",
        ("tests/test_checkpoint.py::test_exact_resume[1-2-False]",),
    ),
    Mutant(
        "a strategy member used outside zero/ is not declared (state_axis)",
        "zero/strategy.py",
        "    def state_axis(self, p: nn.Parameter) -> str | None:\n",
        "    def _state_axis(self, p: nn.Parameter) -> str | None:\n",
        ("tests/test_architecture.py::test_every_strategy_member_used_outside_zero_is_declared",),
    ),
    Mutant(
        "empty_partition_cache releases nothing at stage 3",
        "compat/deepspeed/runtime/engine.py",
        "        if isinstance(self.zero, Pieces):\n            self.zero.release_gathered()",
        "        if isinstance(self.zero, Pieces):\n            pass",
        ("tests/test_stage3_live.py::test_gather_budget_follows_deepspeeds_keys",),
    ),
    Mutant(
        "stage 1: the boundary's reduction not waited for at the end of backward",
        "zero/grad_buffers.py",
        "if self.flat.grads_sharded and self.communicates_now:",
        "if False:",
        ("tests/test_memory.py::test_live_storage_census_matches_the_zero_formulas[2]",),
    ),
    Mutant(
        "gloo reduce-scatter: the first two ranks' rows only",
        "comm/gloo.py",
        "for r in range(2, rows.shape[0]):",
        "for r in range(3, rows.shape[0]):",
        (f"{P}[dp4]",),
    ),
    Mutant(
        "gloo reduce-scatter: this rank's row not summed with the others",
        "comm/gloo.py",
        "torch.add(rows[0], rows[1], out=self._out.view(-1))",
        "self._out.view(-1).copy_(rows[0])",
        (f"{P}[dp2]",),
    ),
    Mutant(
        "reduce_scatter false ignored: buckets reduce-scattered",
        "zero/grad_buffers.py",
        "if not f.reduce_scatter:",
        "if False:",
        ("tests/test_comm_log.py::test_stages_1_2_move_two_psi[2-1-2-False]",),
    ),
    Mutant(
        "reduce_scatter true: buckets all-reduced",
        "zero/grad_buffers.py",
        "if not f.reduce_scatter:",
        "if True:",
        ("tests/test_comm_log.py::test_stages_1_2_move_two_psi[2-1-2-None]",),
    ),
    Mutant(
        "stage 2: a pooled staging buffer's padding not zeroed",
        "zero/grad_buffers.py",
        "staging[end - st.bucket.start :].zero_()",
        "staging[st.bucket.numel :].zero_()",
        (T_POISON,),
    ),
    Mutant(
        "stage 2: a parameter with no gradient sends a pooled buffer's old values",
        "zero/grad_buffers.py",
        "            if p not in self._ready:",
        "            if False:",
        (T_POISON,),
    ),
    Mutant(
        "stage 2: a later micro-step overwrites the shard a bucket was reduced into",
        "zero/grad_buffers.py",
        "no piece to add\n            st.shard_clean = False",
        "no piece to add",
        (f"{P}[dp2]",),
    ),
    Mutant(
        "stage 2: the shard never again marked zero after a step (a piece every time)",
        "zero/sharded_optimizer.py",
        "            st.shard_clean = True",
        "            pass",
        ("tests/test_stage2_live.py::test_the_first_micro_step_reduces_into_the_shard",),
    ),
    Mutant(
        "gloo reduce-scatter: the received rows not handed back to the pool",
        "comm/gloo.py",
        "self._pool.give(self._rows)",
        "pass",
        (f"{T}[2]",),
    ),
    Mutant(
        "stages 1-2 by bucket: every bucket stepped at every bucket's turn",
        "zero/write_back.py",
        "            st.master.grad = None\n        handles: list[tuple] = []",
        "        handles: list[tuple] = []",
        (T_ODD,),
    ),
    Mutant(
        "stages 1-2 by bucket: a bucket gathered before it is stepped",
        "zero/write_back.py",
        "                optimizer.step()\n                st.master.grad = None\n"
        "                self._bring(st, handles)",
        "                self._bring(st, handles)\n                optimizer.step()\n"
        "                st.master.grad = None",
        (T_ODD,),
    ),
    Mutant(
        "stages 1-2: never stepped by bucket",
        "zero/write_back.py",
        "and type(optimizer) in _ELEMENTWISE",
        "and False",
        (T_BY_BUCKET,),
    ),
    Mutant(
        "stages 1-2: a client's optimizer stepped by bucket",
        "zero/write_back.py",
        "and type(optimizer) in _ELEMENTWISE",
        "and isinstance(optimizer, _ELEMENTWISE)",
        (T_BY_BUCKET,),
    ),
    Mutant(
        "gloo all-gather: this rank's own row not written",
        "comm/gloo.py",
        "            rows[rank].copy_(src)",
        "            pass",
        (f"{P}[dp2]",),
    ),
    Mutant(
        "gloo all-gather: each peer's row received into the next one's",
        "comm/gloo.py",
        "recvs.append(dist.P2POp(dist.irecv, rows[r], peer, group))",
        "recvs.append(dist.P2POp(dist.irecv, "
        "rows[(r + 1) % world if (r + 1) % world != rank else r], peer, group))",
        (f"{P}[dp4]",),
    ),
    Mutant(
        "gloo all-gather of several pairs: only the first pair moved",
        "comm/gloo.py",
        "for output, input in zip(outputs, inputs, strict=True):",
        "for output, input in list(zip(outputs, inputs, strict=True))[:1]:",
        (f"{P}[dp2]",),
    ),
    Mutant(
        "custom_load_fn at ep > 1: experts under their global names, not the module's",
        "checkpoint/restore.py",
        "        out[local.get(name, name)] = t",
        "        out[name] = t",
        ("tests/test_moe.py::test_an_ep_checkpoint_resumes_and_loads_at_ep_1_and_4",),
    ),
    Mutant(
        "custom_load_fn at ep > 1: another ep rank's experts in src",
        "checkpoint/restore.py",
        "            continue  # another ep rank's expert",
        "            pass",
        ("tests/test_moe.py::test_an_ep_checkpoint_resumes_and_loads_at_ep_1_and_4",),
    ),
    Mutant(
        "stage-3 default prefetch one module deep",
        "zero/coordinator.py",
        "prefetch_numel = PREFETCH_UNITS * max((_numel(ps) for ps in self.units), default=0)",
        "prefetch_numel = max((_numel(ps) for ps in self.units), default=0)",
        ("tests/test_stage3_live.py::test_gather_budget_follows_deepspeeds_keys",),
    ),
    Mutant(
        "stage-3 staging: a parameter without a gradient keeps the pool's old values",
        "zero/stage3_reduce.py",
        "            if p not in filled:  # no gradient in this backward: zeros",
        "            if False:",
        (E,),
    ),
    Mutant(
        "stage-3 reduce pool kept between backwards",
        "zero/stage3_reduce.py",
        "        self.buffers.trim(0)  # nothing kept between backwards",
        "        pass",
        (T_CENSUS2,),
    ),
    Mutant(
        "scratch: no huge pages asked for",
        "core/scratch.py",
        "        buf.madvise(_HUGE)",
        "        pass",
        ("tests/test_scratch.py::test_a_large_buffer_asks_for_huge_pages",),
    ),
    Mutant(
        "stages 1-2 with nvme: the stepped piece not what is gathered",
        "zero/write_back.py",
        "src, st.updated = st.updated, None  # (nvme",
        "src, st.updated = None, None  # (nvme",
        (f"{P}[offload-nvme]",),
    ),
    Mutant(
        "scratch pool: nothing kept",
        "core/scratch.py",
        "        self.keep = keep",
        "        self.keep = 0",
        (f"{T}[2]",),
    ),
    Mutant(
        "the Lightning strategy divides the loss by the accumulation steps again",
        "integrations/lightning.py",
        "backward(tensor, *args, scale_wrt_gas=False, **kwargs)",
        "backward(tensor, *args, **kwargs)",
        (T_LT_DDP,),
    ),
    Mutant(
        "the Lightning strategy loses Lightning's own state on resume (loops start over)",
        "integrations/lightning.py",
        "                load_module_strict=module.strict_loading,\n"
        "            )\n            return client",
        "                load_module_strict=module.strict_loading,\n"
        "            )\n            return {}",
        (T_LT_RESUME,),
    ),
    Mutant(
        "the Lightning strategy clips at DeepSpeed's 1.0 when the Trainer does not clip",
        "integrations/lightning_config.py",
        '    config.setdefault("gradient_clipping", 0.0)',
        "    pass",
        (f"{LT}::test_the_trainers_settings_fill_the_config",),
    ),
    Mutant(
        "a config's accumulation steps silently lose to the Trainer's",
        "integrations/lightning_config.py",
        "    if key in config and config[key] != value:",
        "    if False:",
        (f"{LT}::test_contradicting_settings_are_refused_naming_both",),
    ),
    Mutant(
        "fresh-process validation skips the checkpoint's weights",
        "integrations/lightning.py",
        '        return {**client, "state_dict": full_state_dict(path, tag=TAG)}',
        '        return {**client, "state_dict": self.lightning_module.state_dict()}',
        (T_LT_RESUME,),
    ),
    Mutant(
        "client_state keys collide ({'a/b': t} and {'a': {'b': t}})",
        "checkpoint/client_state.py",
        '    part = str(part).replace("~", "~0").replace("/", "~1")',
        "    part = str(part)",
        (T_PICKLED,),
    ),
    Mutant(
        "pickled client_state is loaded without the opt-in",
        "checkpoint/client_state.py",
        "        if not pickled:\n            raise CheckpointError(",
        "        if False:\n            raise CheckpointError(",
        (T_PICKLED,),
    ),
    Mutant(
        "pickled client_state is loaded unverified",
        "checkpoint/client_state.py",
        '        if _digest(blob) != record["pickled"]["sha256"]:',
        "        if False:",
        (T_PICKLED,),
    ),
    Mutant(
        "a forward-only engine still steps every parameter (gradients kept)",
        "compose.py",
        "    groups = [] if forward_only else _param_groups(model, optimizer, model_parameters)",
        "    groups = _param_groups(model, optimizer, model_parameters)",
        (T_FORWARD_ONLY,),
    ),
    Mutant(
        "a forward-only engine's load reads optimizer state it has not got",
        "checkpoint/restore.py",
        "    with_state = load_optimizer_states and not load_module_only and opt is not None",
        "    with_state = load_optimizer_states and not load_module_only",
        (T_FORWARD_ONLY,),
    ),
    Mutant(
        "stage 3's linear runs backward outside the forward's autocast (bf16 grad x fp32 weight)",
        "zero/linear.py",
        "        with autocast_as(ctx.autocast):\n"
        "            return _LinearSavingWeight._backward(",
        "        if True:\n            return _LinearSavingWeight._backward(",
        ("tests/test_autocast.py::test_autocast_trains_at_every_stage_as_at_stage_0[3]",),
    ),
    Mutant(
        "the sequence-parallel linear runs backward outside the forward's autocast",
        "tensor_parallel/mappings.py",
        "        with autocast_as(ctx.autocast):  # as forward ran (a user's torch.autocast)",
        "        if True:",
        ("tests/test_autocast.py::test_autocast_with_tensor_and_sequence_parallelism",),
    ),
    Mutant(
        "the device is chosen by the backend's name (a gloo + NCCL group trains on the CPU)",
        "world.py",
        '    return "cuda" if devices.get("cuda", "gloo") != "gloo" else "cpu"',
        '    return "cuda" if backend == "nccl" else "cpu"',
        (
            "tests/test_topology.py::test_the_device_follows_what_the_group_does_on_cuda_not_its_name",
        ),
    ),
    Mutant(
        "the grid's device is read from get_backend() again",
        "topology.py",
        "        device_type = world_device_type()",
        '        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"',
        (
            "tests/test_topology.py::test_a_pre_initialised_gloo_and_nccl_group_builds_the_grid_on_the_gpu",
        ),
    ),
    Mutant(
        "LOCAL_RANK beyond the visible GPUs is used as the device index",
        "world.py",
        "    index = 0 if visible == 1 else local % visible",
        "    index = local",
        ("tests/test_topology.py::test_a_local_rank_beyond_the_visible_gpus_takes_one_it_sees",),
    ),
    Mutant(
        "NCCL: a collective leaves the log when wait() returns (a hang on the device is unseen)",
        "comm/records.py",
        "        if event is not None and running(event):\n            rec.event = event",
        "        if False:\n            rec.event = event",
        (
            "tests/test_watchdog.py::test_a_collective_the_device_never_completes_is_named",
            "tests/test_cuda_path.py::test_a_collective_stays_in_flight_until_the_device_has_run_it",
        ),
    ),
    Mutant(
        "a collective the device completed stays in flight (a false watchdog verdict)",
        "comm/records.py",
        "                self._close(self._on_device.popleft())",
        "                return",
        (
            "tests/test_watchdog.py::test_a_collective_the_device_never_completes_is_named",
            "tests/test_cuda_path.py::test_a_collective_stays_in_flight_until_the_device_has_run_it",
        ),
    ),
    Mutant(
        "a CPU collective waits for a CUDA event (gloo's are done in wait())",
        "comm/grid.py",
        "        self._log.end(self._record, _behind() if self._on_device else None)",
        "        self._log.end(self._record, _behind())",
        ("tests/test_watchdog.py::test_a_collective_done_when_waited_for_leaves_at_once",),
    ),
    Mutant(
        "NCCL's timeout is 30 minutes, not the watchdog's bound and a minute",
        "world.py",
        "    return timedelta(seconds=bound + NCCL_MARGIN)",
        "    return DEFAULT_TIMEOUT",
        (
            "tests/test_cuda_path.py::test_nccl_times_out_a_minute_after_the_watchdog_with_its_flight_recorder_on",
            "tests/test_cuda_path.py::test_initialize_gives_nccl_the_configs_watchdog_bound",
        ),
    ),
    Mutant(
        "NCCL's flight recorder is left off (a timeout names no collective)",
        "world.py",
        "            os.environ.setdefault(key, value)",
        "            pass",
        (
            "tests/test_cuda_path.py::test_nccl_times_out_a_minute_after_the_watchdog_with_its_flight_recorder_on",
        ),
    ),
    Mutant(
        "initialize gives NCCL the default bound, not the config's watchdog.timeout",
        "compose.py",
        "        init_distributed(timeout=default_timeout(watchdog=cfg.watchdog))",
        "        init_distributed()",
        ("tests/test_cuda_path.py::test_initialize_gives_nccl_the_configs_watchdog_bound",),
    ),
    Mutant(
        "offload pins nothing by default (each pageable copy stops the host on a GPU)",
        "config/zero.py",
        "    pin_memory: bool = True",
        "    pin_memory: bool = False",
        (
            "tests/test_cuda_path.py::test_offloading_queues_its_uploads_and_waits_only_for_the_gradients",
        ),
    ),
    Mutant(
        "the write-back's staging buffers are pageable",
        "zero/offload.py",
        "            buf = host_empty(dst.shape, dst.dtype, self.pin)",
        "            buf = torch.empty(dst.shape, dtype=dst.dtype)",
        (
            "tests/test_cuda_path.py::test_offloading_queues_its_uploads_and_waits_only_for_the_gradients",
        ),
    ),
    Mutant(
        "an offloaded norm goes up to the device from pageable memory",
        "engine/update.py",
        "            sq = self._sq_host.copy_(sq).to(run.device, non_blocking=True)",
        "            sq = sq.to(run.device, non_blocking=True)",
        (
            "tests/test_cuda_path.py::test_offloading_queues_its_uploads_and_waits_only_for_the_gradients",
        ),
    ),
    Mutant(
        "pinning is never asked for, whatever the flag says",
        "core/pinned.py",
        '    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin and can_pin())',
        '    return torch.empty(shape, dtype=dtype, device="cpu")',
        (
            "tests/test_cuda_path.py::test_offloading_queues_its_uploads_and_waits_only_for_the_gradients",
        ),
    ),
    Mutant(
        "pin_memory=false on a GPU is not warned about",
        "config/keys.py",
        '        if block is not None and block.device != "none" and not block.pin_memory:',
        "        if False:",
        ("tests/test_cuda_path.py::test_pageable_offload_stops_the_host_and_is_warned_about",),
    ),
    Mutant(
        "the pinned bytes the host allocator holds are not reported",
        "engine/footprint.py",
        '            out["pinned"] = pinned',
        "            pass",
        (
            "tests/test_cuda_path.py::test_the_cuda_allocator_figures_are_reported_beside_the_census",
        ),
    ),
    Mutant(
        "stage 2's offloaded pieces come down in a blocking copy inside backward again",
        "zero/grad_buffers.py",
        "                f.downloads.fetch(st.piece, shard.add_)",
        "                shard.add_(st.piece.to(shard.device))",
        (
            "tests/test_cuda_path.py::test_offloading_queues_its_uploads_and_waits_only_for_the_gradients",
        ),
    ),
    Mutant(
        "a mid-window gradient read misses the pieces still coming down",
        "zero/grad_buffers.py",
        "        self.flat.downloads.settle()\n        lo, hi",
        "        pass\n        lo, hi",
        ("tests/test_cuda_path.py::test_a_mid_window_gradient_read_sees_the_pending_downloads[2]",),
    ),
    Mutant(
        "the step reads the offloaded shard before the last pieces are added",
        "zero/sharded_optimizer.py",
        "        self.downloads.settle()\n        on_device = ",
        "        on_device = ",
        (
            "tests/test_cuda_path.py::test_the_cuda_path_runs_and_matches_the_cpu_run[stage2-offload]",
        ),
    ),
    Mutant(
        "stage 3's offloaded rows come down in a blocking copy inside backward again",
        "zero/stage3_reduce.py",
        "        self.downloads.fetch(out, lambda host: self._hand(b, host, final))",
        "        self._hand(b, out.to(self.to), final)",
        (
            "tests/test_cuda_path.py::test_offloading_queues_its_uploads_and_waits_only_for_the_gradients",
        ),
    ),
    Mutant(
        "stage 3's step reads the offloaded gradients before the last rows are added",
        "zero/stage3.py",
        "        self.downloads.settle()\n        self.grads.hand_to(self.groups)",
        "        self.grads.hand_to(self.groups)",
        (
            "tests/test_cuda_path.py::test_the_cuda_path_runs_and_matches_the_cpu_run[stage3-offload-param-cpu]",
        ),
    ),
    Mutant(
        "a stage-3 mid-window gradient read misses the rows still coming down",
        "zero/stage3_state.py",
        "        self.downloads.settle()\n        piece = self.grads.piece(p)",
        "        piece = self.grads.piece(p)",
        ("tests/test_cuda_path.py::test_a_mid_window_gradient_read_sees_the_pending_downloads[3]",),
    ),
    Mutant(
        "stage 3's norm takes a kernel per parameter again",
        "zero/masters.py",
        "        return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square()",
        "        return torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) "
        "for g in grads]).square()",
        (
            "tests/test_stage3.py::"
            "test_the_norm_takes_one_multi_tensor_kernel_not_three_per_parameter",
        ),
    ),
    Mutant(
        "the async save's agreement polls the store every 20 ms however long it waits",
        "checkpoint/async_save.py",
        "        pause = min(2 * pause, longest)",
        "        pass",
        (
            "tests/test_async_save.py::test_waiting_for_the_other_ranks_asks_the_store_ever_less_often",
        ),
    ),
    Mutant(
        "the pipeline's shape handshake sends header and payload in one batch (the peer takes two)",
        "pipeline/executor.py",
        '                    self.comm.p2p([("send", _header(out), rank)], axis="pp")\n'
        '                    self.comm.p2p([("send", out, rank)], axis="pp")',
        '                    self.comm.p2p([("send", _header(out), rank), ("send", out, rank)], '
        'axis="pp")',
        ("tests/test_pipeline.py::test_each_p2p_batch_is_mirrored_by_its_peer",),
    ),
    Mutant(
        "an in-place all-gather on NCCL is cloned anyway (a bucket-sized copy every step)",
        "comm/gloo.py",
        "        if overlaps and not _in_place_row(output, input, group):  # else not assumed",
        "        if overlaps:",
        ("tests/test_comm_log.py::test_an_in_place_all_gather_is_copied_only_where_it_must_be",),
    ),
    Mutant(
        "an all-gather overlapping its output elsewhere than this rank's row is not copied",
        "comm/gloo.py",
        "    return input.data_ptr() == output.data_ptr() + rank * n * output.element_size()",
        "    return True",
        ("tests/test_comm_log.py::test_an_in_place_all_gather_is_copied_only_where_it_must_be",),
    ),
    Mutant(
        "MoE: what every ep rank holds is cut and reduced over dp only (held twice, not summed)",
        "zero/flat_params.py",
        '                 ("dp_ep", [p for p in params if p in shared])]',
        '                 ("dp", [p for p in params if p in shared])]',
        (
            "tests/test_moe.py::test_expert_parallel_gpt_matches_single_process[ep2-top2-stage2]",
            f"{MOE}::test_no_rank_holds_the_shared_state_twice_at_ep_2",
        ),
    ),
    Mutant(
        "MoE: the shared gradients' sum over dp x ep is not divided by ep",
        "zero/flat_params.py",
        "return Cut(axis, size, rank, size if sharded else 1, base * topo.dp / size)",
        "return Cut(axis, size, rank, size if sharded else 1, base)",
        (
            "tests/test_moe.py::test_expert_parallel_gpt_matches_single_process[dp2xep2-top1-drops-stage1]",
        ),
    ),
    Mutant(
        "MoE: a bucket reduce-scattered over dp, not over its own cut's axis",
        "zero/grad_buffers.py",
        "axis=cut.axis, async_op=True, pool=f.buffers)",
        'axis="dp", async_op=True, pool=f.buffers)',
        (f"{MOE}::test_shared_gradients_are_reduced_over_dp_and_ep_at_once_in_buckets[1]",),
    ),
    Mutant(
        "reading a gradient unscales it in place (the shard itself at dp 1)",
        "engine/full_params.py",
        "        grad = zero.window_grad(p).mul(post)  # not in place: it may be the shard itself",
        "        grad = zero.window_grad(p).mul_(post)  # not in place: it may be the shard itself",
        ("tests/test_engine_surface.py::test_reading_a_gradient_leaves_it_as_it_was",),
    ),
    Mutant(
        "safe_get_full_fp32_param at ep > 1: a shared parameter's pieces summed over dp only",
        "engine/full_params.py",
        "        axis = zero.state_axis(p)",
        '        axis = "dp" if zero.grads_sharded else None',
        (f"{MOE}::test_shared_gradients_are_reduced_over_dp_and_ep_at_once_in_buckets[1]",),
    ),
    Mutant(
        "stage 1's offloaded boundary copies each wait for the whole stream again",
        "zero/sharded_optimizer.py",
        "                grad = st.host_grad.copy_(grad, non_blocking=down)",
        "                grad = st.host_grad.copy_(grad)",
        (
            "tests/test_cuda_path.py::test_offloading_queues_its_uploads_and_waits_only_for_the_gradients",
        ),
    ),
    Mutant(
        "stage 1's host optimizer steps on gradients still coming down",
        "zero/sharded_optimizer.py",
        "            copied.synchronize()",
        "            pass",
        (
            "tests/test_cuda_path.py::test_the_cuda_path_runs_and_matches_the_cpu_run[stage1-offload-pinned]",
        ),
    ),
    # --- the engine's parts (issue 33, item 3)
    Mutant(
        "a user's step callback that wants the loss gets none",
        "engine/after_step.py",
        'self.losses.collect |= bool(getattr(callback, "wants_loss", False))',
        "pass",
        ("tests/test_engine_surface.py::test_a_step_callback_gets_each_steps_report",),
    ),
    Mutant(
        "the step report calls a skipped step applied",
        "engine/after_step.py",
        "applied=outcome.applied,",
        "applied=True,",
        ("tests/test_engine_surface.py::test_a_step_callback_gets_each_steps_report",),
    ),
    Mutant(
        "every engine is a PipelineEngine",
        "pipeline/runner.py",
        'return isinstance(obj, Engine) and getattr(obj.runner, "pipelined", False)',
        "return isinstance(obj, Engine)",
        ("tests/test_pipeline.py::test_only_an_engine_with_a_pipeline_is_a_pipeline_engine",),
    ),
    Mutant(
        "a pipeline engine runs a micro-batch's forward",
        "engine/__init__.py",
        "        self._refuse_under_a_pipeline()\n        t0 = self.clock.now()\n        with",
        "        t0 = self.clock.now()\n        with",
        ("tests/test_pipeline.py::test_pipeline_engine_errors_and_eval",),
    ),
    Mutant(
        "tied copies counted on every stage in the gradient norm",
        "engine/__init__.py",
        "return self.replicas.elsewhere(self.zero.cut_over_ep) | self.runner.replicated()",
        "return self.replicas.elsewhere(self.zero.cut_over_ep)",
        ("tests/test_pipeline.py::test_gpt_pipeline_matches_single_process",),
    ),
    Mutant(
        "a load leaves the step counters as they were",
        "engine/train_state.py",
        '            setattr(self, k, state["counters"][k])',
        "            pass",
        (f"{C}::test_exact_resume_whole",),
    ),
    Mutant(
        "the monitors never learn the profiled flops",
        "profiling/flops_profiler/step.py",
        "        report.flops = self.last_step_flops",
        "        report.flops = None",
        ("tests/test_monitor.py",),
    ),
    Mutant(
        "the monitors count the next step's collectives",
        "monitor/training.py",
        "self._comm_bytes(report.step - 1)",
        "self._comm_bytes(report.step)",
        ("tests/test_monitor.py",),
    ),
    Mutant(
        "initialize returns the native engine, without DeepSpeed's accessors",
        "compat/deepspeed/__init__.py",
        '    kwargs.setdefault("engine_type", DeepSpeedEngine)\n',
        "",
        ("tests/test_engine_surface.py::test_deepspeeds_own_accessors_live_on_its_engine_alone",),
    ),
    Mutant(
        "a stage-3 piece's extent runs past the end of a parameter it barely covers",
        "zero/partition.py",
        "    lo = min(rank * width, numel)\n    return lo, min(lo + width, numel)",
        "    lo = min(rank * width, numel)\n    return lo, lo + width",
        ("tests/test_partition.py::test_a_pieces_extent_stops_at_the_end_of_the_parameter",),
    ),
    Mutant(
        "set_gradient_accumulation_boundary is ignored",
        "engine/accumulation.py",
        "        if self.override is not None:\n            return self.override\n",
        "",
        (T_CONTROLS,),
    ),
    Mutant(
        "no_sync is allowed at ZeRO stage 2",
        "engine/accumulation.py",
        "        if self.stage >= 2:",
        "        if self.stage > 2:",
        (T_CONTROLS,),
    ),
    Mutant(
        "no_sync nests",
        "engine/accumulation.py",
        "        if self.inside_no_sync:",
        "        if False:",
        (T_CONTROLS,),
    ),
    Mutant(
        "the optimizer's step counters are counted as its state",
        "engine/footprint.py",
        "                if torch.is_tensor(t) and t.dim() > 0:",
        "                if torch.is_tensor(t):",
        (f"{T_APART}[1-False]",),
    ),
    Mutant(
        "the pool keeps a step's bucket buffers between steps (not trimmed)",
        "zero/sharded_optimizer.py",
        "        self.buffers.trim(self.rest_bytes)",
        "        pass",
        (T_CENSUS2,),
    ),
    Mutant(
        "the pool's trim keeps every buffer",
        "core/scratch.py",
        "            if kept + t.nbytes <= max_bytes:",
        "            if True:",
        (T_CENSUS2,),
    ),
    Mutant(
        "the pool's trim keeps the smallest buffers first",
        "core/scratch.py",
        "key=lambda t: -t.nbytes):",
        "key=lambda t: t.nbytes):",
        (T_CENSUS2,),
    ),
    Mutant(
        "memory_breakdown leaves out the buffers the pool keeps",
        "zero/flat_state.py",
        "        scratch = list(self.buffers.kept())",
        "        scratch = []",
        (T_CENSUS2,),
    ),
    Mutant(
        "the estimate leaves out the bucket kept between steps",
        "estimate/memory.py",
        "        out.scratch = c * min(bucket, trained)",
        "        out.scratch = 0",
        ("tests/test_estimate.py::test_model_states_are_the_per_stage_formulas[2-1-fp32]",),
    ),
    Mutant(
        "a list of different layers is taken for blocks",
        "engine/compiling.py",
        "if count[type(c)] >= 2 and any(",
        "if count[type(c)] >= 1 and any(",
        ("tests/test_compile.py::test_blocks_are_a_lists_children_of_one_class",),
    ),
    Mutant(
        "engine.compile compiles nothing",
        "engine/compiling.py",
        "        block.compile(backend=counted, **kwargs)",
        "        pass",
        (f"{T_COMPILE}[0-fp32]",),
    ),
    Mutant(
        "the compile report counts no graph",
        "engine/compiling.py",
        "        report.graphs += 1",
        "        pass",
        (f"{T_COMPILE}[0-fp32]",),
    ),
    Mutant(
        "stage 3's gather hooks are traced into the compiled graphs",
        "zero/module_hooks.py",
        "    return torch.compiler.disable(fn, recursive=True)",
        "    return fn",
        (f"{T_COMPILE}[3-fp32]",),
    ),
    Mutant(
        "the tensor-parallel collectives are traced under compile",
        "comm/functional.py",
        "_apply = torch.compiler.disable(_run, recursive=True)",
        "_apply = _run",
        (f"{T_COMPILE_VARIANTS}[tp2-1]",),
    ),
    Mutant(
        "stage 3's linear is traced under compile (its backward reads the weight as saved)",
        "zero/module_hooks.py",
        "@eager  # its backward reads the weight parameter as it is then",
        "# its backward reads the weight parameter as it is then",
        (f"{T_COMPILE_VARIANTS}[ckpt-3]",),
    ),
    Mutant(
        "engine.compile compiles a compiled engine again",
        "engine/compiling.py",
        "    if engine.compile_report is not None:",
        "    if False:",
        ("tests/test_compile.py::test_what_compile_refuses_is_named",),
    ),
    Mutant(
        "TRL's add_hooks puts no hook back (stage 3 trains on released parameters)",
        "compat/deepspeed/runtime/zero/parameter_offload.py",
        "        _alive(self._coordinator).hooks.attach()",
        "        pass",
        (TRL_HOOKS,),
    ),
    Mutant(
        "putting the hooks back leaves a borrowed parameter's read ungathered",
        "zero/module_hooks.py",
        "            m._parameters = _GatherOnRead(m._parameters, c)\n",
        "            m._parameters = dict(m._parameters)\n",
        (TRL_HOOKS,),
    ),
    Mutant(
        "taking the hooks off keeps stage 3's linear on the plain module",
        "zero/module_hooks.py",
        "_linear_forward:\n                    del m.forward",
        "_linear_forward:\n                    pass",
        (TRL_HOOKS,),
    ),
    Mutant(
        "the coordinator's trace cannot be invalidated",
        "zero/coordinator.py",
        "        self.order = RecordedOrder()\n\n    def grad_arrived",
        "        pass\n\n    def grad_arrived",
        (TRL_HOOKS,),
    ),
    Mutant(
        "clearing ds_active_sub_modules also drops GatheredParameters' hold",
        "zero/params.py",
        "        self._state.active -= self._state.by_modules\n",
        "        self._state.active = 0\n",
        ("tests/test_trl.py::test_clearing_a_parameters_active_modules_leaves_other_holders",),
    ),
    Mutant(
        "deepspeed.initialize refuses the unknown keys DeepSpeed ignores (TRL's ZeRO-3 keys)",
        "compat/deepspeed/__init__.py",
        '    kwargs.setdefault("unknown_keys", "as_deepspeed")',
        '    kwargs.setdefault("unknown_keys", "refuse")',
        (T_FACADE_KEYS, "tests/test_trl.py::test_trl_logs_equal_deepspeeds[grpo_zero3]"),
    ),
    Mutant(
        "unknown keys are ignored where DeepSpeed refuses them too",
        "config/load.py",
        "isinstance(loc[-1], str) and block in DEEPSPEED_IGNORES_UNKNOWN",
        "isinstance(loc[-1], str)",
        ("tests/test_config_keys.py::test_as_deepspeed_still_refuses_where_deepspeed_refuses",),
    ),
    Mutant(
        "the unknown keys left out are not named",
        "config/keys.py",
        "    if cfg.ignored_keys and rank == 0:",
        "    if False:",
        (T_FACADE_KEYS,),
    ),
    Mutant(
        "zerostack.initialize ignores unknown keys as deepspeed.initialize does",
        "__init__.py",
        "from .compat.deepspeed import native_initialize as initialize",
        "from .compat.deepspeed import initialize",
        (T_FACADE_KEYS,),
    ),
    Mutant(
        "stage 3 ignores the leaf flag: experts gathered one by one (ranks routed differently)",
        "zero/coordinator.py",
        "from .leaves import z3_leaf_module\n",
        "def z3_leaf_module(m):\n    return False\n\n\n",
        (f"{LEAF}[call]",),
    ),
    Mutant(
        "a leaf's unit holds only its own parameters, not its descendants'",
        "zero/coordinator.py",
        "            ps = list(dict.fromkeys(m.parameters()))\n",
        "            ps = ps\n",
        (f"{LEAF}[call]",),
    ),
    Mutant(
        "initialize ignores zero_optimization.leaf_module",
        "compose.py",
        "    apply_leaf_config(model, cfg.zero_optimization.leaf_module)",
        "    pass",
        (f"{LEAF}[config]",),
    ),
    Mutant(
        "a leaf class given by its short name matches nothing",
        "zero/leaves.py",
        '    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")',
        '    return wanted == f"{cls.__module__}.{cls.__qualname__}"',
        ("tests/test_leaf_modules.py::test_the_leaf_flags",),
    ),
    Mutant(
        "register_external_parameter before initialize records nothing",
        "zero/module_hooks.py",
        '    module.__dict__.setdefault("_zs_external", {})[id(parameter)] = parameter',
        "    pass",
        (f"{EXTERNAL}[before]",),
    ),
    Mutant(
        "register_external_parameter after initialize leaves the unit as it was",
        "zero/module_hooks.py",
        "        coordinator.adopt(units[0], parameter)",
        "        pass",
        (f"{EXTERNAL}[after]",),
    ),
    Mutant(
        "the optimizer's overflow reports every step as skipped",
        "compat/deepspeed/runtime/engine.py",
        "        self.optimizer.overflow = not report.applied",
        "        self.optimizer.overflow = True",
        (T_ACCESSORS,),
    ),
    Mutant(
        "_consolidated_16bit_state_dict hands the weights to every rank",
        "compat/deepspeed/runtime/engine.py",
        "        out = consolidated_16bit(self.run, exclude_frozen_parameters)\n"
        "        return out if self.global_rank == 0 else None\n\n    def _zero3",
        "        out = consolidated_16bit(self.run, exclude_frozen_parameters)\n"
        "        return out\n\n    def _zero3",
        (T_ACCESSORS,),
    ),
    Mutant(
        "initialize(args=...) ignores the deprecated --deepscale_config",
        "compose.py",
        ' or getattr(args, "deepscale_config", None)',
        "",
        (
            "tests/test_ds_runtime_helpers.py::test_add_config_arguments_and_initialize_reading_them",
        ),
    ),
    Mutant(
        "RepeatingLoader stops when the loader ends",
        "compat/deepspeed/runtime/dataloader.py",
        "            self.data_iter = iter(self.loader)\n            return next(self.data_iter)",
        "            raise",
        (
            "tests/test_ds_runtime_helpers.py::test_repeating_loader_starts_again_when_the_loader_ends",
        ),
    ),
    Mutant(
        "move_to_device leaves what the criterion accepts where it was",
        "compat/deepspeed/runtime/utils.py",
        "        item.data = item.to(device).data\n",
        "        pass\n",
        (
            "tests/test_ds_runtime_helpers.py::"
            "test_move_to_device_moves_in_place_what_the_criterion_accepts",
        ),
    ),
    Mutant(
        "reload_states gives the storage back its size but not its bytes",
        "zero/state_offload.py",
        "                whole.copy_(parked.host, non_blocking=non_blocking)\n",
        "                pass\n",
        (T_OFFLOAD_ROUND,),
    ),
    Mutant(
        "offload_states leaves the optimizer's moments on the device",
        "zero/state_offload.py",
        "                    yield StateKind.optim_states, t",
        "                    pass",
        (T_OFFLOAD_ROUND,),
    ),
    Mutant(
        "the forward guard is not taken off at reload_states",
        "zero/state_offload.py",
        "            self._guard.remove()\n",
        "            pass\n",
        (T_OFFLOAD_ROUND,),
    ),
    Mutant(
        "a storage shared with a kind left out moves anyway",
        "zero/state_offload.py",
        "            if not kinds <= include:",
        "            if not kinds & include:",
        (
            "tests/test_offload_states.py::test_a_storage_moves_only_when_every_kind_on_it_is_asked_for",
        ),
    ),
    Mutant(
        "step runs while the states are in host memory",
        "compat/deepspeed/runtime/engine.py",
        '        self.states.require_resident("step")\n',
        "",
        (T_OFFLOAD_ROUND,),
    ),
    Mutant(
        "the checkpoint-inputs context offloads every saved tensor, not the marked ones",
        "activation_checkpointing/offload_inputs.py",
        "        if not self.unmark(t) or t.device.type",
        "        if t.device.type",
        (T_OFFLOAD_INPUTS,),
    ),
    Mutant(
        "the checkpoint-inputs context keeps none of the last inputs on the device",
        "activation_checkpointing/offload_inputs.py",
        "        while len(self.recent) > self.keep_last:",
        "        while len(self.recent) > 0:",
        (T_OFFLOAD_INPUTS,),
    ),
    Mutant(
        "the layer marker stays installed after the context",
        "activation_checkpointing/offload_inputs.py",
        "                    _remove_marker()\n",
        "                    pass\n",
        (T_OFFLOAD_INPUTS,),
    ),
    Mutant(
        "zero.Init draws Hugging Face's initial weights where from_pretrained switched that off",
        "zero/hf_init.py",
        '    if getattr(original, "__qualname__", "") != "PreTrainedModel.init_weights":',
        "    if False:",
        (
            "tests/test_hf.py::"
            "test_zero_init_draws_nothing_where_transformers_switched_initialisation_off",
        ),
    ),
    Mutant(
        "stage 2 stages an empty optimizer group's bucket by its parameters' end",
        "zero/grad_buffers.py",
        "        end = max((rng.stop for _, rng in st.ranges), default=st.bucket.start)",
        "        end = max(rng.stop for _, rng in st.ranges)",
        ("tests/test_frozen.py::test_an_empty_optimizer_group_trains_as_one_process",),
    ),
    Mutant(
        "Lion interpolates with beta2 where the update takes beta1",
        "optim/lion.py",
        "                p.add_(torch.sign(m * beta1 + g * (1 - beta1)), alpha=-lr)",
        "                p.add_(torch.sign(m * beta2 + g * (1 - beta2)), alpha=-lr)",
        ("tests/test_ds_optimizers.py",),
    ),
    Mutant(
        "Lion's weight decay scales with the learning rate squared",
        "optim/lion.py",
        "                    p.mul_(1 - lr * wd)",
        "                    p.mul_(1 - lr * lr * wd)",
        ("tests/test_ds_optimizers.py",),
    ),
    Mutant(
        "the optimizer's cur_scale stays the initial loss scale",
        "compat/deepspeed/runtime/engine.py",
        "        self.optimizer.cur_scale = float(self.state.loss_scaler.loss_scale)",
        "        pass",
        ("tests/test_ds_runtime_helpers.py::test_the_optimizers_cur_scale_is_the_loss_scale_now",),
    ),
    Mutant(
        "the engine does not hand what it lacks to its module",
        "compat/deepspeed/runtime/engine.py",
        "            if module is None or name.startswith(\"__\"):",
        "            if True:",
        ("tests/test_ds_runtime_helpers.py::test_what_the_engine_lacks_is_its_modules",),
    ),
    Mutant(
        "DeepSpeedConfig resolves the batch for one rank whatever the mpu says",
        "compat/deepspeed/runtime/config.py",
        "        batch = cfg.resolve_batch(dp)",
        "        batch = cfg.resolve_batch(1)",
        (
            "tests/test_ds_runtime_helpers.py::"
            "test_deepspeed_config_resolves_the_batch_as_initialize_does",
        ),
    ),
    Mutant(
        "a DeepSpeed stage-3 parameter joined from the ranks' pieces in the wrong order",
        "checkpoint/deepspeed_read.py",
        "for f in flats])[:n]",
        "for f in flats[::-1]])[:n]",
        (T_DS_RESUME,),
    ),
    Mutant(
        "a DeepSpeed stage 1-2 group joined from the ranks' partitions in the wrong order",
        "checkpoint/deepspeed_read.py",
        "flat = torch.cat([rank[g].float() for rank in parts[e::ep]])",
        "flat = torch.cat([rank[g].float() for rank in parts[e::ep][::-1]])",
        (T_DS_RESUME,),
    ),
    Mutant(
        "DeepSpeed's optimizer moments read from the fp32 partition",
        "checkpoint/deepspeed_read.py",
        "        if kind == \"master\":\n            key =",
        "        if True:\n            key =",
        (T_DS_RESUME,),
    ),
    Mutant(
        "a DeepSpeed .pt file unpickled with its classes' code",
        "checkpoint/deepspeed_read.py",
        "            return torch.load(path, map_location=\"cpu\", weights_only=True, mmap=True)",
        "            return torch.load(path, map_location=\"cpu\", weights_only=False, mmap=True)",
        (
            "tests/test_deepspeed_checkpoints.py::"
            "test_a_class_off_the_allow_list_is_refused_before_anything_loads",
        ),
    ),
    Mutant(
        "DeepSpeed's client state left behind",
        "checkpoint/deepspeed_read.py",
        "            \"client_state\": {k: v for k, v in m.items() if k not in _KNOWN},",
        "            \"client_state\": {},",
        (T_DS_RESUME,),
    ),
    Mutant(
        "a frozen parameter in a DeepSpeed folder loads as zeros",
        "checkpoint/deepspeed_read.py",
        'n: self.weights[n].float().reshape(-1) for n in frozen',
        'n: torch.zeros(self.weights[n].numel()) for n in frozen',
        (f"{T_DS_RESUME}[zero2_frozen]",),
    ),
    Mutant(
        "DeepSpeed's stage 1-2 moments written one element off their partition",
        "checkpoint/deepspeed_optim.py",
        "        states[g] = _state(kind, steps[g], values)",
        "        states[g] = _state(kind, steps[g], {k: v.roll(1) for k, v in values.items()})",
        (f"{T_DS_WRITE}[zero2]",),
    ),
    Mutant(
        "DeepSpeed's fp32 partition written with its padding",
        "checkpoint/deepspeed_optim.py",
        'fp32.append(values.pop("master")[: size - padding].clone())',
        'fp32.append(values.pop("master").clone())',
        (f"{T_DS_WRITE}[zero2_odd]",),
    ),
    Mutant(
        "DeepSpeed's group padding counted on no rank",
        "checkpoint/deepspeed_optim.py",
        "        padding = size if total <= lo else max(0, lo + size - total)",
        "        padding = 0",
        (f"{T_DS_WRITE}[zero2_odd]",),
    ),
    Mutant(
        "DeepSpeed's loss scaler left out of the optimizer file",
        "checkpoint/deepspeed_write.py",
        '"loss_scaler": _scaler(layout, scaler),',
        '"loss_scaler": None,',
        (f"{T_DS_WRITE}[zero1]",),
    ),
    Mutant(
        "a stand-in class pickled under zerostack's name, which DeepSpeed cannot read",
        "checkpoint/deepspeed_write.py",
        "        where = _NAMES.get(obj)",
        "        where = None",
        (f"{T_DS_WRITE}[zero3]",),
    ),
    Mutant(
        "DeepSpeed's stage 3 pieces written in the other rank's file",
        "checkpoint/deepspeed_optim.py",
        "lo, hi = min(rank * piece, numels[i]), min((rank + 1) * piece, numels[i])",
        "lo, hi = min((dp - 1 - rank) * piece, numels[i]), min((dp - rank) * piece, numels[i])",
        (f"{T_DS_WRITE}[zero3_sgd]",),
    ),
    Mutant(
        "DeepSpeed's Adam step count written as torch's tensor",
        "checkpoint/deepspeed_optim.py",
        '    return {"step": int(step), **values}',
        '    return {"step": torch.tensor(float(step)), **values}',
        (f"{T_DS_WRITE}[zero2_bf16]",),
    ),
    Mutant(
        "the slice map's start counted from the group, not the rank's partition",
        "checkpoint/deepspeed_optim.py",
        "slices[n] = _address(y - x, x - lo)",
        "slices[n] = _address(y - x, x)",
        (f"{T_DS_WRITE}[zero2]",),
    ),
    Mutant(
        "tied parameters left out of DeepSpeed's model states",
        "checkpoint/deepspeed_write.py",
        'shared = {a: c for a, c in manifest["aliases"].items()} if rank == 0 else {}',
        "shared = {}",
        (f"{T_DS_WRITE}[zero1]",),
    ),
    Mutant(
        "fp16's loss scaler state in DeepSpeed's folder dropped at load (the scale starts over)",
        "engine/train_state.py",
        'self.loss_scaler.load_state_dict(state["loss_scaler"])',
        "pass",
        (f"{T_DS_RESUME}[zero2_fp16]",),
    ),
    Mutant(
        "the loss scale grown after each window counting the first clean step (DeepSpeed 0.18's)",
        "core/precision.py",
        "            if stable > 0 and stable % self.scale_window == 0:",
        "            if (stable + 1) % self.scale_window == 0:",
        ("tests/test_precision.py::test_scaler_hysteresis_halving_floor_and_growth",),
    ),
    Mutant(
        "an overflow at the minimum loss scale let through",
        "core/precision.py",
        "                if self.cur_scale == self.min_scale:",
        "                if False:",
        ("tests/test_precision.py::test_scaler_overflow_at_the_floor_ends_the_run",),
    ),
    Mutant(
        "DeepSpeed's stage 0 FusedAdam step read from the group's first parameter (0)",
        "checkpoint/deepspeed_read0.py",
        "            out.append((hyper, max(float(s) for s in steps) if steps else None))",
        "            out.append((hyper, float(steps[0]) if steps else None))",
        (f"{T_DS_RESUME}[zero0]",),
    ),
    Mutant(
        "DeepSpeed's stage 0 flat masters cut without advancing past each parameter",
        "checkpoint/deepspeed_read0.py",
        "                    offset += n\n                continue",
        "                    offset += 0\n                continue",
        (f"{T_DS_RESUME}[zero0_bf16]",),
    ),
    Mutant(
        "DeepSpeed's stage 0 state paired with the module's order, not the loading run's groups",
        "checkpoint/deepspeed_read0.py",
        "        names = groups if groups is not None else self._in_order(weights)",
        "        names = self._in_order(weights)",
        ("tests/test_deepspeed_checkpoints.py::test_a_stage_0_folder_of_another_grouping_is_refused",),
    ),
    Mutant(
        "DeepSpeed's stage 0 FusedAdam step written on every parameter",
        "checkpoint/deepspeed_optim.py",
        'step = steps[g] if layout.kind == "torch" or i == ids[-1] else 0',
        "step = steps[g]",
        (f"{T_DS_WRITE}[zero0]",),
    ),
    Mutant(
        "fp16's last-step overflow flag written as False",
        "checkpoint/deepspeed_write.py",
        'overflow = dynamic and scaler["last_overflow_iter"] == scaler["cur_iter"] - 1',
        "overflow = False",
        (f"{T_DS_WRITE}[zero2_fp16]",),
    ),
    Mutant(
        "fp16's dynamic loss scaler written as a fixed one",
        "checkpoint/deepspeed_optim.py",
        '    if not (layout.fp16 and layout.scaler["dynamic"]):',
        "    if True:",
        (f"{T_DS_WRITE}[zero3_fp16]",),
    ),
    Mutant(
        "DeepSpeed's stage 0 fp16 scale state left out of FP16_Optimizer's dict",
        "checkpoint/deepspeed_optim.py",
        "    if layout.fp16:\n        out.update(",
        "    if False:\n        out.update(",
        (f"{T_DS_WRITE}[zero0_fp16]",),
    ),
    Mutant(
        "a universal ZeRO-3 checkpoint's Adam step not read (the count starts over)",
        "checkpoint/deepspeed_universal.py",
        '                step = state[0]["step"] if state else None',
        "                step = None",
        (f"{T_DS_RESUME}[zero3_universal]",),
    ),
    Mutant(
        "DeepSpeed's latest_universal not followed",
        "checkpoint/restore.py",
        "        if os.path.exists(other) and (universal or not os.path.exists(latest)):",
        "        if False:",
        (f"{T_DS_RESUME}[zero2_universal]",),
    ),
    Mutant(
        "a universal checkpoint's per-parameter dict written in another key order",
        "checkpoint/deepspeed_universal.py",
        'value = {"cat_dim": 0, "param": value} if layout.stage < 3 else value.reshape(-1)',
        'value = {"param": value, "cat_dim": 0} if layout.stage < 3 else value.reshape(-1)',
        ("tests/test_convert.py::test_deepspeeds_folder_converted_to_deepspeed_is_itself_bit_for_bit[zero2_universal]",),
    ),
    Mutant(
        "a universal checkpoint's optimizer_state.pt without the param groups",
        "checkpoint/deepspeed_universal.py",
        '        out["param_groups"] = sd["base_optimizer_state"]["param_groups"]',
        "        pass",
        ("tests/test_convert.py::test_deepspeeds_folder_converted_to_deepspeed_is_itself_bit_for_bit[zero2_universal]",),
    ),
    Mutant(
        "ZeRO-3's frozen pieces joined in the wrong rank order",
        "checkpoint/deepspeed_read.py",
        '.float().reshape(-1) for m in ranks])',
        '.float().reshape(-1) for m in ranks[::-1]])',
        (f"{T_DS_RESUME}[zero3_frozen]",),
    ),
    Mutant(
        "a pipeline stage's partitions read from the first stage's optimizer files",
        "checkpoint/deepspeed_read.py",
        "        optim = zero_files(folder, mp)",
        "        optim = zero_files(folder, 0)",
        (f"{T_DS_RESUME}[pipe_zero1]",),
    ),
    Mutant(
        "DeepSpeed's experts of every ep rank read from the first ep rank's partitions",
        "checkpoint/deepspeed_read.py",
        "flat = torch.cat([rank[g].float() for rank in parts[e::ep]])",
        "flat = torch.cat([rank[g].float() for rank in parts[::ep]])",
        (f"{T_DS_RESUME}[moe_zero2]",),
    ),
    Mutant(
        "every pipeline stage's model states written as stage 0's",
        "checkpoint/deepspeed_write.py",
        '        name = f"mp_rank_{layout.mp:02d}_model_states.pt"',
        '        name = "mp_rank_00_model_states.pt"',
        (f"{T_DS_WRITE}[pipe_zero1]",),
    ),
    Mutant(
        "a pipeline's DeepSpeed files let through at ZeRO-0",
        "checkpoint/deepspeed_layout.py",
        "    if topo.pp > 1 and stage != 1:",
        "    if False:",
        (f"{DW}::test_a_pipelines_files_are_written_at_zero_1_only",),
    ),
    Mutant(
        "DeepSpeed's expert groups cut over every dp rank, not the ep rank's own",
        "checkpoint/deepspeed_optim.py",
        "layout.dp // layout.ep, rank // layout.ep) if g in layout.expert_groups else (",
        "layout.dp, rank) if g in layout.expert_groups else (",
        (f"{T_DS_WRITE}[moe_zero2]",),
    ),
    Mutant(
        "an ep rank's experts written under their local index",
        "checkpoint/deepspeed_write.py",
        "            number = layout.ep_rank * local + index",
        "            number = index",
        (f"{T_DS_WRITE}[moe_zero2]",),
    ),
    Mutant(
        "DeepSpeed's row-parallel AutoTP slices joined along their outputs",
        "checkpoint/deepspeed_tp.py",
        "whole = torch.cat(slices, dim=1 if any(p.match(name) for p in self.rows) else 0)",
        "whole = torch.cat(slices, dim=0)",
        (f"{T_DS_RESUME}[tp2_zero1]",),
    ),
    Mutant(
        "a non-persistent buffer a checkpoint rightly lacks refused at load",
        "checkpoint/restore.py",
        "            if not load_module_strict or name not in persistent:",
        "            if not load_module_strict:",
        (f"{T_DS_RESUME}[tp2_zero1]",),
    ),
    Mutant(
        "DeepSpeed's files never written under the facade",
        "checkpoint/deepspeed_layout.py",
        "    return why is None",
        "    return False",
        (f"{T_DS_WRITE}[zero1]",),
    ),
    Mutant(
        "a layout DeepSpeed's files cannot describe let through",
        "checkpoint/deepspeed_layout.py",
        "    if zero.round_robin_gradients:\n",
        "    if False:\n",
        (f"{DW}::test_deepspeed_files_where_they_cannot_be_written_are_refused",),
    ),
    Mutant(
        "natively, DeepSpeed's files written unasked",
        "checkpoint/deepspeed_layout.py",
        "    if not served_as_deepspeed(cfg):\n        return False",
        "    if False:\n        return False",
        (f"{DW}::test_natively_only_zerostacks_files_unless_asked",),
    ),
    Mutant(
        "the facade's warning repeated at every save",
        "checkpoint/deepspeed_layout.py",
        'and not getattr(run, "_warned_deepspeed_files", False)',
        "and True",
        (f"{DW}::test_under_the_facade_a_layout_without_deepspeeds_files_says_so_at_its_first_save",),
    ),
    Mutant(
        "an optimizer group's parameters in another order",
        "zero/flat_state.py",
        "return [[p for g in flats for p in self.groups[g].params] for flats in self._of_group]",
        "return [[p for g in flats for p in self.groups[g].params][::-1]"
        " for flats in self._of_group]",
        (f"{T_DS_WRITE}[zero1]",),
    ),
    Mutant(
        "stage 3's optimizer groups' parameters in another order",
        "zero/stage3_state.py",
        "            out[g.index].extend(g.params)",
        "            out[g.index].extend(g.params[::-1])",
        (f"{T_DS_WRITE}[zero3]",),
    ),
    Mutant(
        "convert: a tied weight's second name written into the Hugging Face shards",
        "checkpoint/convert.py",
        "    entries = [Entry(n, dtype, tuple(s)) for n, s in _params(reader)]",
        "    entries = [Entry(n, dtype, tuple(s)) for n, s in _params(reader)]\n"
        "    entries += [Entry(a, dtype, tuple(reader.manifest['params'][n]))\n"
        "                for a, n in reader.manifest['aliases'].items()]",
        ("tests/test_convert.py::test_to_hf_bf16_and_one_file",),
    ),
    Mutant(
        "convert: every Hugging Face shard written past its size",
        "checkpoint/convert.py",
        "        if shards[-1] and size + e.nbytes > max_shard_size:",
        "        if False:",
        ("tests/test_convert.py::test_to_hf_shards_load_with_from_pretrained_bit_for_bit",),
    ),
    Mutant(
        "convert: the optimizer moments left out of zerostack's format",
        "checkpoint/convert.py",
        '        for kind in ["master"] + ([] if name in frozen else kinds):',
        '        for kind in ["master"]:',
        ("tests/test_convert.py::test_to_zerostack_from_deepspeed_resumes_with_deepspeeds_losses",),
    ),
    Mutant(
        "convert: DeepSpeed's files cut for the source's dp size whatever --world says",
        "checkpoint/convert.py",
        "    layout = layout_of_checkpoint(reader, dp=world, stage=stage)",
        "    layout = layout_of_checkpoint(reader, stage=stage)",
        ("tests/test_convert.py::test_to_deepspeed_on_another_dp_size_and_stage_resumes",),
    ),
    Mutant(
        "convert: DCP written with each parameter's master in place of its moments",
        "checkpoint/convert.py",
        "            t = reader.full(name, kind)\n            bar.add",
        "            t = reader.full(name)\n            bar.add",
        ("tests/test_convert.py::test_to_dcp_reads_back_every_weight_and_moment",),
    ),
    Mutant(
        "a checkpoint read back claims fp32 where DeepSpeed's files were bf16",
        "checkpoint/deepspeed_read.py",
        '"precision": self._precision()},',
        '"precision": "fp32"},',
        ("tests/test_convert.py::test_deepspeeds_folder_converted_to_deepspeed_is_itself_bit_"
         "for_bit[zero2_bf16]",),
    ),
    Mutant(
        "a checked tensor's element range read from its start",
        "checkpoint/stream.py",
        "begin, end, shape = begin + lo * dtype.itemsize, begin + hi * dtype.itemsize, [hi - lo]",
        "begin, end, shape = begin, begin + (hi - lo) * dtype.itemsize, [hi - lo]",
        ("tests/test_convert.py::test_deepspeed_to_zerostack_to_deepspeed_is_deepspeeds_bit_"
         "for_bit[zero2]",),
    ),
    Mutant(
        "a parameter saved whole read back as its master whatever the kind",
        "checkpoint/reader.py",
        'return self.get(whole[0][0], f"{kind}/{_key(name, None, 0)}").view(shape)',
        'return self.get(whole[0][0], f"master/{_key(name, None, 0)}").view(shape)',
        ("tests/test_convert.py::test_to_dcp_reads_back_every_weight_and_moment[zerostack]",),
    ),
    Mutant(
        "DeepSpeed's model states keep the source's order of tied and frozen names lost",
        "checkpoint/deepspeed_layout.py",
        '    order = [n for n in manifest.get("state_dict_order") or [] if n in out]',
        "    order = []",
        ("tests/test_convert.py::test_deepspeeds_folder_converted_to_deepspeed_is_itself_bit_"
         "for_bit[zero2_frozen]",),
    ),
    Mutant(
        "Lightning's converter finds no model-states file at ZeRO-3",
        "compat/deepspeed/utils/zero_to_fp32.py",
        '        name = "zero_pp_rank_0_" + name',
        "        pass",
        ("tests/test_lightning.py::test_lightnings_converter_reads_a_deepspeed_stage_3_"
         "checkpoint_made_under_the_runner",),
    ),
    Mutant(
        "reset_activation_shape forgets the shapes but the stages do not learn them again",
        "pipeline/executor.py",
        'run."""\n        self._shapes_known = self.p == 1',
        'run."""',
        ("tests/test_pipeline.py::test_reset_activation_shape_lets_the_next_batch_change_shape",),
    ),
    Mutant(
        "a stage-3 parameter's ds_tensor left on its first piece",
        "zero/params.py",
        "                p.ds_tensor = self.stored  # DeepSpeed's name for this rank's partition",
        "                pass",
        (T_DS_SURFACE,),
    ),
    Mutant(
        "DeepSpeed's optimizer.backward divides by the accumulation steps as engine.backward",
        "compat/deepspeed/runtime/engine.py",
        "me().backward(loss, retain_graph=retain_graph, scale_wrt_gas=False)",
        "me().backward(loss, retain_graph=retain_graph, scale_wrt_gas=True)",
        (T_DS_SURFACE,),
    ),
    Mutant(
        "the throughput timer times the warm-up steps",
        "profiling/throughput.py",
        "        if self.global_step_count >= self.start_step:",
        "        if True:",
        (T_DS_SURFACE,),
    ),
    Mutant(
        "init_inference leaves the model whole at tp 2",
        "compat/deepspeed/inference/engine.py",
        "            autotp.parallelize(self.module, self.topology)",
        "            pass",
        ("tests/test_init_inference.py::test_two_tp_ranks_give_the_plain_models_logits_and_"
         "tokens[llama-tp]",),
    ),
    Mutant(
        "init_inference's deprecated mp_size ignored",
        "compat/deepspeed/inference/engine.py",
        '        tp["tp_size"] = out["mp_size"]  # deprecated',
        "        pass  # deprecated",
        ("tests/test_init_inference.py::test_two_tp_ranks_give_the_plain_models_logits_and_"
         "tokens[gpt2-mp_size]",),
    ),
    Mutant(
        "init_inference keeps the module's own dtype",
        "compat/deepspeed/inference/engine.py",
        '        self.module.to(cfg["dtype"])',
        "        pass",
        ("tests/test_init_inference.py::test_one_rank_is_the_plain_model_in_the_dtype_asked",),
    ),
    Mutant(
        "pre-LN BERT layer normalises its input with the pre-MLP norm",
        "models/bert_layer.py",
        'mid = x + attention_block(norm(x, "norm_w", "norm_b"))',
        'mid = x + attention_block(norm(x, "attn_nw", "attn_nb"))',
        ("tests/test_bert_layer.py::test_pre_ln_matches_modelingpreln_bert_layer_forward_and_"
         "gradients[False]",),
    ),
    Mutant(
        "BERT layer attention takes the k rows for q",
        "models/bert_layer.py",
        "    q, k, v = F.linear(x, qkvw, qkvb)",
        "    k, q, v = F.linear(x, qkvw, qkvb)",
        ("tests/test_bert_layer.py::test_post_ln_matches_hugging_face_bert_layer_forward_and_"
         "gradients[False]",),
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
        ("tests/test_bert_layer.py::test_dropout_in_training_only_while_autograd_records["
         "attn_dropout_ratio-False]",),
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
    Mutant(
        "aio: file_offset dropped from the parts",
        "zero/aio.py",
        "part, offset + i * per, req.path)",
        "part, i * per, req.path)",
        ("tests/test_aio.py::test_offsets_place_and_find_each_tensor",),
    ),
    Mutant(
        "aio: wait counts one request",
        "zero/aio.py",
        "return len(pending)",
        "return 1",
        ("tests/test_aio.py::test_several_requests_in_flight_then_one_wait",),
    ),
    Mutant(
        "aio: short-read check ignores the offset",
        "zero/aio.py",
        "if offset + nbytes > size:",
        "if nbytes > size:",
        ("tests/test_aio.py::test_a_short_file_is_refused_naming_it",),
    ),
    Mutant(
        "frozen pieces held as int8 blocks gathered dequantized, at full width",
        "zero/gathers.py",
        "    if keys[0][1]:  # frozen pieces held",
        "    if False:  # frozen pieces held",
        (T_QFROZEN,),
    ),
    Mutant(
        "a value a quantized piece already holds quantized again (a reload drifts)",
        "zero/frozen_pieces.py",
        "            return  # the value these blocks hold: kept as they are",
        "            pass  # the value these blocks hold: kept as they are",
        ("tests/test_quantized_frozen.py::test_writing_back_the_value_a_piece_holds_keeps_its_"
         "blocks",),
    ),
    Mutant(
        "frozen pieces not quantized at initialize",
        "zero/stage3.py",
        "        quantize_at_start(quantized_frozen, everything, self._trainable, "
        "self.param_swapper)",
        "        pass",
        (T_QFROZEN,),
    ),
    Mutant(
        "a write into a quantized piece lands in a dequantized copy",
        "zero/frozen_pieces.py",
        "        self.piece = value.to(self.dtype)",
        "        self.piece.copy_(value)",
        (T_QFROZEN,),
    ),
    Mutant(
        "tensor-parallel parameters left whole after GatherReplacedLayerParams",
        "tensor_parallel/whole.py",
        "            p.data = split_tensor(p.data, parts=tp, rank=rank, dim=dim, chunks=chunks)",
        "            pass",
        ("tests/test_tp_whole.py::test_split_parameters_are_whole_inside_and_sliced_after",),
    ),
    Mutant(
        "GatherReplacedLayerParams gathers nothing",
        "compat/deepspeed/module_inject/layers.py",
        "whole_tp(split, topology) if topology else contextlib.nullcontext()",
        "contextlib.nullcontext()",
        ("tests/test_tp_whole.py::test_split_parameters_are_whole_inside_and_sliced_after",),
    ),
    Mutant(
        "hybrid_engine: generate gathers module by module at every token",
        "compat/deepspeed/runtime/hybrid_engine.py",
        "    module.generate = generate_gathered",
        "    pass",
        ("tests/test_hybrid_engine.py::test_generate_gathers_the_model_once_and_gives_the_"
         "plain_models_tokens",),
    ),
    Mutant(
        "ds_grad_is_ready ignored: a tiled backward's gradient taken at every tile",
        "zero/params.py",
        "        if p.ds_grad_is_ready:",
        "        if True:",
        ("tests/test_grad_is_ready.py::test_a_tiled_backward_is_taken_once_per_parameter[2]",),
    ),
    Mutant(
        "check_overflow sees this rank's gradients alone",
        "compat/deepspeed/runtime/engine.py",
        '            e.comm.all_reduce(bad, axis="world", op=torch.distributed.ReduceOp.MAX)',
        "            pass",
        ("tests/test_engine_surface.py::test_check_overflow_sees_any_ranks_non_finite_gradient",),
    ),
    Mutant(
        "indexed dataset: merged documents keep the other file's item numbers",
        "data/indexed_dataset.py",
        "(doc_idx[1:] + offset).tolist()",
        "doc_idx[1:].tolist()",
        ("tests/test_indexed_dataset.py::test_builds_deepspeeds_bytes",),
    ),
    Mutant(
        "indexed dataset: get's offset counted in bytes, not items",
        "data/indexed_dataset.py",
        "int(self._pointers[i]) + offset * self._itemsize",
        "int(self._pointers[i]) + offset",
        ("tests/test_indexed_dataset.py::test_reads_deepspeeds_files_as_deepspeed",),
    ),
    Mutant(
        "indexed dataset builder writes in place",
        "data/indexed_dataset.py",
        "self._tmp = _temporary_beside(self._out)",
        "self._tmp = self._out",
        ("tests/test_indexed_dataset.py::test_failed_build_leaves_no_file_and_keeps_the_old_"
         "one",),
    ),
    Mutant(
        "dynamic batching: the seed of the random picking order ignored",
        "data/variable_batch.py",
        "random.Random(seed).shuffle(pairs)",
        "random.Random(0).shuffle(pairs)",
        ("tests/test_variable_batch.py::test_batch_by_seqlens_equals_deepspeeds",),
    ),
    Mutant(
        "dynamic batching: step(0) does not go back to the unscaled rates",
        "data/variable_batch.py",
        "unscaled = self.base_lrs if epoch == 0 else self.get_last_lr()",
        "unscaled = self.get_last_lr()",
        ("tests/test_variable_batch.py::test_scheduler_equals_deepspeeds",),
    ),
    Mutant(
        "dynamic batching: micro-batches of a batch cut in runs, not interleaved",
        "data/variable_batch.py",
        "microbatches += [pairs[start + b : end : group] for b in range(group)]",
        "microbatches += [pairs[start + b * (end - start) // group : start + (b + 1) * "
        "(end - start) // group] for b in range(group)]",
        ("tests/test_variable_batch.py::test_batch_by_seqlens_equals_deepspeeds",),
    ),
    Mutant(
        "dynamic batching: the lengths in metrics_path never read",
        "compat/deepspeed/runtime/data_pipeline/data_sampling/variable_batch_size_and_lr.py",
        "    if metrics_path is not None and MMapIndexedDataset.exists(prefix):",
        "    if False:",
        ("tests/test_variable_batch.py::test_lengths_measured_with_batch_seqlens_fn_then_read_"
         "from_the_metrics_files",),
    ),
    Mutant(
        "recursive_setattr sets the name on the model, not on its parent module",
        "compat/deepspeed/utils/module_utils.py",
        "    setattr(recursive_getattr(model, parent) if parent else model, last, module)",
        "    setattr(model, last, module)",
        ("tests/test_ds_runtime_helpers.py::test_recursive_getattr_and_setattr_reach_a_"
         "submodule_by_its_dotted_name",),
    ),
    Mutant(
        "random-LTD: the kept tokens drawn unsorted (their order in the sequence lost)",
        "data/token_drop.py",
        "    indices = draw.reshape(layers, batch, reserved).sort(dim=-1).values.to(torch.int32)",
        "    indices = draw.reshape(layers, batch, reserved).to(torch.int32)",
        (LTD + "test_training_equals_deepspeeds",
         LTD + "test_sampling_is_sorted_distinct_and_masks_follow"),
    ),
    Mutant(
        "random-LTD: seq-first hidden states indexed as if batch-first",
        "data/token_drop.py",
        "    idx = indices.long() if batch_first else indices.long().t()",
        "    idx = indices.long()",
        (LTD + "test_gather_and_scatter_equal_per_sample_indexing",),
    ),
    Mutant(
        "random-LTD: an encoder's mask cut like a decoder's instead of gathered",
        "data/token_drop.py",
        "    if not encoder:\n        return indices, (mask",
        "    if True:\n        return indices, (mask",
        (LTD + "test_training_equals_deepspeeds",
         LTD + "test_sampling_is_sorted_distinct_and_masks_follow"),
    ),
    Mutant(
        "random-LTD: every wrapped layer reads the first layer's draw",
        "data/token_drop.py",
        "        mine = indices[self.random_ltd_layer_id]",
        "        mine = indices[0]",
        (LTD + "test_training_equals_deepspeeds",
         LTD + "test_hugging_face_gpt2_blocks_with_positional_mask"),
    ),
    Mutant(
        "random-LTD: layer-tokens counted at every micro-step, not once per step",
        "data/token_drop.py",
        "        if global_steps != self.state[STEP]:",
        "        if True:",
        (LTD + "test_schedule_equals_deepspeeds",),
    ),
    Mutant(
        "random-LTD: the schedule not advanced at a training forward",
        "compat/deepspeed/runtime/engine.py",
        "            self.random_ltd_scheduler.update_seq(self.global_steps)",
        "            pass",
        (LTD + "test_training_equals_deepspeeds",),
    ),
    Mutant(
        "random-LTD: the schedule not loaded back from a checkpoint",
        "engine/train_state.py",
        "            self.random_ltd.load_state_dict(state[\"random_ltd\"])",
        "            pass",
        (LTD + "test_sharded_stages_drop_the_same_tokens_and_the_schedule_is_checkpointed",),
    ),
    Mutant(
        "random-LTD: the wrappers left in module_state_dict's names",
        "compat/deepspeed/runtime/engine.py",
        "        return token_drop.remove_random_ltd_state_dict(sd) if self.random_ltd_enabled() "
        "else sd",
        "        return sd",
        (LTD + "test_training_equals_deepspeeds",),
    ),
    Mutant(
        "random-LTD: a positional mask not bound to its name (left full length)",
        "data/token_drop.py",
        "        if not args:\n            return dict(kwargs)",
        "        if True:\n            return dict(kwargs)",
        (LTD + "test_a_mask_passed_by_position_is_found_by_name",),
    ),
    Mutant(
        "partition_config: the holders' head counts not divided by tp",
        "tensor_parallel/autotp.py",
        "                setattr(module, attr, value // tp)",
        "                pass",
        (SPECS + "test_custom_specs_train_as_one_process",),
    ),
    Mutant(
        "partition_config: a fused weight's parts ignored (a contiguous slice of the stack)",
        "config/parallel.py",
        "        return self.shape[0] if self.shape is not None else 1",
        "        return 1",
        (SPECS + "test_custom_specs_train_as_one_process",),
    ),
    Mutant(
        "partition_config: the last matching spec wins",
        "config/parallel.py",
        "        return next((s for s in self.layer_specs if s.matches(name, model_type)), None)",
        "        return next((s for s in self.layer_specs[::-1] if s.matches(name, model_type)), "
        "None)",
        (SPECS + "test_the_first_matching_spec_wins",),
    ),
    Mutant(
        "partition_config: a spec's model_types ignored",
        "config/parallel.py",
        "        if self.model_types:\n            kinds",
        "        if False:\n            kinds",
        (SPECS + "test_unmatched_layers_strict_mode_model_types_and_embeddings",),
    ),
    Mutant(
        "partition_config: strict_mode lets an unmatched layer through",
        "tensor_parallel/autotp.py",
        "        if spec is None and specs.strict_mode:",
        "        if False:",
        (SPECS + "test_unmatched_layers_strict_mode_model_types_and_embeddings",),
    ),
    Mutant(
        "partition_config: the specs not handed to AutoTP (the table is used instead)",
        "compose.py",
        "                autotp_parallelize(model, topo, specs)",
        "                autotp_parallelize(model, topo)",
        (SPECS + "test_custom_specs_train_as_one_process",),
    ),
    Mutant(
        "facade: an unknown key inside a list entry refused, not left out",
        "config/load.py",
        "    block = \".\".join(str(part) for part in loc[:-1] if not isinstance(part, int))",
        "    block = \".\".join(str(part) for part in loc[:-1])",
        (SPECS + "test_an_unknown_key_in_a_spec_is_left_out_under_the_facade_and_refused_"
         "natively",),
    ),
    Mutant(
        "DataAnalyzer: a value's samples never flushed to its csv during the map",
        "data/analyzer.py",
        "FLUSH = 100  #",
        "FLUSH = 10**9  #",
        (DA + "test_files_equal_deepspeeds_byte_for_byte",),
    ),
    Mutant(
        "DataAnalyzer: a batch counted as len(batch) (a dict's keys), DeepSpeed's fault",
        "data/analyzer.py",
        "            done += len(positions)",
        "            done += len(data)",
        (DA + "test_dict_batches_and_torch_dtypes",),
    ),
    Mutant(
        "DataAnalyzer: merged values kept in int64, not the smallest dtype that holds them",
        "data/analyzer.py",
        "        value_dtype = find_fit_int_dtype(values[0], values[-1])",
        "        value_dtype = np.int64",
        (DA + "test_files_equal_deepspeeds_byte_for_byte",),
    ),
    Mutant(
        "DataAnalyzer: a metric's dtype not checked",
        "data/analyzer.py",
        "            if not _same_dtype(values, dtype):",
        "            if False:",
        (DA + "test_dict_batches_and_torch_dtypes",),
    ),
    Mutant(
        "torch_autocast: forward never under autocast",
        "core/precision.py",
        "    if not cfg.torch_autocast.enabled:\n        return contextlib.nullcontext()",
        "    if True:\n        return contextlib.nullcontext()",
        (TA + "test_losses_equal_deepspeeds",),
    ),
    Mutant(
        "torch_autocast: the configured dtype ignored (fp16)",
        "core/precision.py",
        "    return DTYPES[block.dtype] if block.dtype else",
        "    return torch.float16 if block.dtype else",
        (TA + "test_losses_equal_deepspeeds",),
    ),
    Mutant(
        "torch_autocast: fp32 weights at stages 1-3 not refused (one reduce dtype per bucket)",
        "validate.py",
        "    elif not cfg.bf16.enabled and stage > 0:",
        "    elif False:",
        (TA + "test_combinations_not_served_are_refused",),
    ),
    Mutant(
        "torch_autocast: communication_data_type beside it not refused",
        "validate.py",
        "    elif cfg.communication_data_type is not None:",
        "    elif False:",
        (TA + "test_combinations_not_served_are_refused",),
    ),
    Mutant(
        "OneCycle: the stairs not held flat (the continuous position divided)",
        "optim/lr_schedules.py",
        "            scale = math.floor(position) / stairs",
        "            scale = position / stairs",
        (OC + "test_lrs_and_betas_equal_deepspeeds_bit_for_bit",),
    ),
    Mutant(
        "OneCycle: the first beta moves with the lr instead of against it",
        "optim/lr_schedules.py",
        "            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in pairs]",
        "            return [(lo[0] + (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in pairs]",
        (OC + "test_lrs_and_betas_equal_deepspeeds_bit_for_bit",),
    ),
    Mutant(
        "OneCycle: the lr grows after the cycle instead of decaying",
        "optim/lr_schedules.py",
        "        return [lo / factor for lo in self.min_lrs]",
        "        return [lo * factor for lo in self.min_lrs]",
        (OC + "test_lrs_and_betas_equal_deepspeeds_bit_for_bit",),
    ),
    Mutant(
        "LRRangeTest: the staircase ignored",
        "optim/lr_schedules.py",
        "math.floor(interval) if self.staircase else interval",
        "interval",
        (OC + "test_lrs_and_betas_equal_deepspeeds_bit_for_bit",),
    ),
    Mutant(
        "a micro-step inside a window says the last update applied",
        "engine/update.py",
        "        return StepOutcome(self.grad_norm, applied=False)",
        "        return StepOutcome(self.grad_norm, applied=True)",
        (T_CONTROLS,),
    ),
    Mutant(
        "the update's outcome calls a skipped step applied",
        "engine/update.py",
        "        return StepOutcome(value, applied=not overflow)",
        "        return StepOutcome(value, applied=True)",
        ("tests/test_engine_surface.py::test_a_step_callback_gets_each_steps_report",),
    ),
    Mutant(
        "initialize starts no watchdog",
        "engine/__init__.py",
        "        self.watchdog = start_watchdog(self.comm.log, config.watchdog, self.topology)",
        "        self.watchdog = None",
        (T_RAISED,),
    ),
    Mutant(
        "one part of the engine imports a sibling part (the engine composes them)",
        "engine/replicas.py",
        "from ..moe.utils import is_moe_param\n",
        "from ..moe.utils import is_moe_param\nfrom .update import StepOutcome  # noqa: F401\n",
        (T_LAYERS,),
    ),
    Mutant(
        "core's run reaches for the clock (core's modules stand alone)",
        "core/run.py",
        "from torch import nn\n",
        "from torch import nn\n\nfrom .clock import device_clock  # noqa: F401\n",
        (T_LAYERS,),
    ),
]


def stale(mutants: list[Mutant], src: str = os.path.join(ROOT, "src")) -> list[str]:
    """Mutants whose text does not occur exactly once in their file, or that change nothing."""
    problems = []
    for m in mutants:
        path = os.path.join(src, "zerostack", m.file)
        count = open(path).read().count(m.old) if os.path.exists(path) else 0
        if count != 1:
            problems.append(f"mutant {m.name!r}: {m.file} holds its text {count} times, not once")
        if m.new == m.old:
            problems.append(f"mutant {m.name!r}: its replacement is its text")
    return problems


def missing_tests(mutants: list[Mutant]) -> list[str]:
    """Test ids named by the mutants that pytest does not collect (one collection of them all)."""
    targets = sorted({t for m in mutants for t in m.tests})
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd + targets, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        return []
    out = proc.stdout + proc.stderr
    named = [  # pytest names them by absolute path
        os.path.relpath(t.split("::")[0], ROOT) + t[len(t.split("::")[0]) :]
        for t in re.findall(r"^ERROR: not found: (\S+)", out, re.M)
    ]
    return [f"test {t}: not collected" for t in named] or [out[-2000:]]


def _read(src: str, m: Mutant) -> str:
    problems = stale([m], src)
    if problems:
        raise SystemExit(problems[0])
    return open(os.path.join(src, "zerostack", m.file)).read()


def _apply(src: str, m: Mutant) -> None:
    text = _read(src, m)
    with open(os.path.join(src, "zerostack", m.file), "w") as f:
        f.write(text.replace(m.old, m.new))


def _git(*args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def rotation(count: int, commit: str = "HEAD") -> int:
    """Where a budgeted run starts: the commit's hash modulo the number of mutants, moved half
    way round where that is where the commit's first parent started, so two commits in a row
    never start at the same mutant (the chain is followed from the first commit)."""
    r = None
    for sha in _git("rev-list", "--first-parent", "--reverse", commit).split():
        raw = int(sha, 16) % count
        r = (raw + count // 2) % count if raw == r else raw
    return r if r is not None else 0


def _importers(helpers: set[str]) -> set[str]:
    """Test files that import any of the helper modules under tests/ (``census``, ``parity``,
    ...) or run one as a script (``resume_job.py``), directly or through another helper."""
    texts = {
        f"tests/{f}": open(os.path.join(ROOT, "tests", f)).read()
        for f in os.listdir(os.path.join(ROOT, "tests"))
        if f.endswith(".py")
    }
    found, names = set(), {os.path.basename(h)[:-3] for h in helpers}
    while names:
        alts = "|".join(map(re.escape, names))  # imported, or run as a script (resume_job.py)
        pattern = re.compile(rf"^\s*(?:import|from) ({alts})\b|\b({alts})\.py\b", re.M)
        new = {f for f, text in texts.items() if f not in found and pattern.search(text)}
        found |= new
        names = {os.path.basename(f)[:-3] for f in new if not f.startswith("tests/test_")}
    return found


def changed_since(rev: str, mutants: list[Mutant]) -> list[Mutant]:
    """Mutants whose source file or whose tests differ between ``rev`` and the working tree
    (committed or not): a test edited, or a helper it imports (``tests/census.py``), can let a
    mutant through as surely as the source can."""
    files = set(_git("diff", "--name-only", rev, "--", "src/zerostack", "tests").splitlines())
    files |= set(_git("ls-files", "--others", "--exclude-standard", "src", "tests").splitlines())
    helpers = {f for f in files if f.startswith("tests/") and not f.startswith("tests/test_")}
    files |= _importers(helpers)
    return [
        m
        for m in mutants
        if f"src/zerostack/{m.file}" in files or any(t.split("::")[0] in files for t in m.tests)
    ]


def _pytest(tests: tuple[str, ...], pythonpath: str | None, timeout: int) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
    cmd += [f"--timeout={timeout}", *tests]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def _killer(output: str) -> str:
    found = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    return found.group(1) if found else "(no test named)"


def run(mutants: list[Mutant], timeout: int, verbose: bool, budget: float | None) -> tuple:
    """Plant and test each mutant in turn; with a ``budget`` (seconds), start none after it is
    spent. Returns (killed, survived names, how many ran)."""
    killed, survived, ran = 0, [], 0
    width = max((len(m.name) for m in mutants), default=0)
    began = time.monotonic()
    for m in mutants:
        if budget is not None and time.monotonic() - began >= budget:
            break
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="zs-mutant-") as tmp:
            src = os.path.join(tmp, "src")
            shutil.copytree(os.path.join(ROOT, "src"), src)
            _apply(src, m)
            code, out = _pytest(m.tests, src, timeout)
        took = time.monotonic() - t0
        ran += 1
        if code == 5 or "no tests ran" in out:
            raise SystemExit(f"mutant {m.name!r}: its tests {m.tests} select nothing")
        if code == 0:
            survived.append(m.name)
            print(f"SURVIVED  {m.name:<{width}}  ({took:.0f}s)", flush=True)
        else:
            killed += 1
            print(f"killed    {m.name:<{width}}  by {_killer(out)}  ({took:.0f}s)", flush=True)
            if verbose:
                lines = [ln for ln in out.splitlines() if re.match(r"^E\s", ln)]
                print("\n".join("          " + ln for ln in lines[-6:]), flush=True)
    return killed, survived, ran


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-k", default="", help="only mutants whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument("--check", action="store_true", help="check texts and test ids, run none")
    parser.add_argument("--budget", type=float, help="seconds; start no mutant after they pass")
    parser.add_argument("--rotation", type=int, help="with --budget: start here, not at the "
                        "commit's rotation (to repeat a CI run)")  # fmt: skip
    parser.add_argument("--changed", metavar="REV", help="only mutants whose file or tests "
                        "changed since REV")  # fmt: skip
    parser.add_argument("--baseline", action="store_true", help="run the tests unmutated first")
    parser.add_argument("--timeout", type=int, default=300, help="per test, seconds")
    parser.add_argument("-v", "--verbose", action="store_true", help="show how each test failed")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if args.k in m.name]
    if args.changed:
        chosen = changed_since(args.changed, chosen)
    if args.list:
        for m in chosen:
            print(f"{m.name}\n    {m.file}: {m.old!r} -> {m.new!r}\n    " + " ".join(m.tests))
        return 0
    problems = stale(chosen)  # fail fast on a stale mutant, before any test runs
    if args.check:
        problems += missing_tests(chosen)
        for line in problems:
            print(line)
        tests = len({t for m in chosen for t in m.tests})
        verdict = f"{len(problems)} problems" if problems else "all present"
        print(f"check: {len(chosen)} mutants, {tests} test targets: {verdict}")
        return 1 if problems else 0
    if problems:
        raise SystemExit("\n".join(problems))
    if args.baseline:
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        code, out = _pytest(tests, None, args.timeout)
        if code != 0:
            print(out[-3000:])
            print("baseline: the tests fail on the unmutated source; fix that first")
            return 1
        print(f"baseline: {len(tests)} test targets pass on the unmutated source")
    tail = ""
    if args.budget is not None:
        r = args.rotation if args.rotation is not None else rotation(len(chosen))
        r %= max(len(chosen), 1)
        chosen = chosen[r:] + chosen[:r]
        print(f"rotation {r}: starting at {chosen[0].name!r}, {args.budget:.0f} s", flush=True)
    elif args.changed:
        print(f"{len(chosen)} mutants whose file or tests changed since {args.changed}")
    killed, survived, ran = run(chosen, args.timeout, args.verbose, args.budget)
    if args.budget is not None:
        tail = f" ({ran} of {len(chosen)} run, rotation {r})"
    print(f"{killed} killed, {len(survived)} survived{tail}")
    return 0 if not survived else 1


if __name__ == "__main__":
    sys.exit(main())
