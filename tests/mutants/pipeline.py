"""The mutants of src/zerostack/pipeline/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "stage 2 under a pipeline: the tied weight's gradient is not summed between the stages",
        "pipeline/runner.py",
        "(a gather over dp)\n"
        '                    self.comm.all_reduce(grad, axis="tied", group=tie.group)\n',
        "(a gather over dp)\n",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[pp2xdp2]",),
    ),
    Mutant(
        "a pipeline stage before the last drops its MoE blocks' auxiliary loss",
        "pipeline/executor.py",
        "        elif side is None:\n            torch.autograd.backward(out,",
        "        elif True:\n            torch.autograd.backward(out,",
        (
            "tests/test_moe.py::test_expert_parallel_gpt_under_a_pipeline_matches_single_process"
            "[1f1b-1]",
        ),
    ),
    Mutant(
        "the last pipeline stage drops its MoE blocks' auxiliary loss",
        "pipeline/executor.py",
        "            loss = out.float() if side is None else out.float() + side.float()",
        "            loss = out.float()",
        (
            "tests/test_moe.py::test_expert_parallel_gpt_under_a_pipeline_matches_single_process"
            "[interleaved-3]",
        ),
    ),
    Mutant(
        "ZeRO-3 under a pipeline: the tied weight's pieces are not summed between the stages",
        "pipeline/runner.py",
        '                    self.comm.all_reduce(piece, axis="tied", group=tie.group)',
        "                    pass",
        ("tests/test_pipeline.py::test_gpt_pipeline_under_zero3_matches_single_process[1f1b]",),
    ),
    Mutant(
        "ZeRO-3 under a pipeline: a backward's gradients are not reduced as it ends",
        "pipeline/runner.py",
        "            around = (zero.begin_backward, zero.end_backward)",
        "            zero.begin_backward(False)",
        ("tests/test_pipeline.py::test_gpt_pipeline_under_zero3_matches_single_process[1f1b]",),
    ),
    Mutant(
        "the pipeline executor calls a chunk past its module's hooks (ZeRO-3 cannot gather)",
        "pipeline/executor.py",
        "        out = self.module(x, chunk)\n        side = ",
        "        out = self.module.forward_chunk(chunk, x)\n        side = ",
        ("tests/test_pipeline.py::test_gpt_pipeline_under_zero3_matches_single_process[1f1b]",),
    ),
    Mutant(
        "ZeRO-3 under a pipeline: no backward is its chunk's last (NVMe gradients lose their norm)",
        "pipeline/executor.py",
        "            self.around_backward[0](self.last_backward[chunk] == (mb, chunk))",
        "            self.around_backward[0](False)",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[pp2xdp2-offload-nvme]",),
    ),
    Mutant(
        "pipeline loss not divided by the number of micro-batches",
        "pipeline/executor.py",
        "loss_scale / micro_batches, on_tied",
        "loss_scale, on_tied",
        (
            "tests/test_pipeline_schedule.py::"
            "test_the_executor_runs_exactly_what_the_simulator_accepts[2]",
        ),
    ),
    Mutant(
        "pipeline shape probe reads micro-batch 0 twice",
        "pipeline/executor.py",
        "if mb in self.batches:  # read ahead by learn_shapes",
        "if False:  # read ahead by learn_shapes",
        (
            "tests/test_pipeline_schedule.py::"
            "test_the_executor_runs_exactly_what_the_simulator_accepts[2]",
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
        "shutdown: a pipeline's tied-weight groups are kept",
        "pipeline/module.py",
        "        hold_groups(self)  # the ties' groups",
        "        pass  # the ties' groups",
        ("tests/test_topology.py::test_shutdown_ends_the_gloo_threads_while_the_engine_lives",),
    ),
    Mutant(
        "grad_accum_dtype under a pipeline: tied copies summed in .grad, not the fp32 buffer",
        "pipeline/runner.py",
        "grad = zero.accumulated_grad(p)",
        "grad = p.grad",
        ("tests/test_comm_dtype.py::test_training_matches_mixed_precision_reference",),
    ),
    Mutant(
        "pipeline: the first stage's input is not cast with auto_cast",
        "pipeline/executor.py",
        "return cast_inputs(x, self.auto_cast)",
        "return x",
        (
            "tests/test_input_cast.py::"
            "test_pipeline_casts_the_first_stage_input_with_auto_cast_and_never_the_labels",
        ),
    ),
    Mutant(
        "cuda: pipeline shape header in host memory",
        "pipeline/executor.py",
        "return torch.tensor(h, dtype=torch.int64, device=t.device)",
        "return torch.tensor(h, dtype=torch.int64)",
        (
            "tests/test_cuda_path.py::test_the_cuda_path_runs_and_matches_the_cpu_run"
            "[pipeline-1f1b]",
        ),
    ),
    Mutant(
        "cuda: tied weights broadcast from host memory",
        "pipeline/module.py",
        "data = p.data.to(self.topology.device)",
        "data = p.data",
        (
            "tests/test_cuda_path.py::test_the_cuda_path_runs_and_matches_the_cpu_run"
            "[pipeline-1f1b]",
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
        "every engine is a PipelineEngine",
        "pipeline/runner.py",
        'return isinstance(obj, Engine) and getattr(obj.runner, "pipelined", False)',
        "return isinstance(obj, Engine)",
        ("tests/test_pipeline.py::test_only_an_engine_with_a_pipeline_is_a_pipeline_engine",),
    ),
    Mutant(
        "reset_activation_shape forgets the shapes but the stages do not learn them again",
        "pipeline/executor.py",
        'run."""\n        self._shapes_known = self.p == 1',
        'run."""',
        ("tests/test_pipeline.py::test_reset_activation_shape_lets_the_next_batch_change_shape",),
    ),
    Mutant(
        "pipeline: a dry run's shapes learnt in the layers' own dtype, not the engine's",
        "pipeline/module.py",
        "        return spec.build().to(dtype) if isinstance(spec, LayerSpec) else spec",
        "        return spec.build() if isinstance(spec, LayerSpec) else spec",
        ("tests/test_dryrun.py::test_a_pipeline_at_1024_ranks_holds_and_sends_what_the_planner_says",),
    ),
    Mutant(
        "pipeline: a dry run's own chunks' collectives left out as it learns the shapes",
        "pipeline/executor.py",
        "                    self.comm.log = log if vs % self.p == self.stage else others",
        "                    self.comm.log = others",
        ("tests/test_dryrun.py::test_a_pipeline_at_1024_ranks_holds_and_sends_what_the_planner_says",),
    ),
    Mutant(
        "pipeline: a dry run's received shape kept for the sending chunk",
        "pipeline/executor.py",
        "                        self._meta_in[(vs + 1) // self.p] = (x.shape, x.dtype)",
        "                        self._meta_in[vs // self.p] = (x.shape, x.dtype)",
        ("tests/test_dryrun.py::test_a_pipeline_at_1024_ranks_holds_and_sends_what_the_planner_says",),
    ),
]
