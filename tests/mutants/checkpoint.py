"""The mutants of src/zerostack/checkpoint/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "a load leaves the optimizer's step count where the fresh engine had it",
        "checkpoint/restore.py",
        '            if saved_g["step"] is not None:',
        '            if False and saved_g["step"] is not None:',
        ("tests/test_optimizer_types.py::test_a_checkpoint_resumes_exactly[adagrad-1]",),
    ),
    Mutant(
        "zero_to_fp32 leaves out the tied weight's second name",
        "checkpoint/consolidate.py",
        "        if name in out:\n            out[alias] = out[name]",
        "        pass",
        ("tests/test_deepspeed_name.py::test_zero_to_fp32_gives_the_engines_weights",),
    ),
    Mutant(
        "zero_to_fp32 keeps frozen parameters when asked to leave them out",
        "checkpoint/consolidate.py",
        'skip = set(manifest.get("frozen", [])) if exclude_frozen else set()',
        "skip = set()",
        ("tests/test_deepspeed_name.py::test_zero_to_fp32_gives_the_engines_weights",),
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
        "frozen parameters written in cuts other than stage 3's pieces",
        "checkpoint/shard.py",
        "        c = piece_numel(math.prod(full_shape_of(p, 1)), dp)",
        "        c = max(1, -(-math.prod(full_shape_of(p, 1)) // dp))",
        ("tests/test_frozen.py",),
    ),
    Mutant(
        "RNG state not restored on load",
        "checkpoint/restore.py",
        'torch.set_rng_state(reader.get(mine, "rng/cpu"))',
        'reader.get(mine, "rng/cpu")',
        ("tests/test_checkpoint.py::test_exact_resume_whole",),
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
        "save_16bit_model writes safetensors under a .bin name",
        "checkpoint/model_files.py",
        'if save_filename.endswith(".safetensors"):',
        "if True:",
        ("tests/test_hf.py::test_16bit_model_files_load_in_torch_and_transformers[1]",),
    ),
    Mutant(
        "streaming save skips the last sub-group",
        "checkpoint/shard.py",
        "    for m, cuts in shard.owned.items():\n        values = zero.read_master(m, opt)",
        "    for m, cuts in list(shard.owned.items())[:-1]:\n"
        "        values = zero.read_master(m, opt)",
        (
            "tests/test_offload_checkpoint.py::"
            "test_exact_resume_in_fresh_processes_and_without_offload",
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
        "a failed checkpoint write is not shared with the other ranks",
        "checkpoint/state.py",
        "    errors = _gather_errors(run.comm, error)\n    if not errors:\n        return\n",
        "    errors = [(run.global_rank, error)] if error else []\n"
        "    if not errors:\n"
        "        return\n",
        ("tests/test_disk_faults.py::test_a_failed_checkpoint_write_fails_every_rank",),
    ),
    Mutant(
        "cuda: checkpoints leave the device generator out",
        "checkpoint/shard.py",
        'if run.device.type == "cuda":  # the device\'s generator draws its dropout masks',
        "if False:",
        ("tests/test_cuda_path.py::test_with_dropout_on_the_device_generator[resume-dropout]",),
    ),
    Mutant(
        "cuda: resumed fused Adam gets a host step",
        "checkpoint/restore.py",
        "device=master.device if on_device else",
        "device=None if on_device else",
        (
            "tests/test_cuda_path.py::test_the_cuda_path_runs_and_matches_the_cpu_run"
            "[stage2-resume]",
        ),
    ),
    Mutant(
        "loss spike rollback rewinds the data with the weights",
        "checkpoint/loss_spike.py",
        "            vars(sampler).update(position)\n",
        "            pass\n",
        (
            "tests/test_loss_spike.py::"
            "test_a_spike_rolls_back_to_the_last_good_checkpoint_and_skips_it",
        ),
    ),
    Mutant(
        "loss spike rollback starts the engine loader over",
        "checkpoint/loss_spike.py",
        "        run.state.data_iter = data_iter\n",
        "",
        (
            "tests/test_loss_spike.py::"
            "test_a_spike_rolls_back_to_the_last_good_checkpoint_and_skips_it",
        ),
    ),
    Mutant(
        "loss spike does not hold the automatic save back",
        "checkpoint/loss_spike.py",
        "report.hold_save = report.hold_save or not self._judge(report)",
        "report.hold_save = report.hold_save or not (self._judge(report) or True)",
        (
            "tests/test_loss_spike.py::"
            "test_a_spike_rolls_back_to_the_last_good_checkpoint_and_skips_it",
        ),
    ),
    Mutant(
        "loss spike patience ignored",
        "checkpoint/loss_spike.py",
        "if self.suspects >= self.cfg.patience:",
        "if self.suspects >= 1:",
        (
            "tests/test_loss_spike.py::"
            "test_a_spike_rolls_back_to_the_last_good_checkpoint_and_skips_it",
        ),
    ),
    Mutant(
        "loss spike max_rollbacks off by one",
        "checkpoint/loss_spike.py",
        "if len(self.rollbacks) >= self.cfg.max_rollbacks:",
        "if len(self.rollbacks) > self.cfg.max_rollbacks:",
        ("tests/test_loss_spike.py::test_a_spike_that_cannot_roll_back_is_every_ranks_error",),
    ),
    Mutant(
        "async save: rank 0 moves latest without the other ranks' writes",
        "checkpoint/async_save.py",
        '[f"{job.key}/rank{r}" for r in range(job.world)]',
        '[f"{job.key}/rank{r}" for r in range(1)]',
        (
            "tests/test_async_save.py::"
            "test_a_failed_write_on_one_rank_leaves_latest_and_fails_every_rank",
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
            "tests/test_async_save.py::"
            "test_a_failed_write_on_one_rank_leaves_latest_and_fails_every_rank",
        ),
    ),
    Mutant(
        "client_state tensors come back as their markers",
        "checkpoint/client_state.py",
        "                return tensors[value[MARK]]",
        "                return value",
        ("tests/test_checkpoint.py::test_exact_resume[0-1-False]",),
    ),
    Mutant(
        "client_state tensors loaded unverified",
        "checkpoint/client_state.py",
        "            if sha256(t) != want:",
        "            if False:",
        ("tests/test_checkpoint.py::test_client_state_is_json_and_tensors_checked",),
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
        "client_state keys collide ({'a/b': t} and {'a': {'b': t}})",
        "checkpoint/client_state.py",
        '    part = str(part).replace("~", "~0").replace("/", "~1")',
        "    part = str(part)",
        ("tests/test_checkpoint.py::test_pickled_client_state_is_opt_in_and_verified",),
    ),
    Mutant(
        "pickled client_state is loaded without the opt-in",
        "checkpoint/client_state.py",
        "        if not pickled:\n            raise CheckpointError(",
        "        if False:\n            raise CheckpointError(",
        ("tests/test_checkpoint.py::test_pickled_client_state_is_opt_in_and_verified",),
    ),
    Mutant(
        "pickled client_state is loaded unverified",
        "checkpoint/client_state.py",
        '        if _digest(blob) != record["pickled"]["sha256"]:',
        "        if False:",
        ("tests/test_checkpoint.py::test_pickled_client_state_is_opt_in_and_verified",),
    ),
    Mutant(
        "a forward-only engine's load reads optimizer state it has not got",
        "checkpoint/restore.py",
        "    with_state = load_optimizer_states and not load_module_only and opt is not None",
        "    with_state = load_optimizer_states and not load_module_only",
        ("tests/test_initialize.py::test_no_optimizer_is_a_forward_only_engine",),
    ),
    Mutant(
        "the async save's agreement polls the store every 20 ms however long it waits",
        "checkpoint/async_save.py",
        "        pause = min(2 * pause, longest)",
        "        pass",
        (
            "tests/test_async_save.py::"
            "test_waiting_for_the_other_ranks_asks_the_store_ever_less_often",
        ),
    ),
    Mutant(
        "a DeepSpeed stage-3 parameter joined from the ranks' pieces in the wrong order",
        "checkpoint/deepspeed_read.py",
        "for f in flats])[:n]",
        "for f in flats[::-1]])[:n]",
        (
            "tests/test_deepspeed_checkpoints.py::"
            "test_a_deepspeed_folder_resumes_with_deepspeeds_next_losses",
        ),
    ),
    Mutant(
        "a DeepSpeed stage 1-2 group joined from the ranks' partitions in the wrong order",
        "checkpoint/deepspeed_read.py",
        "flat = torch.cat([rank[g].float() for rank in parts[e::ep]])",
        "flat = torch.cat([rank[g].float() for rank in parts[e::ep][::-1]])",
        (
            "tests/test_deepspeed_checkpoints.py::"
            "test_a_deepspeed_folder_resumes_with_deepspeeds_next_losses",
        ),
    ),
    Mutant(
        "DeepSpeed's optimizer moments read from the fp32 partition",
        "checkpoint/deepspeed_read.py",
        '        if kind == "master":\n            key =',
        "        if True:\n            key =",
        (
            "tests/test_deepspeed_checkpoints.py::"
            "test_a_deepspeed_folder_resumes_with_deepspeeds_next_losses",
        ),
    ),
    Mutant(
        "a DeepSpeed .pt file unpickled with its classes' code",
        "checkpoint/deepspeed_read.py",
        '            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)',
        '            return torch.load(path, map_location="cpu", weights_only=False, mmap=True)',
        (
            "tests/test_deepspeed_checkpoints.py::"
            "test_a_class_off_the_allow_list_is_refused_before_anything_loads",
        ),
    ),
    Mutant(
        "DeepSpeed's client state left behind",
        "checkpoint/deepspeed_read.py",
        '            "client_state": {k: v for k, v in m.items() if k not in _KNOWN},',
        '            "client_state": {},',
        (
            "tests/test_deepspeed_checkpoints.py::"
            "test_a_deepspeed_folder_resumes_with_deepspeeds_next_losses",
        ),
    ),
    Mutant(
        "a frozen parameter in a DeepSpeed folder loads as zeros",
        "checkpoint/deepspeed_read.py",
        "n: self.weights[n].float().reshape(-1) for n in frozen",
        "n: torch.zeros(self.weights[n].numel()) for n in frozen",
        (
            "tests/test_deepspeed_checkpoints.py::"
            "test_a_deepspeed_folder_resumes_with_deepspeeds_next_losses[zero2_frozen]",
        ),
    ),
    Mutant(
        "DeepSpeed's stage 1-2 moments written one element off their partition",
        "checkpoint/deepspeed_optim.py",
        "        states[g] = _state(kind, steps[g], values)",
        "        states[g] = _state(kind, steps[g], {k: v.roll(1) for k, v in values.items()})",
        (
            "tests/test_deepspeed_write.py::"
            "test_a_deepspeed_folder_saved_again_is_deepspeeds_bit_for_bit[zero2]",
        ),
    ),
    Mutant(
        "DeepSpeed's fp32 partition written with its padding",
        "checkpoint/deepspeed_optim.py",
        'fp32.append(values.pop("master")[: size - padding].clone())',
        'fp32.append(values.pop("master").clone())',
        (
            "tests/test_deepspeed_write.py::"
            "test_a_deepspeed_folder_saved_again_is_deepspeeds_bit_for_bit[zero2_odd]",
        ),
    ),
    Mutant(
        "DeepSpeed's group padding counted on no rank",
        "checkpoint/deepspeed_optim.py",
        "        padding = size if total <= lo else max(0, lo + size - total)",
        "        padding = 0",
        (
            "tests/test_deepspeed_write.py::"
            "test_a_deepspeed_folder_saved_again_is_deepspeeds_bit_for_bit[zero2_odd]",
        ),
    ),
    Mutant(
        "DeepSpeed's loss scaler left out of the optimizer file",
        "checkpoint/deepspeed_write.py",
        '"loss_scaler": _scaler(layout, scaler),',
        '"loss_scaler": None,',
        (
            "tests/test_deepspeed_write.py::"
            "test_a_deepspeed_folder_saved_again_is_deepspeeds_bit_for_bit[zero1]",
        ),
    ),
    Mutant(
        "a stand-in class pickled under zerostack's name, which DeepSpeed cannot read",
        "checkpoint/deepspeed_write.py",
        "        where = _NAMES.get(obj)",
        "        where = None",
        (
            "tests/test_deepspeed_write.py::"
            "test_a_deepspeed_folder_saved_again_is_deepspeeds_bit_for_bit[zero3]",
        ),
    ),
    Mutant(
        "DeepSpeed's stage 3 pieces written in the other rank's file",
        "checkpoint/deepspeed_optim.py",
        "lo, hi = min(rank * piece, numels[i]), min((rank + 1) * piece, numels[i])",
        "lo, hi = min((dp - 1 - rank) * piece, numels[i]), min((dp - rank) * piece, numels[i])",
        (
            "tests/test_deepspeed_write.py::"
            "test_a_deepspeed_folder_saved_again_is_deepspeeds_bit_for_bit[zero3_sgd]",
        ),
    ),
    Mutant(
        "DeepSpeed's Adam step count written as torch's tensor",
        "checkpoint/deepspeed_optim.py",
        '    return {"step": int(step), **values}',
        '    return {"step": torch.tensor(float(step)), **values}',
        (
            "tests/test_deepspeed_write.py::"
            "test_a_deepspeed_folder_saved_again_is_deepspeeds_bit_for_bit[zero2_bf16]",
        ),
    ),
    Mutant(
        "the slice map's start counted from the group, not the rank's partition",
        "checkpoint/deepspeed_optim.py",
        "slices[n] = _address(y - x, x - lo)",
        "slices[n] = _address(y - x, x)",
        (
            "tests/test_deepspeed_write.py::"
            "test_a_deepspeed_folder_saved_again_is_deepspeeds_bit_for_bit[zero2]",
        ),
    ),
    Mutant(
        "tied parameters left out of DeepSpeed's model states",
        "checkpoint/deepspeed_write.py",
        'shared = {a: c for a, c in manifest["aliases"].items()} if rank == 0 else {}',
        "shared = {}",
        (
            "tests/test_deepspeed_write.py::"
            "test_a_deepspeed_folder_saved_again_is_deepspeeds_bit_for_bit[zero1]",
        ),
    ),
    Mutant(
        "DeepSpeed's stage 0 FusedAdam step read from the group's first parameter (0)",
        "checkpoint/deepspeed_read0.py",
        "            out.append((hyper, max(float(s) for s in steps) if steps else None))",
        "            out.append((hyper, float(steps[0]) if steps else None))",
        (
            "tests/test_deepspeed_checkpoints.py::"
            "test_a_deepspeed_folder_resumes_with_deepspeeds_next_losses[zero0]",
        ),
    ),
    Mutant(
        "DeepSpeed's stage 0 flat masters cut without advancing past each parameter",
        "checkpoint/deepspeed_read0.py",
        "                    offset += n\n                continue",
        "                    offset += 0\n                continue",
        (
            "tests/test_deepspeed_checkpoints.py::"
            "test_a_deepspeed_folder_resumes_with_deepspeeds_next_losses[zero0_bf16]",
        ),
    ),
    Mutant(
        "DeepSpeed's stage 0 state paired with the module's order, not the loading run's groups",
        "checkpoint/deepspeed_read0.py",
        "        names = groups if groups is not None else self._in_order(weights)",
        "        names = self._in_order(weights)",
        (
            "tests/test_deepspeed_checkpoints.py::"
            "test_a_stage_0_folder_of_another_grouping_is_refused",
        ),
    ),
    Mutant(
        "DeepSpeed's stage 0 FusedAdam step written on every parameter",
        "checkpoint/deepspeed_optim.py",
        'step = steps[g] if layout.kind == "torch" or i == ids[-1] else 0',
        "step = steps[g]",
        (
            "tests/test_deepspeed_write.py::"
            "test_a_deepspeed_folder_saved_again_is_deepspeeds_bit_for_bit[zero0]",
        ),
    ),
    Mutant(
        "fp16's last-step overflow flag written as False",
        "checkpoint/deepspeed_write.py",
        'overflow = dynamic and scaler["last_overflow_iter"] == scaler["cur_iter"] - 1',
        "overflow = False",
        (
            "tests/test_deepspeed_write.py::"
            "test_a_deepspeed_folder_saved_again_is_deepspeeds_bit_for_bit[zero2_fp16]",
        ),
    ),
    Mutant(
        "fp16's dynamic loss scaler written as a fixed one",
        "checkpoint/deepspeed_optim.py",
        '    if not (layout.fp16 and layout.scaler["dynamic"]):',
        "    if True:",
        (
            "tests/test_deepspeed_write.py::"
            "test_a_deepspeed_folder_saved_again_is_deepspeeds_bit_for_bit[zero3_fp16]",
        ),
    ),
    Mutant(
        "DeepSpeed's stage 0 fp16 scale state left out of FP16_Optimizer's dict",
        "checkpoint/deepspeed_optim.py",
        "    if layout.fp16:\n        out.update(",
        "    if False:\n        out.update(",
        (
            "tests/test_deepspeed_write.py::"
            "test_a_deepspeed_folder_saved_again_is_deepspeeds_bit_for_bit[zero0_fp16]",
        ),
    ),
    Mutant(
        "a universal ZeRO-3 checkpoint's Adam step not read (the count starts over)",
        "checkpoint/deepspeed_universal.py",
        '                step = state[0]["step"] if state else None',
        "                step = None",
        (
            "tests/test_deepspeed_checkpoints.py::"
            "test_a_deepspeed_folder_resumes_with_deepspeeds_next_losses[zero3_universal]",
        ),
    ),
    Mutant(
        "DeepSpeed's latest_universal not followed",
        "checkpoint/restore.py",
        "        if os.path.exists(other) and (universal or not os.path.exists(latest)):",
        "        if False:",
        (
            "tests/test_deepspeed_checkpoints.py::"
            "test_a_deepspeed_folder_resumes_with_deepspeeds_next_losses[zero2_universal]",
        ),
    ),
    Mutant(
        "a universal checkpoint's per-parameter dict written in another key order",
        "checkpoint/deepspeed_universal.py",
        'value = {"cat_dim": 0, "param": value} if layout.stage < 3 else value.reshape(-1)',
        'value = {"param": value, "cat_dim": 0} if layout.stage < 3 else value.reshape(-1)',
        (
            "tests/test_convert.py::"
            "test_deepspeeds_folder_converted_to_deepspeed_is_itself_bit_for_bit[zero2_universal]",
        ),
    ),
    Mutant(
        "a universal checkpoint's optimizer_state.pt without the param groups",
        "checkpoint/deepspeed_universal.py",
        '        out["param_groups"] = sd["base_optimizer_state"]["param_groups"]',
        "        pass",
        (
            "tests/test_convert.py::"
            "test_deepspeeds_folder_converted_to_deepspeed_is_itself_bit_for_bit[zero2_universal]",
        ),
    ),
    Mutant(
        "ZeRO-3's frozen pieces joined in the wrong rank order",
        "checkpoint/deepspeed_read.py",
        ".float().reshape(-1) for m in ranks])",
        ".float().reshape(-1) for m in ranks[::-1]])",
        (
            "tests/test_deepspeed_checkpoints.py::"
            "test_a_deepspeed_folder_resumes_with_deepspeeds_next_losses[zero3_frozen]",
        ),
    ),
    Mutant(
        "a pipeline stage's partitions read from the first stage's optimizer files",
        "checkpoint/deepspeed_read.py",
        "        optim = zero_files(folder, mp)",
        "        optim = zero_files(folder, 0)",
        (
            "tests/test_deepspeed_checkpoints.py::"
            "test_a_deepspeed_folder_resumes_with_deepspeeds_next_losses[pipe_zero1]",
        ),
    ),
    Mutant(
        "DeepSpeed's experts of every ep rank read from the first ep rank's partitions",
        "checkpoint/deepspeed_read.py",
        "flat = torch.cat([rank[g].float() for rank in parts[e::ep]])",
        "flat = torch.cat([rank[g].float() for rank in parts[::ep]])",
        (
            "tests/test_deepspeed_checkpoints.py::"
            "test_a_deepspeed_folder_resumes_with_deepspeeds_next_losses[moe_zero2]",
        ),
    ),
    Mutant(
        "every pipeline stage's model states written as stage 0's",
        "checkpoint/deepspeed_write.py",
        '        name = f"mp_rank_{layout.mp:02d}_model_states.pt"',
        '        name = "mp_rank_00_model_states.pt"',
        (
            "tests/test_deepspeed_write.py::"
            "test_a_deepspeed_folder_saved_again_is_deepspeeds_bit_for_bit[pipe_zero1]",
        ),
    ),
    Mutant(
        "a pipeline's DeepSpeed files let through at ZeRO-0",
        "checkpoint/deepspeed_layout.py",
        "    if topo.pp > 1 and stage != 1:",
        "    if False:",
        ("tests/test_deepspeed_write.py::test_a_pipelines_files_are_written_at_zero_1_only",),
    ),
    Mutant(
        "DeepSpeed's expert groups cut over every dp rank, not the ep rank's own",
        "checkpoint/deepspeed_optim.py",
        "            (layout.dp // layout.ep, rank // layout.ep)\n"
        "            if g in layout.expert_groups\n",
        "            (layout.dp, rank)\n            if g in layout.expert_groups\n",
        (
            "tests/test_deepspeed_write.py::"
            "test_a_deepspeed_folder_saved_again_is_deepspeeds_bit_for_bit[moe_zero2]",
        ),
    ),
    Mutant(
        "an ep rank's experts written under their local index",
        "checkpoint/deepspeed_write.py",
        "            number = layout.ep_rank * local + index",
        "            number = index",
        (
            "tests/test_deepspeed_write.py::"
            "test_a_deepspeed_folder_saved_again_is_deepspeeds_bit_for_bit[moe_zero2]",
        ),
    ),
    Mutant(
        "DeepSpeed's row-parallel AutoTP slices joined along their outputs",
        "checkpoint/deepspeed_tp.py",
        "whole = torch.cat(slices, dim=1 if any(p.match(name) for p in self.rows) else 0)",
        "whole = torch.cat(slices, dim=0)",
        (
            "tests/test_deepspeed_checkpoints.py::"
            "test_a_deepspeed_folder_resumes_with_deepspeeds_next_losses[tp2_zero1]",
        ),
    ),
    Mutant(
        "a non-persistent buffer a checkpoint rightly lacks refused at load",
        "checkpoint/restore.py",
        "            if not load_module_strict or name not in persistent:",
        "            if not load_module_strict:",
        (
            "tests/test_deepspeed_checkpoints.py::"
            "test_a_deepspeed_folder_resumes_with_deepspeeds_next_losses[tp2_zero1]",
        ),
    ),
    Mutant(
        "DeepSpeed's files never written under the facade",
        "checkpoint/deepspeed_layout.py",
        "    return why is None",
        "    return False",
        (
            "tests/test_deepspeed_write.py::"
            "test_a_deepspeed_folder_saved_again_is_deepspeeds_bit_for_bit[zero1]",
        ),
    ),
    Mutant(
        "a layout DeepSpeed's files cannot describe let through",
        "checkpoint/deepspeed_layout.py",
        "    if zero.round_robin_gradients:\n",
        "    if False:\n",
        (
            "tests/test_deepspeed_write.py::"
            "test_deepspeed_files_where_they_cannot_be_written_are_refused",
        ),
    ),
    Mutant(
        "natively, DeepSpeed's files written unasked",
        "checkpoint/deepspeed_layout.py",
        "    if not served_as_deepspeed(cfg):\n        return False",
        "    if False:\n        return False",
        ("tests/test_deepspeed_write.py::test_natively_only_zerostacks_files_unless_asked",),
    ),
    Mutant(
        "the facade's warning repeated at every save",
        "checkpoint/deepspeed_layout.py",
        'and not getattr(run, "_warned_deepspeed_files", False)',
        "and True",
        (
            "tests/test_deepspeed_write.py::"
            "test_under_the_facade_a_layout_without_deepspeeds_files_says_so_at_its_first_save",
        ),
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
        '"precision": self._precision(),',
        '"precision": "fp32",',
        (
            "tests/test_convert.py::"
            "test_deepspeeds_folder_converted_to_deepspeed_is_itself_bit_for_bit[zero2_bf16]",
        ),
    ),
    Mutant(
        "a checked tensor's element range read from its start",
        "checkpoint/stream.py",
        "begin, end, shape = begin + lo * dtype.itemsize, begin + hi * dtype.itemsize, [hi - lo]",
        "begin, end, shape = begin, begin + (hi - lo) * dtype.itemsize, [hi - lo]",
        (
            "tests/test_convert.py::"
            "test_deepspeed_to_zerostack_to_deepspeed_is_deepspeeds_bit_for_bit[zero2]",
        ),
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
        (
            "tests/test_convert.py::"
            "test_deepspeeds_folder_converted_to_deepspeed_is_itself_bit_for_bit[zero2_frozen]",
        ),
    ),
    Mutant(
        "a load gives every master every moment the checkpoint holds (Muon's get Adam's)",
        "checkpoint/restore.py",
        "held = [k for k in kinds if any(reader.has(names[p], k) for p, *_ in owned[master])]",
        "held = list(kinds)",
        ("tests/test_muon.py::test_a_checkpoint_resumes_exactly[1]",),
    ),
    Mutant(
        "a load leaves Muon's momentum at zero (the moment not read)",
        "checkpoint/restore.py",
        "held = [k for k in kinds if any(",
        'held = [k for k in kinds if k != "momentum_buffer" and any(',
        ("tests/test_muon.py::test_the_momentum_reshards_onto_another_layout[1-3]",),
    ),
    Mutant(
        "DeepSpeed's files written for Muon (not refused: a save then fails)",
        "checkpoint/deepspeed_layout.py",
        '        parts.append("optimizer.type Muon (its halves keep different moments)")\n',
        "        pass\n",
        ("tests/test_muon.py::test_layouts_not_served_yet_are_refused_at_initialize",),
    ),
]
