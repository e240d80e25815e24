"""The mutants of src/zerostack/integrations/ (the gate: tests/mutants/__init__.py)."""

from . import Mutant

MUTANTS: list[Mutant] = [
    Mutant(
        "the Lightning strategy divides the loss by the accumulation steps again",
        "integrations/lightning.py",
        "backward(tensor, *args, scale_wrt_gas=False, **kwargs)",
        "backward(tensor, *args, **kwargs)",
        ("tests/test_lightning.py::test_native_strategy_steps_as_ddp[3]",),
    ),
    Mutant(
        "the Lightning strategy loses Lightning's own state on resume (loops start over)",
        "integrations/lightning.py",
        "                load_module_strict=module.strict_loading,\n"
        "            )\n"
        "            return client",
        "                load_module_strict=module.strict_loading,\n"
        "            )\n"
        "            return {}",
        ("tests/test_lightning.py::test_native_strategy_resumes_and_validates_its_checkpoints",),
    ),
    Mutant(
        "the Lightning strategy clips at DeepSpeed's 1.0 when the Trainer does not clip",
        "integrations/lightning_config.py",
        '    config.setdefault("gradient_clipping", 0.0)',
        "    pass",
        ("tests/test_lightning.py::test_the_trainers_settings_fill_the_config",),
    ),
    Mutant(
        "a config's accumulation steps silently lose to the Trainer's",
        "integrations/lightning_config.py",
        "    if key in config and config[key] != value:",
        "    if False:",
        ("tests/test_lightning.py::test_contradicting_settings_are_refused_naming_both",),
    ),
    Mutant(
        "fresh-process validation skips the checkpoint's weights",
        "integrations/lightning.py",
        '        return {**client, "state_dict": full_state_dict(path, tag=TAG)}',
        '        return {**client, "state_dict": self.lightning_module.state_dict()}',
        ("tests/test_lightning.py::test_native_strategy_resumes_and_validates_its_checkpoints",),
    ),
]
