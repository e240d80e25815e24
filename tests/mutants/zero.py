"""The mutants of src/zerostack/zero/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "ZeRO-3 hooks only modules with parameters of their own (an MLP called alone borrows none)",
        "zero/stage3/coordinator.py",
        "        out.append(m)\n",
        "        if list(m.parameters(recurse=False)) or m is root:\n            out.append(m)\n",
        (
            "tests/test_hf_long.py::"
            "test_tiled_mlp_tiled_loss_and_cpu_checkpoints_match_single_process[2-2-3]",
        ),
    ),
    Mutant(
        "stage 3: parameters cut over two axes gathered in one collective over the first",
        "zero/stage3/collectives.py",
        "    if len(set(keys)) > 1:  # one collective per axis and kind, in one order on all ranks",
        "    if False:",
        (
            "tests/test_moe.py::test_expert_parallel_gpt_matches_single_process"
            "[dp2xep2-top2-drops-stage3]",
        ),
    ),
    Mutant(
        "stage 3: a piece's record for a gather loses its cut (gathered over dp)",
        "zero/stage3/params.py",
        '        cut = {"axis": self.axis, "world": self.world, "rank": self.rank}',
        "        cut = {}",
        (
            "tests/test_moe.py::test_expert_parallel_gpt_matches_single_process"
            "[dp2xep2-top2-drops-stage3]",
        ),
    ),
    Mutant(
        "stage 3: every gradient staged in the dp axis's reducer",
        "zero/stage3/strategy.py",
        "        reducer = self.reducers[p._zs.axis]",
        "        reducer = self.reduce",
        (
            "tests/test_moe.py::test_expert_parallel_gpt_matches_single_process"
            "[dp2xep2-top2-drops-stage3]",
        ),
    ),
    Mutant(
        "stages 1-2: a bucket's update gathered over dp, not its own cut's axis",
        "zero/flat/write_back.py",
        "        handle = self.comm.all_gather(full, src, axis=fg.cut.axis, async_op=True)",
        '        handle = self.comm.all_gather(full, src, axis="dp", async_op=True)',
        (
            "tests/test_moe.py::test_expert_parallel_gpt_matches_single_process"
            "[dp2xep2-top1-drops-stage1]",
        ),
    ),
    Mutant(
        "zero.Init's pieces kept though cut over other ranks than the grid's",
        "zero/stage3/params.py",
        "        elif (p._zs.world, p._zs.rank) != (topo.size(axis), topo.rank(axis)):",
        "        elif False:",
        ("tests/test_moe.py::test_pieces_cut_over_other_ranks_than_the_grids_are_refused",),
    ),
    Mutant(
        "stage 2 under a pipeline reduces once per batch, as stage 1 (no backward bracketed)",
        "zero/flat/strategy.py",
        "        self.reduces_each_backward = self.grads.every_micro_step",
        "        self.reduces_each_backward = False",
        (
            "tests/test_stage2_live.py::"
            "test_stage_2_under_a_pipeline_holds_a_shard_of_the_gradients",
        ),
    ),
    Mutant(
        "MoE at stage 3: what every ep rank holds is cut and reduced over dp only",
        "zero/stage3/params.py",
        '        axis = "dp_ep" if p in wide else "dp"',
        '        axis = "dp"',
        (
            "tests/test_moe.py::test_expert_parallel_gpt_matches_single_process"
            "[dp2xep2-top2-drops-stage3]",
        ),
    ),
    Mutant(
        "MoE at stage 3: the shared pieces' sum over dp x ep is not divided by ep",
        "zero/stage3/reduce.py",
        "            prescale=prescale * comm.topo.dp / comm.topo.size(axis),",
        "            prescale=prescale,",
        (
            "tests/test_moe.py::test_expert_parallel_gpt_matches_single_process"
            "[dp2xep2-top2-drops-stage3]",
        ),
    ),
    Mutant(
        "stage 1-2 grad norm over whole buckets (another sum order than DeepSpeed's)",
        "zero/flat/strategy.py",
        "            st.master.grad[lo:hi]\n"
        "            for st in self.flat.buckets\n"
        "            for lo, hi, p in st.segments\n"
        "            if hi > lo and p not in skip\n",
        "            st.master.grad\n            for st in self.flat.buckets\n",
        ("tests/test_hf_trainer.py::test_trainer_losses_and_reload_equal_deepspeeds[zero2_gas2]",),
    ),
    Mutant(
        "fp16 unscale drops the loss scale (stages 0-2)",
        "zero/flat/strategy.py",
        "return 1.0 / (loss_scale * self.prescale * self.dp) if self.dp > 1 else 1.0 / loss_scale",
        "return 1.0 / (self.prescale * self.dp) if self.dp > 1 else 1.0",
        ("tests/test_mixed_precision.py::test_matches_mixed_precision_reference[fp16-dp2]",),
    ),
    Mutant(
        "fp16 unscale drops the loss scale (stage 3)",
        "zero/stage3/strategy.py",
        "return 1.0 / (loss_scale * self.prescale * self.dp)",
        "return 1.0 / (self.prescale * self.dp)",
        ("tests/test_mixed_precision.py::test_matches_mixed_precision_reference[fp16-dp2]",),
    ),
    Mutant(
        "dp gradients summed, not averaged (stages 0-2)",
        "zero/flat/strategy.py",
        "return 1.0 / (loss_scale * self.prescale * self.dp) if self.dp > 1 else 1.0 / loss_scale",
        "return 1.0 / (loss_scale * self.prescale) if self.dp > 1 else 1.0 / loss_scale",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[dp2]",),
    ),
    Mutant(
        "dp gradients summed, not averaged (stage 3)",
        "zero/stage3/strategy.py",
        "return 1.0 / (loss_scale * self.prescale * self.dp)",
        "return 1.0 / (loss_scale * self.prescale)",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[dp2]",),
    ),
    Mutant(
        "shard offset off by one element",
        "zero/partition.py",
        "lo = bucket.start + rank * bucket.piece_numel",
        "lo = bucket.start + rank * bucket.piece_numel - (rank > 0)",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[dp2]",),
    ),
    Mutant(
        "pieces padded to whole elements only, not to 16 bytes",
        "zero/partition.py",
        "ALIGN_NUMEL = 8\n",
        "ALIGN_NUMEL = 1\n",
        (
            "tests/test_cuda_path.py::test_every_collective_buffer_starts_16_byte_aligned[1]",
            "tests/test_cuda_path.py::test_every_collective_buffer_starts_16_byte_aligned[3]",
            "tests/test_partition.py::test_engine_layouts_align_every_piece_to_16_bytes",
        ),
    ),
    Mutant(
        "stage 1-2 buckets padded to whole elements only",
        "zero/partition.py",
        "            piece = piece_numel(offset - start, world, align)",
        "            piece = piece_numel(offset - start, world, 1)",
        (
            "tests/test_cuda_path.py::test_every_collective_buffer_starts_16_byte_aligned[1]",
            "tests/test_partition.py::test_engine_layouts_align_every_piece_to_16_bytes",
        ),
    ),
    Mutant(
        "stage 3 pieces padded to whole elements only",
        "zero/stage3/params.py",
        "    piece_numel = partition.piece_numel(n, world)",
        "    piece_numel = max(1, -(-n // world))",
        ("tests/test_cuda_path.py::test_every_collective_buffer_starts_16_byte_aligned[3]",),
    ),
    Mutant(
        "zero reaches up into the watchdog (an upward import, no cycle)",
        "zero/partition.py",
        "from dataclasses import dataclass\n",
        "from dataclasses import dataclass\n\nfrom ..watchdog import default_store  # noqa: F401\n",
        ("tests/test_architecture.py::test_the_layers_contract_is_kept",),
    ),
    Mutant(
        "NVMe optimizer state loaded but not written to its files",
        "zero/offload/host.py",
        'self.store.write(self.key[p], [values["master"], *(values[k] for k in names)])',
        "pass",
        ("tests/test_checkpoint.py::test_exact_resume_with_offload",),
    ),
    Mutant(
        "stage-3 NVMe load not written into the parameter pieces",
        "zero/stage3/checkpoint.py",
        'self.writer.write(self.group_of[master], values["master"])',
        "pass",
        ("tests/test_checkpoint.py::test_exact_resume_with_offload",),
    ),
    Mutant(
        "stage-3 parameter released before its last use",
        "zero/stage3/coordinator.py",
        "            if st.gathered:\n                continue\n",
        "            if False:\n                continue\n",
        ("tests/test_stage3_edges.py::test_stage3_matches_single_process[2-foreign]",),
    ),
    Mutant(
        "stage-3 parameter read by a module that does not own it is not kept by that unit",
        "zero/stage3/coordinator.py",
        "if u not in self._units_of[p]:",
        "if False:",
        ("tests/test_stage3_edges.py::test_stage3_matches_single_process[2-foreign]",),
    ),
    Mutant(
        "stage-3 root module not a unit",
        "zero/stage3/coordinator.py",
        "        out.append(m)\n",
        "        if m is not root:\n            out.append(m)\n",
        ("tests/test_stage3_edges.py::test_stage3_matches_single_process[2-root]",),
    ),
    Mutant(
        "stage-3 no_grad pass recorded as the prefetch order",
        "zero/stage3/coordinator.py",
        "            if training:\n                self.recording.append(u)",
        "            if True:\n                self.recording.append(u)",
        ("tests/test_stage3_edges.py::test_prefetch_survives_eval_passes",),
    ),
    Mutant(
        "a bucket some of whose parameters got no gradient is never reduced",
        "zero/reducer.py",
        "        while self._next < len(self._sizes):\n            self._start(self._next)\n",
        "",
        ("tests/test_stage3_edges.py::test_stage3_matches_single_process[2-unused]",),
    ),
    Mutant(
        "stage-3 reduced rows held until backward ends, a gradient shard's worth",
        "zero/reducer.py",
        "            while len(self._handles) - self._waited > self._in_flight:",
        "            while False:",
        ("tests/test_stage3_live.py::test_reduced_rows_are_delivered_during_backward",),
    ),
    Mutant(
        "stage-3 row delivered before its reduce-scatter completes",
        "zero/reducer.py",
        "        if handle is not None:\n"
        "            handle.wait()\n"
        "        self._handles[self._waited]",
        "        self._handles[self._waited]",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[dp2]",),
    ),
    Mutant(
        "stage-3 row never delivered",
        "zero/stage3/reduce.py",
        "self._deliver(b, self._summed(b, out) if self.quantized and self.dp > 1 else out)",
        "None",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[dp2]",),
    ),
    Mutant(
        "stage-3 gathered copies from the heap",
        "zero/stage3/collectives.py",
        "fulls = [scratch.empty(world * pc.numel(), pc.dtype, pc.device) for pc in pieces]",
        "fulls = [torch.empty(world * pc.numel(), dtype=pc.dtype) for pc in pieces]",
        ("tests/test_scratch.py::test_stage3_gathers_gradients_and_staging_are_outside_the_heap",),
    ),
    Mutant(
        "weight gradient from the heap",
        "zero/stage3/linear.py",
        "            if flat.dtype == x2.dtype:",
        "            if False:",
        ("tests/test_scratch.py::test_stage3_gathers_gradients_and_staging_are_outside_the_heap",),
    ),
    Mutant(
        "stage-3 staging matrices from the heap",
        "zero/stage3/reduce.py",
        "return self.buffers.take(self.dp * self.width[b], self.dtype, device).view(self.dp, -1)",
        "return torch.empty(self.dp, self.width[b], dtype=self.dtype, device=device)",
        ("tests/test_scratch.py::test_stage3_gathers_gradients_and_staging_are_outside_the_heap",),
    ),
    Mutant(
        "a bucket launched before all its gradients arrived",
        "zero/reducer.py",
        "and self._arrived[self._next] >= self._sizes[self._next]",
        "and True",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[dp2]",),
    ),
    Mutant(
        "stage-3 tied weight reduced by both modules holding it",
        "zero/stage3/strategy.py",
        "[p for p in ps if owner[p] == u and p in self._trainable]",
        "[p for p in ps if p in self._trainable]",
        ("tests/test_stage3_edges.py::test_stage3_matches_single_process[2-tied]",),
    ),
    Mutant(
        "stage-2 full-size gradient kept after its bucket (a leak)",
        "zero/flat/grads.py",
        "p.grad = None  # the full-size gradient does not outlive its bucket",
        "pass",
        ("tests/test_memory.py::test_live_storage_census_matches_the_zero_formulas[2]",),
    ),
    Mutant(
        "stage-3 full gradient kept after its hook (a leak)",
        "zero/stage3/reduce.py",
        "p.grad = None  # the full gradient does not outlive this hook",
        "pass",
        ("tests/test_memory.py::test_live_storage_census_matches_the_zero_formulas[2]",),
    ),
    Mutant(
        "stage-3 gathered copy kept on the parameter (a leak)",
        "zero/stage3/gather.py",
        "hold(p, full, self.meter, p._zs.world > 1)",
        "hold(p, full, self.meter, p._zs.world > 1); p._zs_stale = full",
        ("tests/test_memory.py::test_live_storage_census_matches_the_zero_formulas[2]",),
    ),
    Mutant(
        "stage-1 reduced piece kept after the step (a leak)",
        "zero/flat/strategy.py",
        "st.piece = None\n",
        "pass\n",
        ("tests/test_memory.py::test_live_storage_census_matches_the_zero_formulas[2]",),
    ),
    Mutant(
        "a frozen piece in host memory (offload_param) not written back after a load",
        "zero/stage3/checkpoint.py",
        "self.swapper.update(p, p._zs.piece)",
        "pass",
        ("tests/test_frozen.py",),
    ),
    Mutant(
        "stage-3 reduce buckets: every piece placed at the start of its bucket's row",
        "zero/partition.py",
        "bucket[i], at[i] = len(items) - 1, width[-1]",
        "bucket[i], at[i] = len(items) - 1, 0",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[dp2]",),
    ),
    Mutant(
        "an NVMe store is not removed when the watchdog ends the rank",
        "zero/offload/nvme.py",
        "        before_hard_exit(self._remove_on_hard_exit)  # the watchdog's exit skips atexit\n",
        "",
        ("tests/test_disk_faults.py::test_the_watchdogs_exit_removes_the_ranks_swap_files",),
    ),
    Mutant(
        "memory by device: stages 0-2 put every buffer on the compute device",
        "zero/flat/checkpoint.py",
        "            yield kind, t.device.type, t.nbytes",
        "            yield kind, self.comm.topo.device.type, t.nbytes",
        ("tests/test_cuda_path.py::test_device_and_host_bytes_are_reported_apart",),
    ),
    Mutant(
        "memory by device: stage 3's masters counted where the parameters compute",
        "zero/stage3/checkpoint.py",
        "            yield kind, t.device.type, t.nbytes\n        for p in self.owner:",
        '            yield kind, device if kind == "master" else t.device.type, t.nbytes\n'
        "        for p in self.owner:",
        ("tests/test_cuda_path.py::test_device_and_host_bytes_are_reported_apart",),
    ),
    Mutant(
        "qwZ: the config's flag never reaches stage 3 (plain gathers)",
        "zero/build.py",
        "            quantized_weights=zcfg.zero_quantized_weights,",
        "            quantized_weights=False,",
        (
            "tests/test_zeropp.py::"
            "test_qwz_trains_at_the_quantized_weights_and_keeps_exact_masters",
            "tests/test_zeropp.py::test_qwz_gathers_under_a_third_of_the_bytes",
        ),
    ),
    Mutant(
        "qwZ: values truncated toward zero instead of rounded",
        "zero/stage3/quantize.py",
        "    q = torch.round(x.div_(divisor[:, None]))",
        "    q = torch.trunc(x.div_(divisor[:, None]))",
        ("tests/test_zeropp.py::test_a_round_trip_is_within_half_a_step_of_the_block_scale",),
    ),
    Mutant(
        "qwZ: block scales rounded to the nearest bf16, not up (values clamped at 127)",
        "zero/stage3/quantize.py",
        "    scale = _bf16_up(x.abs().amax(dim=1) / top)",
        "    scale = (x.abs().amax(dim=1) / top).to(SCALE).float()",
        ("tests/test_zeropp.py::test_a_round_trip_is_within_half_a_step_of_the_block_scale",),
    ),
    Mutant(
        "qwZ: a piece's blocks start where the last full block of the one before ends",
        "zero/stage3/quantize.py",
        "        at += blocks(n)",
        "        at += n // BLOCK",
        (
            "tests/test_zeropp.py::test_a_payload_holds_every_piece_and_its_size_is_the_formula",
            "tests/test_zeropp.py::"
            "test_qwz_trains_at_the_quantized_weights_and_keeps_exact_masters",
        ),
    ),
    Mutant(
        "qgZ: the config's flag never reaches stage 3 (plain reduce-scatter)",
        "zero/build.py",
        "            quantized_gradients=zcfg.zero_quantized_gradients,",
        "            quantized_gradients=False,",
        (
            "tests/test_zeropp.py::"
            "test_qgz_trains_at_the_quantized_gradients_and_moves_under_a_third_of_the_bytes",
        ),
    ),
    Mutant(
        "qgZ: only this rank's own contribution summed",
        "zero/stage3/reduce.py",
        "            for r in range(1, self.dp):",
        "            for r in range(1, 1):",
        (
            "tests/test_zeropp.py::"
            "test_qgz_trains_at_the_quantized_gradients_and_moves_under_a_third_of_the_bytes",
        ),
    ),
    Mutant(
        "qgZ: each row sent to the wrong rank",
        "zero/stage3/reduce.py",
        "for row in staging])",
        "for row in staging.flip(0)])",
        (
            "tests/test_zeropp.py::"
            "test_qgz_trains_at_the_quantized_gradients_and_moves_under_a_third_of_the_bytes",
        ),
    ),
    Mutant(
        "hpZ: the secondary piece cut at the dp rank, not the rank within the pair",
        "zero/stage3/collectives.py",
        "        return cls(size, topo.dp_rank % size, topo.dp_subgroup(size))",
        "        return cls(size, topo.dp_rank // size, topo.dp_subgroup(size))",
        ("tests/test_zeropp.py::test_hpz_gathers_the_backward_within_pairs_and_changes_no_bit",),
    ),
    Mutant(
        "hpZ: secondary pieces held past the backward (memory until the next forward)",
        "zero/stage3/coordinator.py",
        "        self._bwd_held = {}\n"
        "        self._drop_inflight()\n"
        "        self._drop_kept()\n"
        "        self.gathers.drop_secondaries()\n",
        "        self._bwd_held = {}\n        self._drop_inflight()\n        self._drop_kept()\n",
        ("tests/test_zeropp.py::test_hpz_gathers_the_backward_within_pairs_and_changes_no_bit",),
    ),
    Mutant(
        "hpZ: the backward gathers over dp as before (the secondaries unused)",
        "zero/stage3/gather.py",
        "        from_secondary = all(p._zs.secondary is not None for p in params)",
        "        from_secondary = False",
        ("tests/test_zeropp.py::test_hpz_gathers_the_backward_within_pairs_and_changes_no_bit",),
    ),
    Mutant(
        "hpZ: a size that does not divide dp reaches the grid (no ConfigError naming the key)",
        "zero/stage3/collectives.py",
        "        if topo.dp % size:\n            raise ConfigError(",
        "        if False:\n            raise ConfigError(",
        (
            "tests/test_zeropp.py::"
            "test_an_hpz_size_that_does_not_divide_dp_is_refused_at_initialize",
        ),
    ),
    Mutant(
        "safe_get_full_grad mid-window at stages 0-1: the local gradients not summed over dp",
        "zero/flat/grads.py",
        "self.comm.all_reduce(grad, axis=cut.axis)",
        "pass",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s1]",),
    ),
    Mutant(
        "communication_data_type at stage 0: the all-reduced copy not written back",
        "zero/flat/grads.py",
        "return handle if sent is chunk else CastBack(handle, sent, chunk)",
        "return handle",
        ("tests/test_comm_dtype.py::test_fp32_reduction_sends_fp32_and_sums_exactly",),
    ),
    Mutant(
        "communication_data_type at stage 3: buckets staged in the compute dtype",
        "zero/stage3/strategy.py",
        "dtype=precision.reduce_dtype,",
        "dtype=dtype,",
        ("tests/test_comm_dtype.py::test_fp32_reduction_sends_fp32_and_sums_exactly",),
    ),
    Mutant(
        "grad_accum_dtype at stages 0-1: a micro-batch's .grad kept after it is summed",
        "zero/flat/grads.py",
        "p.grad = view if view.dtype == p.grad.dtype else None",
        "p.grad = view if view.dtype == p.grad.dtype else p.grad",
        ("tests/test_comm_dtype.py::test_fp32_accumulation_buffer_across_micro_batches",),
    ),
    Mutant(
        "grad_accum_dtype at stage 3: the gradient shard always fp32",
        "zero/offload/masters.py",
        "return torch.zeros_like(master, dtype=self.dtype)",
        "return torch.zeros_like(master)",
        ("tests/test_comm_dtype.py::test_fp32_accumulation_buffer_across_micro_batches",),
    ),
    Mutant(
        "zero.Init leaves Hugging Face's initialisation to empty pieces",
        "zero/init.py",
        "self._undo_hf = patch_init_weights(_gathered_pieces)",
        "self._undo_hf = None",
        ("tests/test_hf.py::test_hf_model_matches_single_process_training[llama]",),
    ),
    Mutant(
        "Hugging Face initialisation not written back into the pieces",
        "zero/init.py",
        "GatheredParameters([p for p in params if is_sharded(p)], modifier_rank=0)",
        "GatheredParameters([p for p in params if is_sharded(p)], modifier_rank=None)",
        ("tests/test_hf.py::test_hf_model_matches_single_process_training[gpt2]",),
    ),
    Mutant(
        "zero.Init(module=) ignored",
        "zero/init.py",
        "            for m in module.modules():",
        "            for m in []:",
        ("tests/test_hf.py::test_hf_model_matches_single_process_training[llama]",),
    ),
    Mutant(
        "ds_status not AVAILABLE while gathered",
        "zero/stage3/params.py",
        "    p.ds_status = ZeroParamStatus.AVAILABLE\n",
        "",
        ("tests/test_hf.py::test_stage3_parameters_carry_deepspeeds_attributes",),
    ),
    Mutant(
        "an NVMe load restores the masters but not their optimizer state",
        "zero/offload/host.py",
        'names = [k for k in values if k != "master"]',
        "names = []",
        (
            "tests/test_offload_checkpoint.py::"
            "test_exact_resume_in_fresh_processes_and_without_offload",
        ),
    ),
    Mutant(
        "an NVMe swap write error is swallowed",
        "zero/offload/nvme.py",
        '            raise self._failed("writing", key, exc) from exc',
        "            pass",
        ("tests/test_disk_faults.py::test_a_failed_swap_write_ends_every_rank[1]",),
    ),
    Mutant(
        "nvme space check off by the dtype size (stages 1-2)",
        "zero/flat/strategy.py",
        "need = sum(st.master.numel() for st in self.flat.buckets) * 4 * 3",
        "need = sum(st.master.numel() for st in self.flat.buckets) * 3",
        ("tests/test_disk_faults.py::test_an_nvme_path_too_small_is_refused",),
    ),
    Mutant(
        "nvme space check: two offloads on one disk checked apart",
        "zero/offload/nvme.py",
        "mine = need = self.need + sum(s.need for s in list(_LIVE) if s.dev == self.dev)",
        "mine = need = self.need",
        ("tests/test_disk_faults.py::test_what_shares_a_disk_is_counted_together",),
    ),
    Mutant(
        "nvme space check: the other ranks on this host not counted",
        "zero/offload/nvme.py",
        "        need *= local\n",
        "",
        ("tests/test_disk_faults.py::test_what_shares_a_disk_is_counted_together",),
    ),
    Mutant(
        "cuda: stage 3 sums the gradient norm into a host scalar",
        "zero/stage3/strategy.py",
        "        return self.grads.norms_sq(params).sum()",
        "        return self.grads.norms_sq(params).sum().cpu()",
        ("tests/test_cuda_path.py::test_a_step_on_the_device_waits_only_for_its_norm",),
    ),
    Mutant(
        "cuda: offloaded stage 2 adds a device piece into the host shard",
        "zero/flat/grads.py",
        "            if shard.device == st.piece.device:",
        "            if True:",
        (
            "tests/test_cuda_path.py::test_the_cuda_path_runs_and_matches_the_cpu_run"
            "[stage2-offload]",
        ),
    ),
    Mutant(
        "cuda: zero.Init broadcasts the host parameter",
        "zero/stage3/params.py",
        "full = p.data.to(comm.topo.device).contiguous()",
        "full = p.data.contiguous()",
        (
            "tests/test_cuda_path.py::test_the_cuda_path_runs_and_matches_the_cpu_run"
            "[stage3-zero-init]",
        ),
    ),
    Mutant(
        "cuda: the NVMe store writes a device tensor through numpy",
        "zero/offload/nvme.py",
        'view = t.detach().to("cpu").contiguous().view(torch.uint8).numpy()',
        "view = t.detach().contiguous().view(torch.uint8).numpy()",
        (
            "tests/test_cuda_path.py::test_the_cuda_path_runs_and_matches_the_cpu_run"
            "[stage3-offload-param-nvme]",
        ),
    ),
    Mutant(
        "fp16 at dp 1 (stages 0-2): the update is not unscaled",
        "zero/flat/strategy.py",
        "if self.dp > 1 else 1.0 / loss_scale",
        "if self.dp > 1 else 1.0",
        ("tests/test_cuda_path.py::test_the_gpu_check_script_runs_its_checks_on_the_cpu",),
    ),
    Mutant(
        "start: a whole gradient buffer made before the parameters' own storage goes",
        "zero/flat/params.py",
        "        params_flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)\n",
        "        params_flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)\n"
        "        _early = torch.zeros(layout.padded_numel, dtype=grad_dtype, device=device)\n",
        ("tests/test_cuda_path.py::test_the_start_peaks_near_the_steady_state",),
    ),
    Mutant(
        "safe_set_full_grad mid-window at stages 0-1: each rank's share not divided by dp",
        "zero/flat/grads.py",
        "grads_flat[rng].copy_(value / (cut.prescale * cut.size))",
        "grads_flat[rng].copy_(value)",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s1]",),
    ),
    Mutant(
        "safe_set_full_grad at stage 1: written before the boundary's reduction is waited for",
        "zero/flat/grads.py",
        "        reduced = self.flat.reduces and self.reducer.settle()\n"
        "        if cut.size > 1 and not reduced:  # every rank",
        "        reduced = False\n        if cut.size > 1 and not reduced:  # every rank",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s1]",),
    ),
    Mutant(
        "safe_set_full_grad on NVMe (stage 3): the step's norm keeps the old gradient",
        "zero/offload/masters.py",
        "        self.sq[p] = torch.linalg.vector_norm(value, dtype=torch.float32).square()\n",
        "",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s3_nvme]",),
    ),
    Mutant(
        "stage-3 prefetch ignores stage3_max_live_parameters",
        "zero/stage3/coordinator.py",
        "room = min(self.prefetch_numel - inflight, self.max_live_numel - self.live_numel)",
        "room = self.prefetch_numel - inflight",
        ("tests/test_stage3_live.py",),
    ),
    Mutant(
        "stage3_max_reuse_distance ignored",
        "zero/stage3/coordinator.py",
        "            if p in reused:",
        "            if False:",
        ("tests/test_stage3_live.py",),
    ),
    Mutant(
        "a resolved gather keeps its receive buffer alive",
        "zero/stage3/gather.py",
        "        self._finish = None  # the receive buffer: the parameters hold their own copies",
        "",
        ("tests/test_stage3_live.py",),
    ),
    Mutant(
        "empty_partition_cache releases nothing",
        "zero/stage3/coordinator.py",
        "        self._drop_inflight()\n"
        "        self._drop_kept()\n"
        "        self.gathers.drop_secondaries()\n"
        "\n"
        "    @eager\n"
        "    def _begin_pass",
        "        pass\n\n    @eager\n    def _begin_pass",
        ("tests/test_stage3_live.py",),
    ),
    Mutant(
        "stages 0-2 keep each rank's own initial weights",
        "zero/flat/params.py",
        "            if cut.size > 1:\n"
        "                comm.broadcast(value, src=0, axis=cut.axis)\n"
        "            if value is not dst:",
        "            if False:\n"
        "                comm.broadcast(value, src=0, axis=cut.axis)\n"
        "            if value is not dst:",
        ("tests/test_initialize.py::test_every_rank_starts_from_dp_rank_0s_weights",),
    ),
    Mutant(
        "stage 3 keeps each rank's own initial weights",
        "zero/stage3/params.py",
        "    if world > 1:\n        comm.broadcast(full, src=0, axis=axis)",
        "    if False:\n        comm.broadcast(full, src=0, axis=axis)",
        ("tests/test_initialize.py::test_every_rank_starts_from_dp_rank_0s_weights",),
    ),
    Mutant(
        "fp32 stages 0-2 broadcast the parameter's own storage at the start",
        "zero/flat/params.py",
        "            if dtype == torch.float32:\n                value = dst.copy_(",
        "            if False:\n                value = dst.copy_(",
        ("tests/test_cuda_path.py::test_the_start_peaks_near_the_steady_state[1-None-8-8]",),
    ),
    Mutant(
        "int4 qgZ: the bits key never reaches the reducer (int8 sent)",
        "zero/stage3/strategy.py",
        "            bits=gradient_bits,\n",
        "",
        (
            "tests/test_zeropp.py::"
            "test_int4_qgz_trains_at_its_coarser_gradients_and_moves_seven_times_fewer_bytes",
        ),
    ),
    Mutant(
        "int4 qgZ: values scaled to int8's 127 levels, then clamped at 7",
        "zero/stage3/quantize.py",
        "    return LEVELS if bits == 8 else 7",
        "    return LEVELS",
        ("tests/test_zeropp.py::test_an_int4_round_trip_is_within_half_a_step_of_the_block_scale",),
    ),
    Mutant(
        "int4 qgZ: the pair's nibbles swapped",
        "zero/stage3/quantize.py",
        "    return pairs[:, 0] | (pairs[:, 1] << 4)",
        "    return pairs[:, 1] | (pairs[:, 0] << 4)",
        ("tests/test_zeropp.py::test_an_int4_payload_holds_two_values_to_a_byte",),
    ),
    Mutant(
        "int4 qgZ: negative values unpacked without the offset",
        "zero/stage3/quantize.py",
        "    low = (packed & 15).to(torch.int8) - 8",
        "    low = (packed & 15).to(torch.int8)",
        ("tests/test_zeropp.py::test_an_int4_round_trip_is_within_half_a_step_of_the_block_scale",),
    ),
    Mutant(
        "int4 qgZ: a byte a value, as int8 (the bytes ratio)",
        "zero/stage3/quantize.py",
        "    return numel if bits == 8 else -(-numel // 2)",
        "    return numel",
        ("tests/test_zeropp.py::test_an_int4_payload_holds_two_values_to_a_byte",),
    ),
    Mutant(
        "int4 qgZ: the receiver unpacks as int8",
        "zero/stage3/reduce.py",
        "            quantize.unpack(received, numels, torch.float32, self.bits),",
        "            quantize.unpack(received, numels, torch.float32),",
        (
            "tests/test_zeropp.py::"
            "test_int4_qgz_trains_at_its_coarser_gradients_and_moves_seven_times_fewer_bytes",
        ),
    ),
    Mutant(
        "a staging buffer is rewritten while its last copy to the device may still read it",
        "zero/offload/host.py",
        "            event.synchronize()  # its last copy may still be reading it\n",
        "",
        ("tests/test_cuda_path.py::test_a_staging_buffer_is_written_again_only_after_its_copy",),
    ),
    Mutant(
        "the offloaded write-back waits for its copy to the device",
        "zero/offload/host.py",
        "        dst.copy_(buf, non_blocking=True)",
        "        dst.copy_(buf)",
        (
            "tests/test_cuda_path.py::"
            "test_offloading_queues_its_uploads_and_waits_only_for_the_gradients",
        ),
    ),
    Mutant(
        "offloaded pieces in host memory go up for a gather in a blocking copy",
        "zero/offload/host.py",
        'src.clone() if device.type == "cpu" else src.to(device, non_blocking=True)',
        'src.clone() if device.type == "cpu" else src.to(device)',
        (
            "tests/test_cuda_path.py::"
            "test_offloading_queues_its_uploads_and_waits_only_for_the_gradients",
        ),
    ),
    Mutant(
        "offloaded pieces read from their files go up in a blocking copy",
        "zero/offload/param_swap.py",
        "                p._zs.piece = host.to(self.device, non_blocking=True)",
        "                p._zs.piece = host.to(self.device)",
        (
            "tests/test_cuda_path.py::"
            "test_offloading_queues_its_uploads_and_waits_only_for_the_gradients",
        ),
    ),
    Mutant(
        "NVMe pieces are read at their gather, not ahead of it",
        "zero/stage3/coordinator.py",
        "        if not self.param_swapper.reads_ahead or not self.order.following:",
        "        if True:",
        ("tests/test_offload.py::test_nvme_pieces_are_read_ahead_off_the_training_thread",),
    ),
    Mutant(
        "NVMe pieces are read on the training thread",
        "zero/offload/param_swap.py",
        "        self.reads_ahead = isinstance(store, NVMeStore)",
        "        self.reads_ahead = False",
        ("tests/test_offload.py::test_nvme_pieces_are_read_ahead_off_the_training_thread",),
    ),
    Mutant(
        "the reads ahead a pass did not use are kept past it",
        "zero/stage3/coordinator.py",
        "        self._inflight.clear()\n        self.param_swapper.forget_reads()\n",
        "        self._inflight.clear()\n",
        ("tests/test_offload.py::test_nvme_pieces_are_read_ahead_off_the_training_thread",),
    ),
    Mutant(
        "offloaded gradients come down on the compute stream (the compute waits for the copy)",
        "zero/offload/host.py",
        "        with torch.cuda.stream(side):\n            host.copy_(t.reshape(-1), non_block",
        "        with torch.cuda.stream(None):\n            host.copy_(t.reshape(-1), non_block",
        ("tests/test_cuda_path.py::test_offloaded_gradients_come_down_on_a_side_stream",),
    ),
    Mutant(
        "a gradient's copy down starts before the collective that made it",
        "zero/offload/host.py",
        "        side.wait_stream(torch.cuda.current_stream())\n        with torch.cuda.stream(s",
        "        with torch.cuda.stream(s",
        ("tests/test_cuda_path.py::test_offloaded_gradients_come_down_on_a_side_stream",),
    ),
    Mutant(
        "a gradient piece is freed while its copy down may still read it",
        "zero/offload/host.py",
        "        t.record_stream(side)\n",
        "",
        ("tests/test_cuda_path.py::test_offloaded_gradients_come_down_on_a_side_stream",),
    ),
    Mutant(
        "offloaded pieces go up on the compute stream (no overlap)",
        "zero/offload/param_swap.py",
        '        if self.device.type != "cuda":\n            return None\n        if self._stream',
        "        if True:\n            return None\n        if self._stream",
        ("tests/test_cuda_path.py::test_offloaded_pieces_go_up_on_a_side_stream",),
    ),
    Mutant(
        "the gathered pieces are read without waiting for the side stream",
        "zero/stage3/gather.py",
        "            torch.cuda.current_stream().wait_event(self._ready)",
        "            pass",
        ("tests/test_cuda_path.py::test_offloaded_pieces_go_up_on_a_side_stream",),
    ),
    Mutant(
        "a gathered parameter made on the side stream is freed without record_stream",
        "zero/stage3/gather.py",
        "                full.record_stream(torch.cuda.current_stream())",
        "                pass",
        ("tests/test_cuda_path.py::test_offloaded_pieces_go_up_on_a_side_stream",),
    ),
    Mutant(
        "the side stream's receive buffer is freed without record_stream",
        "zero/stage3/collectives.py",
        "        if record:\n"
        "            out.record_stream(torch.cuda.current_stream())\n"
        "        rows = out.view(world, width)",
        "        rows = out.view(world, width)",
        ("tests/test_cuda_path.py::test_offloaded_pieces_go_up_on_a_side_stream",),
    ),
    Mutant(
        "reduce_scatter false: every rank keeps rank 0's slice of the all-reduced bucket",
        "zero/flat/grads.py",
        "piece = self._sent[self._rank * n : (self._rank + 1) * n]",
        "piece = self._sent[:n]",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[dp4-all-reduce]",),
    ),
    Mutant(
        "stage 2: staged buckets held to the end of backward",
        "zero/flat/grads.py",
        "self.reducer = GradReducer(sizes, self.start_grad_sync, self.done())",
        "self.reducer = GradReducer(sizes, self.start_grad_sync, self.done(), in_flight=1 << 30)",
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
        "zero/flat/grads.py",
        "        if cut.world > 1:\n            return self._reduce(st, chunk)\n",
        "",
        ("tests/test_comm_log.py::test_stages_1_2_move_two_psi[2-1-1-None]",),
    ),
    Mutant(
        "a checkpoint of stage 1 written by dp rank 0 alone",
        "zero/flat/checkpoint.py",
        "return self.sharded or self.rank == 0",
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
        "stage 1: the boundary's reduction not waited for at the end of backward",
        "zero/flat/grads.py",
        "if self.flat.grads_sharded and self.communicates_now:",
        "if False:",
        ("tests/test_memory.py::test_live_storage_census_matches_the_zero_formulas[2]",),
    ),
    Mutant(
        "reduce_scatter false ignored: buckets reduce-scattered",
        "zero/flat/grads.py",
        "if not self.reduce_scatter:",
        "if False:",
        ("tests/test_comm_log.py::test_stages_1_2_move_two_psi[2-1-2-False]",),
    ),
    Mutant(
        "reduce_scatter true: buckets all-reduced",
        "zero/flat/grads.py",
        "if not self.reduce_scatter:",
        "if True:",
        ("tests/test_comm_log.py::test_stages_1_2_move_two_psi[2-1-2-None]",),
    ),
    Mutant(
        "stage 2: a pooled staging buffer's padding not zeroed",
        "zero/flat/grads.py",
        "staging[end - st.bucket.start :].zero_()",
        "staging[st.bucket.numel :].zero_()",
        ("tests/test_zero_models.py::test_stage2_reuses_buffers_without_their_old_values",),
    ),
    Mutant(
        "stage 2: a parameter with no gradient sends a pooled buffer's old values",
        "zero/flat/grads.py",
        "            if p not in self._ready:",
        "            if False:",
        ("tests/test_zero_models.py::test_stage2_reuses_buffers_without_their_old_values",),
    ),
    Mutant(
        "stage 2: a later micro-step overwrites the shard a bucket was reduced into",
        "zero/flat/grads.py",
        "no piece to add\n            st.shard_clean = False",
        "no piece to add",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[dp2]",),
    ),
    Mutant(
        "stage 2: the shard never again marked zero after a step (a piece every time)",
        "zero/flat/strategy.py",
        "            st.shard_clean = True",
        "            pass",
        ("tests/test_stage2_live.py::test_the_first_micro_step_reduces_into_the_shard",),
    ),
    Mutant(
        "stages 1-2 by bucket: every bucket stepped at every bucket's turn",
        "zero/flat/write_back.py",
        "            st.master.grad = None\n        handles: list[tuple] = []",
        "            pass  # every master keeps its gradient\n        handles: list[tuple] = []",
        ("tests/test_zero_models.py::test_odd_sizes_and_an_unused_parameter[2-2-AdamW]",),
    ),
    Mutant(
        "stages 1-2 by bucket: a bucket gathered before it is stepped",
        "zero/flat/write_back.py",
        "                optimizer.step()\n"
        "                st.master.grad = None\n"
        "                self._bring(st, handles)",
        "                self._bring(st, handles)\n"
        "                optimizer.step()\n"
        "                st.master.grad = None",
        ("tests/test_zero_models.py::test_odd_sizes_and_an_unused_parameter[2-2-AdamW]",),
    ),
    Mutant(
        "stages 1-2: never stepped by bucket",
        "zero/flat/write_back.py",
        "and type(optimizer) in _ELEMENTWISE",
        "and False",
        ("tests/test_stage2_live.py::test_each_bucket_is_gathered_as_soon_as_it_is_stepped",),
    ),
    Mutant(
        "stages 1-2: a client's optimizer stepped by bucket",
        "zero/flat/write_back.py",
        "and type(optimizer) in _ELEMENTWISE",
        "and isinstance(optimizer, _ELEMENTWISE)",
        ("tests/test_stage2_live.py::test_each_bucket_is_gathered_as_soon_as_it_is_stepped",),
    ),
    Mutant(
        "stage-3 default prefetch one module deep",
        "zero/stage3/coordinator.py",
        "prefetch_numel = PREFETCH_UNITS * max((_numel(ps) for ps in self.units), default=0)",
        "prefetch_numel = max((_numel(ps) for ps in self.units), default=0)",
        ("tests/test_stage3_live.py::test_gather_budget_follows_deepspeeds_keys",),
    ),
    Mutant(
        "stage-3 staging: a parameter without a gradient keeps the pool's old values",
        "zero/stage3/reduce.py",
        "            if p not in filled:  # no gradient in this backward: zeros",
        "            if False:",
        ("tests/test_stage3_edges.py::test_stage3_matches_single_process",),
    ),
    Mutant(
        "stage-3 reduce pool kept between backwards",
        "zero/stage3/reduce.py",
        "        self.buffers.trim(0)  # nothing kept between backwards",
        "        pass",
        ("tests/test_memory.py::test_live_storage_census_matches_the_zero_formulas[2]",),
    ),
    Mutant(
        "stages 1-2 with nvme: the stepped piece not what is gathered",
        "zero/flat/write_back.py",
        "src, st.updated = st.updated, None  # (nvme",
        "src, st.updated = None, None  # (nvme",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[offload-nvme]",),
    ),
    Mutant(
        "stage 3's linear runs backward outside the forward's autocast (bf16 grad x fp32 weight)",
        "zero/stage3/linear.py",
        "        with autocast_as(ctx.autocast):\n"
        "            return _LinearSavingWeight._backward(",
        "        if True:\n            return _LinearSavingWeight._backward(",
        ("tests/test_autocast.py::test_autocast_trains_at_every_stage_as_at_stage_0[3]",),
    ),
    Mutant(
        "the write-back's staging buffers are pageable",
        "zero/offload/host.py",
        "            buf = host_empty(dst.shape, dst.dtype, self.pin)",
        "            buf = torch.empty(dst.shape, dtype=dst.dtype)",
        (
            "tests/test_cuda_path.py::"
            "test_offloading_queues_its_uploads_and_waits_only_for_the_gradients",
        ),
    ),
    Mutant(
        "stage 2's offloaded pieces come down in a blocking copy inside backward again",
        "zero/flat/grads.py",
        "                self.downloads.fetch(st.piece, shard.add_)",
        "                shard.add_(st.piece.to(shard.device))",
        (
            "tests/test_cuda_path.py::"
            "test_offloading_queues_its_uploads_and_waits_only_for_the_gradients",
        ),
    ),
    Mutant(
        "a mid-window gradient read misses the pieces still coming down",
        "zero/flat/grads.py",
        "        self.downloads.settle()\n        lo, hi",
        "        pass\n        lo, hi",
        ("tests/test_cuda_path.py::test_a_mid_window_gradient_read_sees_the_pending_downloads[2]",),
    ),
    Mutant(
        "the step reads the offloaded shard before the last pieces are added",
        "zero/flat/strategy.py",
        "        self.downloads.settle()\n        on_device = ",
        "        on_device = ",
        (
            "tests/test_cuda_path.py::test_the_cuda_path_runs_and_matches_the_cpu_run"
            "[stage2-offload]",
        ),
    ),
    Mutant(
        "stage 3's offloaded rows come down in a blocking copy inside backward again",
        "zero/stage3/reduce.py",
        "        self.downloads.fetch(out, lambda host: self._hand(b, host, final))",
        "        self._hand(b, out.to(self.to), final)",
        (
            "tests/test_cuda_path.py::"
            "test_offloading_queues_its_uploads_and_waits_only_for_the_gradients",
        ),
    ),
    Mutant(
        "stage 3's step reads the offloaded gradients before the last rows are added",
        "zero/stage3/strategy.py",
        "        self.downloads.settle()\n        self.grads.hand_to(self.groups)",
        "        self.grads.hand_to(self.groups)",
        (
            "tests/test_cuda_path.py::test_the_cuda_path_runs_and_matches_the_cpu_run"
            "[stage3-offload-param-cpu]",
        ),
    ),
    Mutant(
        "a stage-3 mid-window gradient read misses the rows still coming down",
        "zero/stage3/one_param.py",
        "        self.downloads.settle()\n        piece = self.grads.piece(p)",
        "        piece = self.grads.piece(p)",
        ("tests/test_cuda_path.py::test_a_mid_window_gradient_read_sees_the_pending_downloads[3]",),
    ),
    Mutant(
        "stage 3's norm takes a kernel per parameter again",
        "zero/offload/masters.py",
        "        return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square()",
        "        return torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in "
        "grads]).square()",
        (
            "tests/test_stage3.py::"
            "test_the_norm_takes_one_multi_tensor_kernel_not_three_per_parameter",
        ),
    ),
    Mutant(
        "MoE: what every ep rank holds is cut and reduced over dp only (held twice, not summed)",
        "zero/flat/params.py",
        '            ("dp_ep", [p for p in params if p in shared]),',
        '            ("dp", [p for p in params if p in shared]),',
        (
            "tests/test_moe.py::test_expert_parallel_gpt_matches_single_process[ep2-top2-stage2]",
            "tests/test_moe.py::test_no_rank_holds_the_shared_state_twice_at_ep_2",
        ),
    ),
    Mutant(
        "MoE: the shared gradients' sum over dp x ep is not divided by ep",
        "zero/flat/params.py",
        "return Cut(axis, size, rank, size if sharded else 1, base * topo.dp / size)",
        "return Cut(axis, size, rank, size if sharded else 1, base)",
        (
            "tests/test_moe.py::test_expert_parallel_gpt_matches_single_process"
            "[dp2xep2-top1-drops-stage1]",
        ),
    ),
    Mutant(
        "MoE: a bucket reduce-scattered over dp, not over its own cut's axis",
        "zero/flat/grads.py",
        "axis=cut.axis, async_op=True, pool=self.pool)",
        'axis="dp", async_op=True, pool=self.pool)',
        (
            "tests/test_moe.py::"
            "test_shared_gradients_are_reduced_over_dp_and_ep_at_once_in_buckets[1]",
        ),
    ),
    Mutant(
        "stage 1's offloaded boundary copies each wait for the whole stream again",
        "zero/flat/strategy.py",
        "                grad = st.host_grad.copy_(grad, non_blocking=down)",
        "                grad = st.host_grad.copy_(grad)",
        (
            "tests/test_cuda_path.py::"
            "test_offloading_queues_its_uploads_and_waits_only_for_the_gradients",
        ),
    ),
    Mutant(
        "stage 1's host optimizer steps on gradients still coming down",
        "zero/flat/strategy.py",
        "            copied.synchronize()",
        "            pass",
        (
            "tests/test_cuda_path.py::test_the_cuda_path_runs_and_matches_the_cpu_run"
            "[stage1-offload-pinned]",
        ),
    ),
    Mutant(
        "a stage-3 piece's extent runs past the end of a parameter it barely covers",
        "zero/partition.py",
        "    lo = min(rank * width, numel)\n    return lo, min(lo + width, numel)",
        "    lo = min(rank * width, numel)\n    return lo, lo + width",
        ("tests/test_partition.py::test_a_pieces_extent_stops_at_the_end_of_the_parameter",),
    ),
    Mutant(
        "the pool keeps a step's bucket buffers between steps (not trimmed)",
        "zero/flat/strategy.py",
        "        self.flat.pool.trim(self.flat.rest_bytes)",
        "        pass",
        ("tests/test_memory.py::test_live_storage_census_matches_the_zero_formulas[2]",),
    ),
    Mutant(
        "memory_breakdown leaves out the buffers the pool keeps",
        "zero/flat/checkpoint.py",
        "        scratch = list(self.flat.pool.kept())",
        "        scratch = []",
        ("tests/test_memory.py::test_live_storage_census_matches_the_zero_formulas[2]",),
    ),
    Mutant(
        "stage 3's gather hooks are traced into the compiled graphs",
        "zero/stage3/module_hooks.py",
        "    return torch.compiler.disable(fn, recursive=True)",
        "    return fn",
        ("tests/test_compile.py::test_compiled_blocks_train_as_eager_bit_for_bit[3-fp32]",),
    ),
    Mutant(
        "stage 3's linear is traced under compile (its backward reads the weight as saved)",
        "zero/stage3/module_hooks.py",
        "@eager  # its backward reads the weight parameter as it is then",
        "# its backward reads the weight parameter as it is then",
        (
            "tests/test_compile.py::"
            "test_compiled_parallel_checkpointed_and_llama_blocks_train_as_eager[ckpt-3]",
        ),
    ),
    Mutant(
        "putting the hooks back leaves a borrowed parameter's read ungathered",
        "zero/stage3/module_hooks.py",
        "            m._parameters = _GatherOnRead(m._parameters, c)\n",
        "            m._parameters = dict(m._parameters)\n",
        ("tests/test_trl.py::test_hooks_taken_off_and_put_back_with_trls_functions",),
    ),
    Mutant(
        "taking the hooks off keeps stage 3's linear on the plain module",
        "zero/stage3/module_hooks.py",
        "_linear_forward:\n                    del m.forward",
        "_linear_forward:\n                    pass",
        ("tests/test_trl.py::test_hooks_taken_off_and_put_back_with_trls_functions",),
    ),
    Mutant(
        "the coordinator's trace cannot be invalidated",
        "zero/stage3/coordinator.py",
        "        self.order = RecordedOrder()\n\n    def grad_arrived",
        "        pass\n\n    def grad_arrived",
        ("tests/test_trl.py::test_hooks_taken_off_and_put_back_with_trls_functions",),
    ),
    Mutant(
        "clearing ds_active_sub_modules also drops GatheredParameters' hold",
        "zero/stage3/params.py",
        "        self._state.active -= self._state.by_modules\n",
        "        self._state.active = 0\n",
        ("tests/test_trl.py::test_clearing_a_parameters_active_modules_leaves_other_holders",),
    ),
    Mutant(
        "stage 3 ignores the leaf flag: experts gathered one by one (ranks routed differently)",
        "zero/stage3/coordinator.py",
        "from .leaves import z3_leaf_module\n",
        "def z3_leaf_module(m):\n    return False\n\n\n",
        (
            "tests/test_leaf_modules.py::"
            "test_a_leaf_moe_block_is_one_gather_and_trains_as_one_process[call]",
        ),
    ),
    Mutant(
        "a leaf's unit holds only its own parameters, not its descendants'",
        "zero/stage3/coordinator.py",
        "            ps = list(dict.fromkeys(m.parameters()))\n",
        "            ps = ps\n",
        (
            "tests/test_leaf_modules.py::"
            "test_a_leaf_moe_block_is_one_gather_and_trains_as_one_process[call]",
        ),
    ),
    Mutant(
        "a leaf class given by its short name matches nothing",
        "zero/stage3/leaves.py",
        '    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")',
        '    return wanted == f"{cls.__module__}.{cls.__qualname__}"',
        ("tests/test_leaf_modules.py::test_the_leaf_flags",),
    ),
    Mutant(
        "register_external_parameter before initialize records nothing",
        "zero/stage3/module_hooks.py",
        '    module.__dict__.setdefault("_zs_external", {})[id(parameter)] = parameter',
        "    pass",
        (
            "tests/test_leaf_modules.py::"
            "test_a_registered_external_parameter_is_gathered_with_its_user[before]",
        ),
    ),
    Mutant(
        "register_external_parameter after initialize leaves the unit as it was",
        "zero/stage3/module_hooks.py",
        "        coordinator.adopt(units[0], parameter)",
        "        pass",
        (
            "tests/test_leaf_modules.py::"
            "test_a_registered_external_parameter_is_gathered_with_its_user[after]",
        ),
    ),
    Mutant(
        "reload_states gives the storage back its size but not its bytes",
        "zero/offload/states.py",
        "                whole.copy_(parked.host, non_blocking=non_blocking)\n",
        "                pass\n",
        (
            "tests/test_offload_states.py::"
            "test_offloaded_states_leave_the_device_and_training_continues_bit_for_bit",
        ),
    ),
    Mutant(
        "offload_states leaves the optimizer's moments on the device",
        "zero/offload/states.py",
        "                    yield StateKind.optim_states, t",
        "                    pass",
        (
            "tests/test_offload_states.py::"
            "test_offloaded_states_leave_the_device_and_training_continues_bit_for_bit",
        ),
    ),
    Mutant(
        "the forward guard is not taken off at reload_states",
        "zero/offload/states.py",
        "            self._guard.remove()\n",
        "            pass\n",
        (
            "tests/test_offload_states.py::"
            "test_offloaded_states_leave_the_device_and_training_continues_bit_for_bit",
        ),
    ),
    Mutant(
        "a storage shared with a kind left out moves anyway",
        "zero/offload/states.py",
        "            if not kinds <= include:",
        "            if not kinds & include:",
        (
            "tests/test_offload_states.py::"
            "test_a_storage_moves_only_when_every_kind_on_it_is_asked_for",
        ),
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
        "zero/flat/grads.py",
        "        end = max((rng.stop for _, rng in st.ranges), default=st.bucket.start)",
        "        end = max(rng.stop for _, rng in st.ranges)",
        ("tests/test_frozen.py::test_an_empty_optimizer_group_trains_as_one_process",),
    ),
    Mutant(
        "an optimizer group's parameters in another order",
        "zero/flat/buffers.py",
        "return [[p for g in flats for p in self.groups[g].params] for flats in self.of_group]",
        "return [[p for g in flats for p in self.groups[g].params][::-1] for flats in "
        "self.of_group]",
        (
            "tests/test_deepspeed_write.py::"
            "test_a_deepspeed_folder_saved_again_is_deepspeeds_bit_for_bit[zero1]",
        ),
    ),
    Mutant(
        "stage 3's optimizer groups' parameters in another order",
        "zero/stage3/checkpoint.py",
        "            out[g.index].extend(g.params)",
        "            out[g.index].extend(g.params[::-1])",
        (
            "tests/test_deepspeed_write.py::"
            "test_a_deepspeed_folder_saved_again_is_deepspeeds_bit_for_bit[zero3]",
        ),
    ),
    Mutant(
        "a stage-3 parameter's ds_tensor left on its first piece",
        "zero/stage3/params.py",
        "                p.ds_tensor = self.stored  # DeepSpeed's name for this rank's partition",
        "                pass",
        (
            "tests/test_engine_surface.py::"
            "test_deepspeed_optimizer_backward_throughput_timer_and_ds_tensor",
        ),
    ),
    Mutant(
        "aio: file_offset dropped from the parts",
        "zero/offload/aio.py",
        "part, offset + i * per, req.path)",
        "part, i * per, req.path)",
        ("tests/test_aio.py::test_offsets_place_and_find_each_tensor",),
    ),
    Mutant(
        "aio: wait counts one request",
        "zero/offload/aio.py",
        "return len(pending)",
        "return 1",
        ("tests/test_aio.py::test_several_requests_in_flight_then_one_wait",),
    ),
    Mutant(
        "aio: short-read check ignores the offset",
        "zero/offload/aio.py",
        "if offset + nbytes > size:",
        "if nbytes > size:",
        ("tests/test_aio.py::test_a_short_file_is_refused_naming_it",),
    ),
    Mutant(
        "frozen pieces held as int8 blocks gathered dequantized, at full width",
        "zero/stage3/collectives.py",
        "    if keys[0][1]:  # frozen pieces held",
        "    if False:  # frozen pieces held",
        (
            "tests/test_quantized_frozen.py::"
            "test_frozen_pieces_are_int8_blocks_and_training_is_the_quantized_models[0]",
        ),
    ),
    Mutant(
        "a value a quantized piece already holds quantized again (a reload drifts)",
        "zero/stage3/frozen_pieces.py",
        "            return  # the value these blocks hold: kept as they are",
        "            pass  # the value these blocks hold: kept as they are",
        (
            "tests/test_quantized_frozen.py::"
            "test_writing_back_the_value_a_piece_holds_keeps_its_blocks",
        ),
    ),
    Mutant(
        "frozen pieces not quantized at initialize",
        "zero/stage3/strategy.py",
        "        quantize_at_start(quantized_frozen, everything, self._trainable, "
        "self.param_swapper)",
        "        pass",
        (
            "tests/test_quantized_frozen.py::"
            "test_frozen_pieces_are_int8_blocks_and_training_is_the_quantized_models[0]",
        ),
    ),
    Mutant(
        "a write into a quantized piece lands in a dequantized copy",
        "zero/stage3/frozen_pieces.py",
        "        self.piece = value.to(self.dtype)",
        "        self.piece.copy_(value)",
        (
            "tests/test_quantized_frozen.py::"
            "test_frozen_pieces_are_int8_blocks_and_training_is_the_quantized_models[0]",
        ),
    ),
    Mutant(
        "ds_grad_is_ready ignored: a tiled backward's gradient taken at every tile",
        "zero/reducer.py",
        "        if p.ds_grad_is_ready:",
        "        if True:",
        ("tests/test_grad_is_ready.py::test_a_tiled_backward_is_taken_once_per_parameter[2]",),
    ),
    Mutant(
        "stages 0-2: the parameter index sends every gradient to the first bucket",
        "zero/flat/buffers.py",
        "self._index.update({p: (len(self.buckets), rng) for p, rng in st.ranges})",
        "self._index.update({p: (0, rng) for p, rng in st.ranges})",
        ("tests/test_zero_models.py::test_odd_sizes_and_an_unused_parameter[2-2-AdamW]",),
    ),
    Mutant(
        "the offload set-up does not pin host memory when pin_memory asks for it",
        "zero/offload/host.py",
        "    pin = bool(offload is not None and offload.pin_memory)",
        "    pin = False",
        (
            "tests/test_cuda_path.py::"
            "test_offloading_queues_its_uploads_and_waits_only_for_the_gradients",
        ),
    ),
    Mutant(
        "stage 3: trained persistent parameters not gathered again after the step",
        "zero/stage3/write_back.py",
        "        self.refresh(self.stepped)",
        "        pass",
        ("tests/test_data_parallel.py::test_stage3_with_small_parameters_kept_whole",),
    ),
    Mutant(
        "stage 3: frozen persistent parameters not gathered again after a load",
        "zero/stage3/checkpoint.py",
        "        self.writer.refresh(self.writer.frozen)",
        "        pass",
        ("tests/test_frozen.py::test_frozen_parameters_save_load_and_consolidate_at_every_stage",),
    ),
    Mutant(
        "stage 3: safe_set_full_fp32_param leaves a persistent parameter's whole copy stale",
        "zero/stage3/one_param.py",
        "            p.data.copy_(value.view_as(p))",
        "            pass",
        ("tests/test_engine_surface.py::test_full_values_match_single_process[s3]",),
    ),
    Mutant(
        "stage 3: a local gradient's padding, left as the caller gave it, counts as gradient",
        "zero/stage3/one_param.py",
        "        piece[hi - lo :] = 0.0  # the padding is no part of the gradient\n",
        "",
        ("tests/test_engine_surface.py::test_the_padding_of_a_local_gradient_is_no_part_of_it",),
    ),
    Mutant(
        "stage 3: fp32 masters that are the pieces counted as separate masters too",
        "zero/stage3/groups.py",
        "        return self.pieces is None or not same_storage(self.pieces, self.master)",
        "        return True",
        ("tests/test_memory.py::test_bytes_per_rank_match_the_zero_formulas[2-3-fp32]",),
    ),
    Mutant(
        "stage 3: bf16 masters never written back into the pieces",
        "zero/stage3/groups.py",
        "        return self.pieces is None or not same_storage(self.pieces, self.master)",
        "        return False",
        ("tests/test_memory.py::test_bytes_per_rank_match_the_zero_formulas[2-3-bf16]",),
    ),
    Mutant(
        "Muon under ZeRO: a matrix put together from the first rank's rows alone",
        "zero/whole_params.py",
        "whole = torch.cat([rows[r, lo:hi] for r, lo, hi in mat.runs]).view(mat.shape)",
        "whole = torch.cat([rows[0, lo:hi] for r, lo, hi in mat.runs]).view(mat.shape)",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[muon-dp2]",),
    ),
    Mutant(
        "Muon at stages 0-2: a parameter's runs placed as if it began its bucket",
        "zero/flat/strategy.py",
        "(w, max(rng.start, lo) - lo, min(rng.stop, hi) - lo)",
        "(w, lo - lo, min(rng.stop, hi) - max(rng.start, lo))",
        ("tests/test_muon.py::test_matrices_cut_mid_row_into_padded_pieces_match_one_process[2]",),
    ),
    Mutant(
        "Muon at stage 3: a parameter's pieces placed end to end without their padding",
        "zero/stage3/strategy.py",
        "                at += st.piece.numel()\n",
        "                at += hi - lo\n",
        ("tests/test_muon.py::test_matrices_cut_mid_row_into_padded_pieces_match_one_process[3]",),
    ),
    Mutant(
        "Muon under tp: each tp slice orthogonalised alone (as DeepSpeed does)",
        "zero/whole_params.py",
        "spec = self._split(p) if self.comm.topo.tp > 1 else None",
        "spec = None",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[muon-tp2xdp2]",),
    ),
    Mutant(
        "LAMB under ZeRO: a parameter's squares not summed over its pieces' ranks",
        "zero/whole_params.py",
        "            self.comm.all_reduce(sums, axis=m.axis)\n",
        "            pass\n",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[lamb-dp2]",),
    ),
    Mutant(
        "LAMB under tp: a split parameter's squares not summed over its tp slices",
        "zero/whole_params.py",
        '            self.comm.all_reduce(cut, axis="tp")\n',
        "            pass\n",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[lamb-tp2xdp2]",),
    ),
    Mutant(
        "stages 1-2: full_master all-gathers 16-bit pieces into an fp32 buffer (garbage)",
        "zero/flat/checkpoint.py",
        "master = self.master_value(st.master).to(full.device, torch.float32)",
        "master = self.master_value(st.master).to(full.device)",
        (
            "tests/test_sixteen_bit_masters.py::test_at_dp2_the_pieces_step_as_one_process_within_bf16s_rounding",
        ),
    ),
]
