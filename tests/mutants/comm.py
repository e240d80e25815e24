"""The mutants of src/zerostack/comm/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "comm reaches up into the engine from inside a function (an import cycle)",
        "comm/summary.py",
        "        print_progress(line)\n",
        "        from ..engine import Engine  # noqa: F401\n\n        print_progress(line)\n",
        (
            "tests/test_architecture.py::"
            "test_no_import_cycle_even_through_imports_inside_functions",
            "tests/test_architecture.py::test_the_layers_contract_is_kept",
        ),
    ),
    Mutant(
        "Megatron's f: the gradient of a tp region's input is not summed over tp",
        "comm/functional.py",
        "        return _all_reduce(grad, ctx.axis), None",
        "        return grad, None",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[tp2]",),
    ),
    Mutant(
        "sequence parallelism: partial gradients of a gathered input split, not summed",
        "comm/functional.py",
        "        if ctx.grad_is_partial:",
        "        if False:",
        ("tests/test_tp_layers.py::test_layers_match_unsplit_torch_layers[2]",),
    ),
    Mutant(
        "watchdog: an async collective stays in flight after its wait",
        "comm/grid.py",
        "        self._log.end(self._record, _behind() if self._on_device else None)",
        "        pass",
        ("tests/test_watchdog.py::test_a_frozen_rank_ends_the_job_within_the_bound",),
    ),
    Mutant(
        "watchdog: a failed collective does not say why the job is ending",
        "comm/records.py",
        "verdict = self.explain() if self.explain is not None else None",
        "verdict = None",
        ("tests/test_watchdog.py::test_a_failed_collective_carries_the_posted_verdict",),
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
        "Ulysses all-to-all joins the shards in reverse rank order",
        "comm/functional.py",
        "return torch.cat(received.unbind(0), dim=gather)",
        "return torch.cat(received.unbind(0)[::-1], dim=gather)",
        (
            "tests/test_ulysses.py::"
            "test_all_to_all_trades_sequence_shards_for_head_shards_and_back[2]",
        ),
    ),
    Mutant(
        "Ulysses all-to-all backward repeats the forward exchange",
        "comm/functional.py",
        "_all_to_all(grad.contiguous(), gather, scatter, axis)",
        "_all_to_all(grad.contiguous(), scatter, gather, axis)",
        (
            "tests/test_ulysses.py::"
            "test_distributed_attention_is_attention_over_the_whole_sequence[2-False]",
        ),
    ),
    Mutant(
        "the ep ranks' tokens never reach the other ranks' experts",
        "comm/functional.py",
        "        axis.all_to_all(out, x)\n        return out",
        "        out.copy_(x)\n        return out",
        (
            "tests/test_moe.py::test_expert_parallel_gpt_matches_single_process"
            "[ep2-top1-drops-stage0]",
        ),
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
        "gloo reduce-scatter: the first two ranks' rows only",
        "comm/gloo.py",
        "for r in range(2, rows.shape[0]):",
        "for r in range(3, rows.shape[0]):",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[dp4]",),
    ),
    Mutant(
        "gloo reduce-scatter: this rank's row not summed with the others",
        "comm/gloo.py",
        "torch.add(rows[0], rows[1], out=self._out.view(-1))",
        "self._out.view(-1).copy_(rows[0])",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[dp2]",),
    ),
    Mutant(
        "gloo reduce-scatter: the received rows not handed back to the pool",
        "comm/gloo.py",
        "self._pool.give(self._rows)",
        "pass",
        ("tests/test_memory.py::test_live_storage_census_matches_the_zero_formulas[2]",),
    ),
    Mutant(
        "gloo all-gather: this rank's own row not written",
        "comm/gloo.py",
        "            rows[rank].copy_(src)",
        "            pass",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[dp2]",),
    ),
    Mutant(
        "gloo all-gather: each peer's row received into the next one's",
        "comm/gloo.py",
        "recvs.append(dist.P2POp(dist.irecv, rows[r], peer, group))",
        "recvs.append(dist.P2POp(dist.irecv, rows[(r + 1) % world if (r + 1) % world != rank else "
        "r], peer, group))",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[dp4]",),
    ),
    Mutant(
        "gloo all-gather of several pairs: only the first pair moved",
        "comm/gloo.py",
        "for output, input in zip(outputs, inputs, strict=True):",
        "for output, input in list(zip(outputs, inputs, strict=True))[:1]:",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[dp2]",),
    ),
    Mutant(
        "NCCL: a collective leaves the log when wait() returns (a hang on the device is unseen)",
        "comm/records.py",
        "        if event is not None and running(event):\n            rec.event = event",
        "        if False:\n            rec.event = event",
        (
            "tests/test_watchdog.py::test_a_collective_the_device_never_completes_is_named",
            "tests/test_cuda_path.py::"
            "test_a_collective_stays_in_flight_until_the_device_has_run_it",
        ),
    ),
    Mutant(
        "a collective the device completed stays in flight (a false watchdog verdict)",
        "comm/records.py",
        "                self._close(self._on_device.popleft())",
        "                return",
        (
            "tests/test_watchdog.py::test_a_collective_the_device_never_completes_is_named",
            "tests/test_cuda_path.py::"
            "test_a_collective_stays_in_flight_until_the_device_has_run_it",
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
        "the tensor-parallel collectives are traced under compile",
        "comm/functional.py",
        "_apply = torch.compiler.disable(_run, recursive=True)",
        "_apply = _run",
        (
            "tests/test_compile.py::"
            "test_compiled_parallel_checkpointed_and_llama_blocks_train_as_eager[tp2-1]",
        ),
    ),
    Mutant(
        "comm: a dry run's point-to-point ops batched as a real run's (meta has no backend)",
        "comm/grid.py",
        "            if all(t.is_meta for _, t, _ in ops):",
        "            if False:",
        ("tests/test_dryrun.py::test_a_pipeline_at_1024_ranks_holds_and_sends_what_the_planner_says",),
    ),
    Mutant(
        "comm exchange: counts that do not add up to the rows posted anyway",
        "comm/functional.py",
        "    if len(send) != axis.size or len(receive) != axis.size or sum(send) != x.shape[0]:",
        "    if len(send) != axis.size or len(receive) != axis.size:",
        ("tests/test_moe_hf_experts.py::test_an_exchange_whose_counts_do_not_add_up_is_named",),
    ),
]
