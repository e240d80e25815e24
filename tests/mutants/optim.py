"""The mutants of src/zerostack/optim/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "optimizer type SGD: the config's maximize not passed on (torch's SGD descends)",
        "optim/__init__.py",
        "            maximize=p.maximize,\n            foreach=p.foreach,\n        )",
        "            foreach=p.foreach,\n        )",
        (
            "tests/test_optimizer_types.py::"
            "test_sgds_torch_keys_reach_it_and_fused_adams_set_grad_none_loads",
        ),
    ),
    Mutant(
        "optimizer type Lion: the config's weight decay not passed on",
        "optim/__init__.py",
        "return Lion(groups, lr=p.lr, betas=tuple(p.betas), weight_decay=p.weight_decay)",
        "return Lion(groups, lr=p.lr, betas=tuple(p.betas))",
        (
            "tests/test_optimizer_types.py::test_losses_are_deepspeeds[lion_zero2_offload-2]",
            "tests/test_optimizer_types.py::test_the_types_build_their_optimizers_with_the_configs_values",
        ),
    ),
    Mutant(
        "optimizer type Lion: the betas swapped",
        "optim/__init__.py",
        "return Lion(groups, lr=p.lr, betas=tuple(p.betas), weight_decay=p.weight_decay)",
        "return Lion(groups, lr=p.lr, betas=tuple(p.betas)[::-1], weight_decay=p.weight_decay)",
        (
            "tests/test_optimizer_types.py::test_losses_are_deepspeeds[lion_zero3_offload_clipped-2]",
        ),
    ),
    Mutant(
        "optimizer type Adagrad: the config's lr_decay not passed on",
        "optim/__init__.py",
        "            lr_decay=p.lr_decay,\n",
        "",
        (
            "tests/test_optimizer_types.py::test_losses_are_deepspeeds[adagrad_zero1-2]",
            "tests/test_optimizer_types.py::test_the_types_build_their_optimizers_with_the_configs_values",
        ),
    ),
    Mutant(
        "optimizer type Adagrad: the initial accumulator starts at zero whatever the config",
        "optim/__init__.py",
        "            initial_accumulator_value=p.initial_accumulator_value,\n",
        "",
        ("tests/test_optimizer_types.py::test_losses_are_deepspeeds[adagrad_zero1-1]",),
    ),
    Mutant(
        "Lion moves a weight without gradient by a whole lr (DeepSpeed's copysign)",
        "optim/lion.py",
        "p.add_(torch.sign(m * beta1 + g * (1 - beta1)), alpha=-lr)",
        "p.add_(torch.where(m * beta1 + g * (1 - beta1) >= 0, 1.0, -1.0), alpha=-lr)",
        (
            "tests/test_optimizer_types.py::test_where_deepspeeds_lion_moves_a_weight_without_gradient_ours_leaves_it",
        ),
    ),
    Mutant(
        "WarmupLR without warmup_max_lr warms up to 0.001, not the optimizer's lr",
        "optim/lr_schedules.py",
        'warmup_max_lr = [group["lr"] for group in optimizer.param_groups]',
        "warmup_max_lr = 0.001",
        (
            "tests/test_lr_schedules.py::"
            "test_warmup_lr_without_a_max_warms_up_to_each_groups_own_lr",
        ),
    ),
    Mutant(
        "torch_adam ignored: CPUAdam with the optimizer offloaded",
        "optim/__init__.py",
        "if offload and not p.torch_adam:",
        "if offload:",
        ("tests/test_config_keys.py::test_torch_adam_is_torch_optims_plain_adam_also_offloaded",),
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
        "OneCycle: the stairs not held flat (the continuous position divided)",
        "optim/lr_schedules.py",
        "            scale = math.floor(position) / stairs",
        "            scale = position / stairs",
        ("tests/test_one_cycle.py::test_lrs_and_betas_equal_deepspeeds_bit_for_bit",),
    ),
    Mutant(
        "OneCycle: the first beta moves with the lr instead of against it",
        "optim/lr_schedules.py",
        "            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in pairs]",
        "            return [(lo[0] + (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in pairs]",
        ("tests/test_one_cycle.py::test_lrs_and_betas_equal_deepspeeds_bit_for_bit",),
    ),
    Mutant(
        "OneCycle: the lr grows after the cycle instead of decaying",
        "optim/lr_schedules.py",
        "        return [lo / factor for lo in self.min_lrs]",
        "        return [lo * factor for lo in self.min_lrs]",
        ("tests/test_one_cycle.py::test_lrs_and_betas_equal_deepspeeds_bit_for_bit",),
    ),
    Mutant(
        "LRRangeTest: the staircase ignored",
        "optim/lr_schedules.py",
        "math.floor(interval) if self.staircase else interval",
        "interval",
        ("tests/test_one_cycle.py::test_lrs_and_betas_equal_deepspeeds_bit_for_bit",),
    ),
    Mutant(
        "Muon applied to an embedding (the name rule dropped)",
        "optim/muon.py",
        'return len(shape) >= 2 and "embed" not in lowered and "lm_head" not in lowered',
        'return len(shape) >= 2 and "lm_head" not in lowered',
        ("tests/test_muon.py::test_losses_and_muon_parameters_are_deepspeeds[zero1-1]",),
    ),
    Mutant(
        "Muon: the auxiliary Adam takes Muon's learning rate",
        "optim/muon.py",
        'False: {"lr": params.adam_rate,',
        'False: {"lr": params.muon_rate,',
        ("tests/test_muon.py::test_losses_and_muon_parameters_are_deepspeeds[zero1-1]",),
    ),
    Mutant(
        "Muon under zero.Init: the tag read from the piece's shape (DeepSpeed's bug until #8438)",
        "optim/muon.py",
        "    shape = p.shape if shape is None else shape\n",
        "    shape = p.shape\n",
        ("tests/test_muon.py::test_losses_and_muon_parameters_are_deepspeeds[zero3_init-1]",),
    ),
    Mutant(
        "Muon without Nesterov's look-ahead (the momentum orthogonalised)",
        "optim/muon.py",
        "look = p.grad.lerp(m, beta)",
        "look = m.clone()",
        ("tests/test_muon.py::test_losses_and_muon_parameters_are_deepspeeds[zero1-1]",),
    ),
    Mutant(
        "Muon: the update not scaled by sqrt(rows / cols) for a tall matrix",
        "optim/muon.py",
        "scale = math.sqrt(rows / cols) if rows > cols else 1.0",
        "scale = 1.0",
        ("tests/test_muon.py::test_losses_and_muon_parameters_are_deepspeeds[zero1-1]",),
    ),
    Mutant(
        "Muon: the Gram iteration's restart leaves r stale",
        "optim/muon.py",
        "            x, q = q @ x, None\n            r = x @ x.mT\n",
        "            x, q = q @ x, None\n",
        ("tests/test_muon.py::test_gram_newton_schulz_is_the_standard_iteration_rearranged",),
    ),
    Mutant(
        "Muon: the auxiliary Adam's L2 mode decays decoupled as AdamW does",
        "optim/muon.py",
        "grad = p.grad if self.adam_w_mode or wd == 0 else p.grad.add(p, alpha=wd)",
        "grad = p.grad",
        ("tests/test_muon.py::test_losses_and_muon_parameters_are_deepspeeds[zero2_adam_l2-1]",),
    ),
    Mutant(
        "LAMB: one trust ratio per master, a flat partition (DeepSpeed's ZeRO), not per parameter",
        "optim/lamb.py",
        "                if self.whole is not None and self.whole.holds(p):\n",
        "                if False:\n",
        ("tests/test_parity.py::test_matches_single_process_at_every_step[lamb-dp1]",),
    ),
    Mutant(
        "LAMB: the trust ratio not clamped from below",
        "optim/lamb.py",
        '.clamp(group["min_coeff"], group["max_coeff"])',
        '.clamp(max=group["max_coeff"])',
        ("tests/test_lamb.py::test_each_step_is_fusedlambs_kernel_arithmetic[clamped-low]",),
    ),
    Mutant(
        "LAMB: the bias correction's square root left out",
        "optim/lamb.py",
        "(1 - b2**t) ** 0.5 / (1 - b1**t)",
        "(1 - b2**t) / (1 - b1**t)",
        ("tests/test_lamb.py::test_each_step_is_fusedlambs_kernel_arithmetic[defaults]",),
    ),
    Mutant(
        "LAMB: eps_inside_sqrt ignored",
        "optim/lamb.py",
        '(v + eps).sqrt() if group["eps_inside_sqrt"] else',
        "(v + eps).sqrt() if False else",
        ("tests/test_lamb.py::test_each_step_is_fusedlambs_kernel_arithmetic[decay-eps-inside]",),
    ),
    Mutant(
        "LAMB: weight decay left out of the update (and its norm)",
        "optim/lamb.py",
        "update = (m / denom).add_(p, alpha=wd)",
        "update = m / denom",
        ("tests/test_lamb.py::test_each_step_is_fusedlambs_kernel_arithmetic[decay-eps-inside]",),
    ),
    Mutant(
        "CPUAdam: a 16-bit param stepped with 16-bit moments though fp32_optimizer_states",
        "optim/cpu_adam.py",
        "wide = p.dtype != torch.float32 and self.fp32_optimizer_states",
        "wide = False",
        (
            "tests/test_cpu_adam.py::test_a_16_bit_param_steps_in_fp32_with_fp32_moments_and_is_rounded[dtype0]",
        ),
    ),
]
